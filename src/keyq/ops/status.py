"""``keyq status``: a stream's queues (depth, owner, idle time), its live workers, its dead letters,
and how close the broker is to its file-descriptor limit.

Everything is read, nothing is changed: Redis in four round trips (one pipeline for the config,
the registry, the members and the counts of paused and parked keys, one read of the stream's
policy, one MGET for every lock, one HMGET for the original keys; for an auto-mode stream
three reads of its routes), RabbitMQ in one scrape of
each node's rabbitmq_prometheus when ``KEYQ_PROMETHEUS_URL`` is set, else in two listings of
the management API when ``KEYQ_MANAGEMENT_URL`` is (its fd use from the same place), else by
passive declares on one channel (AMQP cannot list queues).

This module reads and shapes the rows; ``keyq.cli.status`` draws them and is the command. A
worker's row reads its heartbeat through ``WorkerReport``; a worker whose heartbeat holds no
report (none written yet, or not one) shows None for every count rather than a made-up 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import Counter
from types import TracebackType
from typing import Any, cast

import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

from keyq.broker.clock import now_ms
from keyq.broker.connections import amqp_failure, open_blocking_connection, open_redis, redis_errors
from keyq.broker.errors import KeyqError, ManagementUnavailable, PrometheusUnavailable
from keyq.broker.fd_usage import FdUsage, read_fd_usage
from keyq.broker.locks import FencedLocks
from keyq.broker.management import queue_figures
from keyq.broker.naming import (
    Mode,
    check_stream_name,
    dead_letter_queue_name,
    is_bucket_queue,
    stream_prefix,
)
from keyq.broker.prometheus_api import queue_figures as prometheus_figures
from keyq.broker.queue_probe import QueueProbe
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import Settings
from keyq.broker.stranded import Stranded, stranded_row
from keyq.broker.stream_policy import StreamPolicies
from keyq.broker.streams import StreamConfig
from keyq.broker.urls import vhost_of
from keyq.broker.worker_report import WorkerReport
from keyq.ops.routes import route_summary

log = logging.getLogger("keyq.status")

FD_REFRESH_S = 10.0  # --watch reads the broker's fd use at most this often
LISTING_TIMEOUT_S = 30.0  # one listing of every queue of the vhost (management, prometheus)
HTTP_BAD_REQUEST = 400
# What RabbitMQ 4.x answers /api/consumers with when its management metrics collection is off.
METRICS_OFF_HINT = (
    "; the broker's management metrics collection is off, as RabbitMQ 4.x allows: "
    "KEYQ_PROMETHEUS_URL reads the figures from rabbitmq_prometheus instead"
)

Figures = dict[str, tuple[int, int] | None]  # queue -> (ready messages, consumers), None: missing


class StreamNotFound(KeyqError):
    """The stream has no recorded config: nothing has produced to it yet."""


class StatusReader:
    """Reads one stream's status; keeps its connections between reads (for ``--watch``).

    RabbitMQ is only connected once Redis has shown that the stream exists.
    """

    def __init__(self, settings: Settings, stream: str) -> None:
        self.settings = settings
        self.stream = check_stream_name(stream)
        self._keys = StreamKeys(self.stream)
        self._dead_letter_queue = dead_letter_queue_name(self.stream)
        self._redis = open_redis(settings)
        self._registry = QueueRegistry(self._redis, self.stream)
        self._locks = FencedLocks(self._redis, self.stream)
        self._connection: BlockingConnection | None = None
        self._probe = QueueProbe(self._open_channel)
        self._fd_usage: FdUsage | None = None
        self._fd_read_at = 0.0

    def __enter__(self) -> StatusReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def collect(self) -> dict[str, Any]:
        """One snapshot of the stream (see ``collect_status`` for its fields)."""
        now = now_ms()
        config, (registered, members, infos, paused, parked, stranded) = self._read_redis(now)
        with redis_errors(self.settings.redis_url):
            policy = StreamPolicies(self._redis, self.stream).load()
            routes = route_summary(self._redis, self.stream) if config.mode is Mode.AUTO else None
        activity = {
            str(queue): int(score)
            for queue, score in cast(list[tuple[str, float]], registered)
            if queue != self._dead_letter_queue
        }
        live = {str(worker): int(expiry) for worker, expiry in members}
        *queues, dead_letter = self._queue_rows(config, activity, live, now)
        held_by = Counter(row["owner"] for row in queues if row["owner"] is not None)
        workers = [
            worker_row(
                worker,
                expiry,
                now=now,
                ttl_ms=self.settings.member_ttl_ms,
                report=WorkerReport.parse(infos.get(worker), worker=worker, stream=self.stream),
                held=held_by[worker],
            )
            for worker, expiry in sorted(live.items())
        ]
        held = sum(held_by.values())
        return {
            "stream": self.stream,
            "broker": self._broker_fds().as_dict(),
            "mode": config.mode.value,
            "buckets": config.buckets,
            "at_ms": now,
            "dead_letter_queue": self._dead_letter_queue,
            "policy": {
                "poison_policy": policy.poison_policy,
                "rate_limit": policy.rate_limit,
                "paused": policy.paused,
                "paused_keys": int(paused),
                "parked_keys": int(parked),
            },
            "routes": routes,
            "queues": [*queues, dead_letter],
            "stranded": [
                stranded_row(Stranded.from_json(raw)) for _, raw in sorted(stranded.items())
            ],
            "workers": workers,
            "totals": {
                "queues": len(queues),
                "lag": sum(row["depth"] for row in queues if row["depth"] is not None),
                "dead_letter_depth": dead_letter["depth"],
                "held": held,
                "unheld": len(queues) - held,
                "missing": sum(1 for row in queues if row["missing"]),
                "workers": len(workers),
                "events_per_s": None,
            },
        }

    def _read_redis(self, now: int) -> tuple[StreamConfig, list[Any]]:
        """The config, registry, live members, their reports, the counts of paused and
        parked keys and the stranded keys, in one round trip."""
        keys = self._keys
        with redis_errors(self.settings.redis_url):
            pipe = self._redis.pipeline(transaction=False)
            pipe.get(keys.config)
            pipe.zrange(keys.registry, 0, -1, withscores=True)
            pipe.zrangebyscore(keys.members, now, "+inf", withscores=True)
            pipe.hgetall(keys.member_info)
            pipe.hlen(keys.paused_keys)
            pipe.hlen(keys.parked_keys)
            pipe.hgetall(keys.stranded)
            raw_config, *rest = pipe.execute()
        if raw_config is None:
            raise StreamNotFound(
                f"stream {self.stream!r} has no producer yet (no config recorded in Redis)"
            )
        return StreamConfig.from_json(self.stream, str(raw_config)), rest

    def _queue_rows(
        self, config: StreamConfig, activity: dict[str, int], live: dict[str, int], now: int
    ) -> list[dict[str, Any]]:
        """The registered queues' rows, deepest first, each with its lock holder, then the
        dead-letter queue's."""
        names = list(activity)
        with redis_errors(self.settings.redis_url):
            holders = self._locks.holders(names)
            # A bucket queue holds many keys (the registry keeps the first one seen); in auto
            # mode a promoted key's own queue is its alone.
            keyed = config.holds_own_queues()
            originals = self._registry.original_keys(names) if keyed else dict.fromkeys(names)
            for name in names if config.mode is Mode.AUTO else ():
                if is_bucket_queue(self.stream, name):
                    originals[name] = None
        declared = self._figures([*names, self._dead_letter_queue])
        rows = []
        for name in names:
            lease = holders[name]
            rows.append(
                queue_row(name, originals[name], declared[name], dead_letter=False)
                | {
                    "owner": None if lease is None else lease.owner,
                    "token": None if lease is None else lease.token,
                    "owner_alive": None if lease is None else lease.owner in live,
                    "idle_ms": max(0, now - activity[name]),
                }
            )
        dead_letter = queue_row(
            self._dead_letter_queue, None, declared[self._dead_letter_queue], dead_letter=True
        )
        unheld = {"owner": None, "token": None, "owner_alive": None, "idle_ms": None}
        return [*sorted(rows, key=deepest_first), dead_letter | unheld]

    def _broker_fds(self) -> FdUsage:
        """The broker's fd use, read again only every ``FD_REFRESH_S`` under ``--watch``."""
        if self._fd_usage is None or time.monotonic() - self._fd_read_at >= FD_REFRESH_S:
            self._fd_usage = read_fd_usage(self.settings)
            self._fd_read_at = time.monotonic()
        return self._fd_usage

    def wait(self, seconds: float) -> None:
        """Sleep between refreshes, answering RabbitMQ's heartbeats meanwhile."""
        if self._connection is None or not self._connection.is_open:
            time.sleep(seconds)
            return
        try:
            self._connection.sleep(seconds)
        except (pika.exceptions.AMQPError, OSError):
            self._close_amqp()  # reconnected at the next refresh

    def close(self) -> None:
        self._close_amqp()
        with contextlib.suppress(Exception):
            self._redis.close()

    def _figures(self, queues: list[str]) -> Figures:
        """(ready messages, consumers) of each queue, None for one that does not exist: from
        rabbitmq_prometheus when ``KEYQ_PROMETHEUS_URL`` is set, else from the management
        API's listings when ``KEYQ_MANAGEMENT_URL`` is (either may report a depth a few
        seconds late), else, or if neither answers, by declaring. A queue they do not report
        (declared a moment ago, or on a node not listed) is declared."""
        settings = self.settings
        vhost = vhost_of(settings.amqp_url)
        if settings.prometheus_url:
            try:
                reported = prometheus_figures(
                    settings.prometheus_url,
                    vhost,
                    LISTING_TIMEOUT_S,
                    prefix=stream_prefix(self.stream),
                )
            except PrometheusUnavailable as exc:
                fallback = "from the management API" if settings.management_url else "by declaring"
                log.warning("queue figures %s instead: %s", fallback, exc)
            else:
                found: Figures = {queue: reported[queue] for queue in queues if queue in reported}
                unreported = [queue for queue in queues if queue not in reported]
                if unreported:
                    found.update(self._declare(unreported))
                return found
        if not settings.management_url:
            return self._declare(queues)
        try:
            listed = queue_figures(settings.management_url, vhost, LISTING_TIMEOUT_S)
        except ManagementUnavailable as exc:
            hint = METRICS_OFF_HINT if exc.status == HTTP_BAD_REQUEST else ""
            log.warning("queue figures by declaring instead: %s%s", exc, hint)
            return self._declare(queues)
        found = {queue: listed.get(queue) for queue in queues}
        # Listed without a depth: ask the queue itself.
        unknown = [queue for queue in queues if queue in listed and listed[queue] is None]
        if unknown:
            found.update(self._declare(unknown))
        return found

    def _declare(self, queues: list[str]) -> Figures:
        """(ready messages, consumers) of each queue by passive declare, None if missing."""
        try:
            counts = self._probe.counts_of(queues)
        except (pika.exceptions.AMQPError, OSError) as exc:
            self._close_amqp()
            raise amqp_failure(exc, self.settings.amqp_url) from None
        return {
            queue: None if found is None else (found.ready, found.consumers)
            for queue, found in counts.items()
        }

    def _open_channel(self) -> BlockingChannel:
        if self._connection is None or not self._connection.is_open:
            self._connection = open_blocking_connection(self.settings, f"status-{self.stream}")
        return self._connection.channel()

    def _close_amqp(self) -> None:
        self._probe.close()
        connection, self._connection = self._connection, None
        if connection is not None and connection.is_open:
            with contextlib.suppress(Exception):
                connection.close()


