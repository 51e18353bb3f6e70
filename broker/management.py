"""RabbitMQ's management HTTP API, read-only: AMQP cannot list queues or report the node's
file descriptors, so what needs them asks here (``KEYQ_MANAGEMENT_URL``).

Requests go through ``broker.http_get``: credentials in the ``Authorization`` header only,
errors naming the API by its redacted URL.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from keyq.broker.errors import ManagementUnavailable
from keyq.broker.http_get import http_get
from keyq.broker.urls import redact_url

DEFAULT_PORT = 15672
HTTP_FORBIDDEN = 403


def get_json(management_url: str, path: str, timeout: float) -> Any:
    """``GET path`` (with its query) on the API at ``management_url``, parsed.

    Raises ``ManagementUnavailable`` if the API does not answer, refuses us or answers with
    something that is not JSON.
    """
    body = http_get(
        management_url,
        path,
        timeout,
        what="management API",
        error=ManagementUnavailable,
        default_port=DEFAULT_PORT,
        default_credentials=("guest", "guest"),
        hints={HTTP_FORBIDDEN: "the user's tags do not allow it (node figures need 'monitoring')"},
    )
    try:
        return json.loads(body)
    except ValueError:
        raise ManagementUnavailable(
            f"management API at {redact_url(management_url)} answered {path.partition('?')[0]} "
            "with something that is not JSON"
        ) from None


def queue_figures(
    management_url: str, vhost: str, timeout: float
) -> dict[str, tuple[int, int] | None]:
    """(ready messages, consumers) of every queue of ``vhost`` in two requests, where a
    status for 100,000 queues would otherwise take 100,000 passive declares. Depths come
    from the queues' own totals (``disable_stats``: no statistics to gather per queue, and a
    queue declared a moment ago has them too), consumers from the consumer listing. A queue
    listed without a depth maps to None; a queue that does not exist is absent."""
    where = urllib.parse.quote(vhost, safe="")
    rows = _listing(
        management_url,
        f"/api/queues/{where}?disable_stats=true&enable_queue_totals=true",
        timeout,
    )
    consumers: dict[str, int] = {}
    for consumer in _listing(management_url, f"/api/consumers/{where}", timeout):
        queue = consumer.get("queue")
        name = queue.get("name") if isinstance(queue, dict) else None
        if isinstance(name, str):
            consumers[name] = consumers.get(name, 0) + 1
    figures: dict[str, tuple[int, int] | None] = {}
    for row in rows:
        name, ready = str(row["name"]), row.get("messages_ready")
        figures[name] = (ready, consumers.get(name, 0)) if isinstance(ready, int) else None
    return figures


def _listing(management_url: str, path: str, timeout: float) -> list[Any]:
    rows = get_json(management_url, path, timeout)
    if not isinstance(rows, list):
        raise ManagementUnavailable(
            f"management API at {redact_url(management_url)} answered {path.partition('?')[0]} "
            "with something that is not a list"
        )
    return rows
