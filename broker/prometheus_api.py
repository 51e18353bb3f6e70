"""Figures from RabbitMQ's ``rabbitmq_prometheus`` plugin (``KEYQ_PROMETHEUS_URL``): queue
depths and consumers, the queue list, each node's file descriptors. Where RabbitMQ 4.x has the
management API's metrics collection off, this is where the broker reports them.

Only ``/metrics/detailed`` is asked, for the metric families needed (its metrics are named
``rabbitmq_detailed_*`` on RabbitMQ 3.10 and 4.3 alike; ``/metrics/per-object`` would send
every metric of every queue). Each node answers for itself: the queues whose process (classic)
or leader (quorum) runs there, and its own file descriptors, so the setting lists every node.
A node that does not answer is left out; only when none answers is that an error.

A queue appears some seconds after it is declared (with its first statistics), and not at all
on a node that is not listed, so a queue absent here is not missing: callers ask the queue.
"""

from __future__ import annotations

import logging
import math
import re
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from keyq.broker.errors import PrometheusUnavailable
from keyq.broker.http_get import http_get
from keyq.broker.prometheus import Exposition, Sample, parse_exposition
from keyq.broker.urls import redact_url, split_urls

log = logging.getLogger("keyq.broker")

DEFAULT_PORT = 15692
DETAILED = "/metrics/detailed"
ACCEPT = "text/plain;version=0.0.4"
IDENTITY = "rabbitmq_identity_info"
READY = "rabbitmq_detailed_queue_messages_ready"
CONSUMERS = "rabbitmq_detailed_queue_consumers"
OPEN_FDS = "rabbitmq_detailed_process_open_fds"
MAX_FDS = "rabbitmq_detailed_process_max_fds"
QUEUE_FAMILIES = ("queue_coarse_metrics", "queue_consumer_count")
NODE_FAMILIES = ("node_coarse_metrics", "node_metrics")

T = TypeVar("T")


@dataclass(frozen=True)
class NodeFds:
    """One node's open file descriptors and its limit."""

    node: str
    used: int
    limit: int


def scrape(url: str, query: list[tuple[str, str]], timeout: float, wanted: set[str]) -> Exposition:
    """The ``wanted`` metrics (and the node's identity) of ``/metrics/detailed?query`` at
    ``url``. Raises ``PrometheusUnavailable`` if the endpoint does not answer, or answers with
    something other than RabbitMQ's metrics."""
    path = f"{DETAILED}?{urllib.parse.urlencode(query)}"
    body = http_get(
        url,
        path,
        timeout,
        what="rabbitmq_prometheus",
        error=PrometheusUnavailable,
        default_port=DEFAULT_PORT,
        accept=ACCEPT,
    )
    found = parse_exposition(body.decode("utf-8", errors="replace"), only={*wanted, IDENTITY})
    if not found.named(IDENTITY):
        raise PrometheusUnavailable(
            f"rabbitmq_prometheus at {redact_url(url)} answered {DETAILED} with something that "
            f"is not RabbitMQ's metrics (no {IDENTITY})"
        )
    if found.skipped:
        unreadable = len(found.skipped)
        log.debug("rabbitmq_prometheus at %s: %d lines unreadable", redact_url(url), unreadable)
    return found


def queue_figures(
    urls: str, vhost: str, timeout: float, *, prefix: str | None = None
) -> dict[str, tuple[int, int]]:
    """(ready messages, consumers) of the queues of ``vhost`` (whose names start with
    ``prefix``, if given) that the nodes of ``urls`` report; see ``queue_figures_in``."""
    query = _queue_query(vhost, prefix)
    scrapes = _each(urls, lambda url: scrape(url, query, timeout, {READY, CONSUMERS}))
    figures = queue_figures_in(scrapes, vhost)
    return {queue: both for queue, both in figures.items() if queue.startswith(prefix or "")}


def queue_names(urls: str, vhost: str, timeout: float, *, prefix: str | None = None) -> set[str]:
    """The queues of ``vhost`` (whose names start with ``prefix``) the nodes of ``urls``
    report: every queue older than a few seconds whose node is listed."""
    query = _queue_query(vhost, prefix)
    scrapes = _each(urls, lambda url: scrape(url, query, timeout, {READY}))
    return {queue for queue in queue_names_in(scrapes, vhost) if queue.startswith(prefix or "")}