def queue_row(
    name: str, key: str | None, declared: tuple[int, int] | None, *, dead_letter: bool
) -> dict[str, Any]:
    """A queue's name, original key, (ready messages, consumers), or ``missing``."""
    return {
        "name": name,
        "key": key,
        "dead_letter": dead_letter,
        "depth": None if declared is None else declared[0],
        "consumers": None if declared is None else declared[1],
        "missing": declared is None,
    }


def deepest_first(row: dict[str, Any]) -> tuple[int, str]:
    """Sort key: the deepest queue first, a missing one after every existing one, then name."""
    depth = row["depth"]
    return (-depth if depth is not None else 1, row["name"])


def worker_row(
    worker: str,
    expiry: int,
    *,
    now: int,
    ttl_ms: int,
    report: WorkerReport | None,
    held: int,
) -> dict[str, Any]:
    """A live worker: its heartbeat's age (from its expiry), the locks it holds (``held``,
    counted from the locks, not from what it says) and what its report says."""
    return {
        "worker": worker,
        "heartbeat_age_ms": max(0, now - (expiry - ttl_ms)),
        "held": held,
        "events": None if report is None else report.events,
        "batches": None if report is None else report.batches,
        "dead_lettered": None if report is None else report.dead_lettered,
        "waiting": None if report is None else report.waiting,
        "gaps_open": None if report is None else report.gaps_open,
        "gaps_skipped": None if report is None else report.gaps_skipped,
        "late": None if report is None else report.late,
        "gaps": [] if report is None else [dataclasses.asdict(gap) for gap in report.gaps],
        "events_per_s": None,
        "host": None if report is None else report.host,
        "pid": None if report is None else report.pid,
        "ready": report is not None and report.ready,
        "started_ms": None if report is None else report.started_ms,
    }


