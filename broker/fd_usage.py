"""How close RabbitMQ is to its file-descriptor limit.

In key mode every classic queue that holds messages keeps files open (about one fd on queue
version 1, two on version 2, as measured on RabbitMQ 3.10), so thousands of keys can exhaust a
``nofile`` of 1024: queues then crash with ``emfile`` and a vhost can stop altogether. The node
itself reports the real figure (its open fds and its limit), through ``rabbitmq_prometheus``
(``KEYQ_PROMETHEUS_URL``, read first) or the management API (``KEYQ_MANAGEMENT_URL``: not on
RabbitMQ 4.x with its metrics collection off); ``rabbitmq-diagnostics status`` counts only the
handles RabbitMQ's own file handle cache tracks, which leaves queue version 2 files out.
Without either the figure is unknown, which is reported as such and never raised.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from keyq.broker.errors import ManagementUnavailable, PrometheusUnavailable
from keyq.broker.management import get_json
from keyq.broker.prometheus_api import NodeFds, node_fds
from keyq.broker.settings import Settings

log = logging.getLogger("keyq.broker")

NODES_PATH = "/api/nodes?columns=name,running,fd_used,fd_total"
NOT_SET = "neither KEYQ_PROMETHEUS_URL nor KEYQ_MANAGEMENT_URL is set"
NO_FIGURES = (
    "the management API reports no fd figures: not yet, or not at all where RabbitMQ 4.x has "
    "its metrics collection off (KEYQ_PROMETHEUS_URL reads them from rabbitmq_prometheus)"
)


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
    source: str | None = None  # "prometheus" or "management"

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
            source=data.get("source"),
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
            "source": self.source,
        }


def read_fd_usage(settings: Settings) -> FdUsage:
    """The fd use of the broker's running node closest to its limit: from rabbitmq_prometheus
    if it is set and answers, else from the management API; unknown (never an exception) when
    neither is set, reachable or reporting."""
    ratio = settings.fd_warn_ratio
    reason = NOT_SET
    if settings.prometheus_url:
        try:
            nodes = node_fds(settings.prometheus_url, settings.connect_timeout)
        except PrometheusUnavailable as exc:
            log.debug("broker file descriptors not from rabbitmq_prometheus: %s", exc)
            nodes, reason = [], str(exc)
        if nodes:
            return _closest(ratio, nodes, "prometheus")
        if reason == NOT_SET:  # it answered, without the figures
            reason = "rabbitmq_prometheus reports no fd figures yet"
    if not settings.management_url:
        return FdUsage(ratio, unknown_reason=reason)
    try:
        listed = get_json(settings.management_url, NODES_PATH, settings.connect_timeout)
    except ManagementUnavailable as exc:
        log.debug("broker file descriptors unknown: %s", exc)
        return FdUsage(ratio, unknown_reason=str(exc))
    figures = [
        NodeFds(str(node.get("name")), node["fd_used"], node["fd_total"])
        for node in (listed if isinstance(listed, list) else [])
        if isinstance(node, dict)
        and node.get("running", True)
        and _count(node.get("fd_used")) >= 0
        and _count(node.get("fd_total")) > 0
    ]
    if not figures:
        # A node reports them a few seconds after it started; RabbitMQ 4.x may not at all.
        return FdUsage(ratio, unknown_reason=NO_FIGURES)
    return _closest(ratio, figures, "management")


def _closest(ratio: float, nodes: list[NodeFds], source: str) -> FdUsage:
    worst = max(nodes, key=lambda fds: (fds.used / fds.limit, fds.used))
    return FdUsage(ratio, used=worst.used, limit=worst.limit, node=worst.node, source=source)


def _count(value: object) -> int:
    """The value if it is a count, else -1."""
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.0%}"
