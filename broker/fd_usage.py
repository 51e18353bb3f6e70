"""How close RabbitMQ is to its file-descriptor limit.

In key mode every classic queue that holds messages keeps files open (about one fd on queue
version 1, two on version 2, as measured on RabbitMQ 3.10), so thousands of keys can exhaust a
``nofile`` of 1024: queues then crash with ``emfile`` and a vhost can stop altogether. Only the
management API reports the real figure (``fd_used`` counts the node's open fds, ``fd_total``
is its limit); ``rabbitmq-diagnostics status`` counts only the handles RabbitMQ's own file
handle cache tracks, which leaves queue version 2 files out. Without a reachable API the figure
is unknown, which is reported as such and never raised.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from keyq.broker.errors import ManagementUnavailable
from keyq.broker.management import get_json
from keyq.broker.settings import Settings

log = logging.getLogger("keyq.broker")

NODES_PATH = "/api/nodes?columns=name,running,fd_used,fd_total"
NOT_SET = "KEYQ_MANAGEMENT_URL is not set"


def near_limit(used: int, limit: int, warn_ratio: float) -> bool:
    """True when ``used`` fds reach ``warn_ratio`` of ``limit`` (a limit of 0 is unknown)."""
    return limit > 0 and used >= warn_ratio * limit


@dataclass(frozen=True)
class FdUsage:
    """The broker's fd use: its node closest to the limit, or unknown and why."""

    warn_ratio: float
    used: int | None = None
    limit: int | None = None
    node: str | None = None
    unknown_reason: str | None = None

    @property
    def known(self) -> bool:
        return self.used is not None and self.limit is not None

    @property
    def near_limit(self) -> bool:
        if self.used is None or self.limit is None:
            return False
        return near_limit(self.used, self.limit, self.warn_ratio)

    @property
    def ratio(self) -> float | None:
        if self.used is None or not self.limit:
            return None
        return self.used / self.limit

    def summary(self) -> str:
        """One line for people: the figures, or why they are unknown."""
        if self.used is None or self.limit is None:
            return f"unknown ({self.unknown_reason})"
        return f"{self.used}/{self.limit} ({_percent(self.ratio)}) on {self.node}"

    def warning(self) -> str | None:
        """What to tell an operator when the node is near its limit, else None."""
        if not self.near_limit:
            return None
        return (
            f"RabbitMQ node {self.node} has {self.used} of its {self.limit} file descriptors "
            f"open ({_percent(self.ratio)}, warning at {_percent(self.warn_ratio)}): each "
            "key-mode queue holding messages keeps about one open; raise the node's nofile "
            "limit (see docs/operations.md)"
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FdUsage:
        """The usage back from ``as_dict`` (as ``keyq status --json`` shows it)."""
        return cls(
            data["warn_ratio"],
            used=data["fd_used"],
            limit=data["fd_limit"],
            node=data["node"],
            unknown_reason=data["unknown_reason"],
        )

    def as_dict(self) -> dict[str, Any]:
        ratio = self.ratio
        return {
            "fd_used": self.used,
            "fd_limit": self.limit,
            "fd_ratio": None if ratio is None else round(ratio, 4),
            "node": self.node,
            "warn_ratio": self.warn_ratio,
            "near_limit": self.near_limit,
            "unknown_reason": self.unknown_reason,
        }


def read_fd_usage(settings: Settings) -> FdUsage:
    """The fd use of the broker's running node closest to its limit, from the management API;
    unknown (never an exception) when the API is not set, not reachable or not reporting."""
    ratio = settings.fd_warn_ratio
    if not settings.management_url:
        return FdUsage(ratio, unknown_reason=NOT_SET)
    try:
        nodes = get_json(settings.management_url, NODES_PATH, settings.connect_timeout)
    except ManagementUnavailable as exc:
        log.debug("broker file descriptors unknown: %s", exc)
        return FdUsage(ratio, unknown_reason=str(exc))
    figures = [
        (str(node.get("name")), node["fd_used"], node["fd_total"])
        for node in (nodes if isinstance(nodes, list) else [])
        if isinstance(node, dict)
        and node.get("running", True)
        and _count(node.get("fd_used")) >= 0
        and _count(node.get("fd_total")) > 0
    ]
    if not figures:
        # A node reports them a few seconds after it started.
        return FdUsage(ratio, unknown_reason="the management API reports no fd figures yet")
    name, used, limit = max(figures, key=lambda item: (item[1] / item[2], item[1]))
    return FdUsage(ratio, used=used, limit=limit, node=name)


def _count(value: object) -> int:
    """The value if it is a count, else -1."""
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.0%}"
