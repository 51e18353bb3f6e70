"""RabbitMQ's management HTTP API, read-only: AMQP cannot list queues or report the node's
file descriptors, so what needs them asks here (``KEYQ_MANAGEMENT_URL``).

Credentials go in the ``Authorization`` header only; every error names the API by its
redacted URL and never chains the library exception, which could carry them.
"""

from __future__ import annotations

import base64
import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from keyq.broker.errors import ManagementUnavailable
from keyq.broker.urls import redact_url, scrub

DEFAULT_PORT = 15672
HTTP_UNAUTHORIZED = 401
HTTP_FORBIDDEN = 403


def get_json(management_url: str, path: str, timeout: float) -> Any:
    """``GET path`` (with its query) on the API at ``management_url``, parsed.

    Raises ``ManagementUnavailable`` if the API does not answer, refuses us or answers with
    something that is not JSON.
    """
    shown = redact_url(management_url)
    try:
        parts = urllib.parse.urlsplit(management_url)
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise ManagementUnavailable(f"management API URL {shown} is not valid") from None
    host = parts.hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"
    prefix = parts.path.rstrip("/")
    request = urllib.request.Request(f"{parts.scheme}://{host}:{port}{prefix}{path}")
    user = urllib.parse.unquote(parts.username or "guest")
    password = urllib.parse.unquote(parts.password or "guest")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    # Not passed on if the API redirects, perhaps to another host or to plain http.
    request.add_unredirected_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        reason = f"HTTP {exc.code}"
        if exc.code == HTTP_UNAUTHORIZED:
            reason += ": the credentials were refused"
        elif exc.code == HTTP_FORBIDDEN:
            reason += ": the user's tags do not allow it (node figures need 'monitoring')"
        exc.close()
        raise ManagementUnavailable(f"management API at {shown} refused: {reason}") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        reason = scrub(str(getattr(exc, "reason", exc)), management_url)
        raise ManagementUnavailable(f"management API at {shown} did not answer: {reason}") from None


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