def add_rates(current: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]:
    """Fill each worker's ``events_per_s`` from the growth of its ``events`` counter since
    ``previous`` (workers publish the counter with each heartbeat, so rates are approximate;
    a worker that is new or restarted keeps None)."""
    seconds = (current["at_ms"] - previous["at_ms"]) / 1000
    before = {row["worker"]: row["events"] for row in previous["workers"]}
    rates: list[float] = []
    for row in current["workers"]:
        then, now = before.get(row["worker"]), row["events"]
        if seconds > 0 and isinstance(then, int) and isinstance(now, int) and now >= then:
            row["events_per_s"] = round((now - then) / seconds, 1)
            rates.append(row["events_per_s"])
    current["totals"]["events_per_s"] = round(sum(rates), 1) if rates else None
    return current


def collect_status(settings: Settings, stream: str) -> dict[str, Any]:
    """A snapshot of ``stream``, as plain JSON-ready data.

    ``policy``: the stream's ``poison_policy``, ``rate_limit`` (events/s per key, None for
    none), ``paused`` (the whole stream), and how many keys are paused (``paused_keys``) or
    parked (``parked_keys``). ``routes`` (auto mode, else None): ``promoted_keys`` (keys with
    a queue of their own now), ``open_moves`` (promoted keys their bucket's holder has not
    handed over yet), ``promotions`` (since the stream began, by why) and ``demotions``.
    ``queues``: every registered queue, deepest first, then the dead-letter queue, each with
    ``name``, ``key`` (original key; None for a bucket), ``depth`` (ready messages; None and
    ``missing`` when the queue does not exist), ``consumers``, ``owner``/``token`` (lock
    holder), ``owner_alive`` and ``idle_ms`` (since last registry activity). ``workers``: the
    live members with ``heartbeat_age_ms`` (expiry minus ``settings.member_ttl_ms``), ``held``
    (locks held now) and their reported counters; ``events_per_s`` is None in a snapshot (see
    ``add_rates``). ``totals``: queue count, lag (sum of keyed depths), dead-letter depth,
    held/unheld/missing queues, workers.
    ``broker``: ``fd_used``/``fd_limit``/``fd_ratio`` of the broker node closest to its fd
    limit and ``near_limit`` (at ``settings.fd_warn_ratio``), or None figures and
    ``unknown_reason`` without rabbitmq_prometheus or the management API, and the ``source``
    they came from. Raises ``StreamNotFound`` for an unused stream.
    """
    with StatusReader(settings, stream) as reader:
        return reader.collect()
