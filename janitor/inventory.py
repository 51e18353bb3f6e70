"""Which queues exist on the broker: AMQP cannot list queues, so the management API or, on the
broker's own machine, ``rabbitmqctl``. Used only to find keyq queues a crash left unregistered.
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.parse

from keyq.broker.errors import ManagementUnavailable
from keyq.broker.management import get_json

TIMEOUT_S = 30


class InventoryUnavailable(Exception):
    """No way to list the broker's queues here (no management API, no rabbitmqctl)."""


def list_queues(management_url: str | None, vhost: str = "/") -> list[str]:
    """Names of the vhost's queues."""
    if management_url:
        return _from_management(management_url, vhost)
    if shutil.which("rabbitmqctl"):
        return _from_rabbitmqctl(vhost)
    raise InventoryUnavailable("set KEYQ_MANAGEMENT_URL to find queues left unregistered")


def _from_management(url: str, vhost: str) -> list[str]:
    path = f"/api/queues/{urllib.parse.quote(vhost, safe='')}?columns=name"
    try:
        rows = get_json(url, path, TIMEOUT_S)
    except ManagementUnavailable as exc:
        raise InventoryUnavailable(str(exc)) from None
    return [str(row["name"]) for row in rows]


def _from_rabbitmqctl(vhost: str) -> list[str]:
    try:
        done = subprocess.run(
            ["rabbitmqctl", "list_queues", "-p", vhost, "name", "-q", "--no-table-headers"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InventoryUnavailable(f"rabbitmqctl failed: {exc}") from None
    if done.returncode != 0:
        raise InventoryUnavailable(f"rabbitmqctl failed: {done.stderr.strip()[:200]}")
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]