def node_fds(urls: str, timeout: float) -> list[NodeFds]:
    """The file descriptors of each node of ``urls`` that reports them."""
    query = [("family", family) for family in NODE_FAMILIES]
    scrapes = _each(urls, lambda url: scrape(url, query, timeout, {OPEN_FDS, MAX_FDS}))
    return [fds for fds in map(node_fds_in, scrapes) if fds is not None]


def queue_figures_in(scrapes: Iterable[Exposition], vhost: str) -> dict[str, tuple[int, int]]:
    """(ready messages, consumers) of each queue of ``vhost`` that the scrapes report exactly
    once with both figures. A queue reported twice (by two nodes, or by a line that another
    queue's name forged: RabbitMQ 3.10 does not escape label values) is left out, as is one
    without both figures: its caller asks the queue itself."""
    ready: dict[str, list[float]] = {}
    consumers: dict[str, list[float]] = {}
    for found in scrapes:
        for sample in found.samples:
            queue = _queue_of(sample, vhost)
            if queue is not None and sample.name in (READY, CONSUMERS):
                into = ready if sample.name == READY else consumers
                into.setdefault(queue, []).append(sample.value)
    figures: dict[str, tuple[int, int]] = {}
    for queue, depths in ready.items():
        counts = consumers.get(queue, [])
        if len(depths) == 1 and len(counts) == 1:
            depth, count = _count(depths[0]), _count(counts[0])
            if depth is not None and count is not None:
                figures[queue] = (depth, count)
    return figures


def queue_names_in(scrapes: Iterable[Exposition], vhost: str) -> set[str]:
    """The queues of ``vhost`` the scrapes report a depth for."""
    return {
        queue
        for found in scrapes
        for sample in found.named(READY)
        if (queue := _queue_of(sample, vhost)) is not None
    }


def node_fds_in(found: Exposition) -> NodeFds | None:
    """The node's file descriptors in one scrape; None if it does not report them (yet)."""
    nodes = [sample.labels.get("rabbitmq_node") for sample in found.named(IDENTITY)]
    used = [_count(sample.value) for sample in found.named(OPEN_FDS) if not sample.labels]
    limit = [_count(sample.value) for sample in found.named(MAX_FDS) if not sample.labels]
    if len(nodes) != 1 or len(used) != 1 or len(limit) != 1:
        return None
    node, [open_now], [most] = nodes[0], used, limit
    if not node or open_now is None or not most:
        return None
    return NodeFds(node, open_now, most)


def _queue_query(vhost: str, prefix: str | None) -> list[tuple[str, str]]:
    query = [("vhost", vhost), *(("family", family) for family in QUEUE_FAMILIES)]
    if prefix:
        # RabbitMQ 4.3 filters by name on the node (earlier releases ignore it; queues are
        # picked here too).
        query.append(("queue", "^" + re.escape(prefix)))
    return query


def _queue_of(sample: Sample, vhost: str) -> str | None:
    if sample.labels.get("vhost") != vhost:
        return None
    return sample.labels.get("queue")


def _count(value: float) -> int | None:
    """The value as a count, if it is one."""
    if math.isfinite(value) and value >= 0 and value == int(value):
        return int(value)
    return None


def _each(urls: str, read: Callable[[str], T]) -> list[T]:
    """``read`` of each URL that answers; raises ``PrometheusUnavailable`` if none does."""
    answers: list[T] = []
    problems: list[PrometheusUnavailable] = []
    for url in split_urls(urls):
        try:
            answers.append(read(url))
        except PrometheusUnavailable as exc:
            problems.append(exc)
    if not answers:
        raise PrometheusUnavailable(
            "; ".join(str(problem) for problem in problems) or "no rabbitmq_prometheus URL",
            status=problems[0].status if problems else None,
        )
    for problem in problems:
        log.info("%s; that node's figures are left out", problem)
    return answers
