"""Which queues exist on the broker: AMQP cannot list queues, so the broker's
``rabbitmq_prometheus`` (``KEYQ_PROMETHEUS_URL``) or its management API
(``KEYQ_MANAGEMENT_URL``), in that order, and nothing else: a tool run on this machine would
list a broker nobody pointed the janitor at. Used only to find keyq queues a crash left
unregistered.
"""

from __future__ import annotations

import logging
import urllib.parse

from keyq.broker.errors import KeyqError, ManagementUnavailable, PrometheusUnavailable
from keyq.broker.management import get_json
from keyq.broker.naming import QUEUE_PREFIX
from keyq.broker.prometheus_api import queue_names
from keyq.broker.settings import Settings
from keyq.broker.urls import vhost_of

log = logging.getLogger("keyq.janitor")

TIMEOUT_S = 30
NOT_SET = (
    "neither KEYQ_PROMETHEUS_URL nor KEYQ_MANAGEMENT_URL is set (AMQP cannot list queues; "
    "set one, for the broker of KEYQ_AMQP_URL, to find queues a crash left unregistered)"
)


class InventoryUnavailable(KeyqError):
    """The broker's queues cannot be listed here: no endpoint set, or none answered."""


def list_queues(settings: Settings) -> list[str]:
    """Names of the keyq queues of the vhost of ``settings.amqp_url``."""
    vhost = vhost_of(settings.amqp_url)
    prefix = f"{QUEUE_PREFIX}."
    if settings.prometheus_url:
        try:
            return sorted(queue_names(settings.prometheus_url, vhost, TIMEOUT_S, prefix=prefix))
        except PrometheusUnavailable as exc:
            if not settings.management_url:
                raise InventoryUnavailable(str(exc)) from None
            log.debug("queue list from the management API instead: %s", exc)
    if settings.management_url:
        return _from_management(settings.management_url, vhost, prefix)
    raise InventoryUnavailable(NOT_SET)


def _from_management(url: str, vhost: str, prefix: str) -> list[str]:
    path = f"/api/queues/{urllib.parse.quote(vhost, safe='')}?columns=name"
    try:
        rows = get_json(url, path, TIMEOUT_S)
    except ManagementUnavailable as exc:
        raise InventoryUnavailable(str(exc)) from None
    if not isinstance(rows, list):
        raise InventoryUnavailable("the management API's queue list is not a list")
    names = (row.get("name") for row in rows if isinstance(row, dict))
    return [name for name in names if isinstance(name, str) and name.startswith(prefix)]
