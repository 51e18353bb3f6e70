"""Which queues exist on the broker: AMQP cannot list queues, so the management API or, on the
broker's own machine, ``rabbitmqctl``. Used only to find keyq queues a crash left unregistered.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request

from keyq.broker.urls import redact_url

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
    parts = urllib.parse.urlsplit(url)
    base = f"{parts.scheme}://{parts.hostname}:{parts.port or 15672}"
    request = urllib.request.Request(
        f"{base}/api/queues/{urllib.parse.quote(vhost, safe='')}?columns=name"
    )
    user = urllib.parse.unquote(parts.username or "guest")
    password = urllib.parse.unquote(parts.password or "guest")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            rows = json.load(response)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise InventoryUnavailable(
            f"management API at {redact_url(url)} did not answer: {reason}"
        ) from None
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
