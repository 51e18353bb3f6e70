"""What the watchdog reads of a stream for one look, in a few round trips: the keys with
events aside and their own queues, the parked keys, the held queues and their holders, the
counts of the queues watched, the live workers and their reports.

A key's *own* queue here is the one whose holder drains what of it waits aside: key mode's
queue of the key, a bucket-mode key's bucket, and in auto mode a promoted key's queue of its
own (``broker.routes``) or else its bucket, as ``broker.key_wake`` wakes them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import redis

from keyq.broker.key_control import FLOWING, KeyControl, ParkedKey
from keyq.broker.locks import FencedLocks, Lease
from keyq.broker.membership import Membership
from keyq.broker.naming import Mode, incarnation_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.registry import QueueRegistry
from keyq.broker.routes import Route, RouteBook
from keyq.broker.stream_policy import StreamPolicies
from keyq.broker.streams import StreamConfig
from keyq.broker.worker_report import WorkerReport
from keyq.janitor.config import JanitorSettings
from keyq.janitor.stream_gauges import Figures

WATCH_LIMIT = 300  # queues whose depth is read per stream and look
HOLDERS_LIMIT = 20_000  # most recently active queues whose holder is read per stream and look

FiguresOf = Callable[[str, list[str]], Figures]


@dataclass(frozen=True)
class WatchView:
    """One look's reading of a stream."""

    client: redis.Redis
    stream: str
    config: StreamConfig
    settings: JanitorSettings
    stream_paused: bool
    flowing: dict[str, list[str]]  # keys that may flow with queues aside -> those queues
    parked: dict[str, ParkedKey]
    queue_of: dict[str, str]  # such a key -> its own queue, current incarnation
    routes: dict[str, Route]  # auto mode: those keys and the parked ones that are promoted
    registered: set[str]  # of those own queues
    holders: dict[str, Lease | None]
    held: list[str]  # other held queues, least recently active first
    keys_of: dict[str, str | None]  # held queue -> its key (a key's queue of its own)
    figures: Figures
    live: list[str]
    reports: dict[str, WorkerReport]
    walking_letters: bool  # a command holds the dead-letter queue's lock

    @classmethod
    def read(
        cls,
        client: redis.Redis,
        stream: str,
        config: StreamConfig,
        settings: JanitorSettings,
        figures_of: FiguresOf,
    ) -> WatchView:
        keys = StreamKeys(stream)
        control = KeyControl(client, stream)
        aside = control.keys_aside()
        parked = control.parked()
        statuses = control.statuses(aside)
        flowing = {k: q for k, q in aside.items() if q and not statuses.get(k, FLOWING).stopped}
        auto = config.mode is Mode.AUTO
        routes = RouteBook(client, stream).routes([*aside, *parked]) if auto else {}
        bases = {key: own_queue(config, routes.get(key), key) for key in flowing}
        queue_of = _current_queues(client, stream, bases)
        own = sorted(set(queue_of.values()))
        scores = client.zmscore(keys.registry, own) if own else []
        registered = {queue for queue, at in zip(own, scores, strict=True) if at is not None}
        # Held queues are among the most recently active (workers touch what they commit);
        # of those, a stuck one is the least recently active.
        recent = cast(
            list[tuple[str, float]],
            client.zrevrange(keys.registry, 0, HOLDERS_LIMIT - 1, withscores=True),
        )
        by_age = [str(queue) for queue, _at in sorted(recent, key=lambda pair: pair[1])]
        holders = _holders(client, stream, [*own, *by_age])
        aside_queues = {*own, *(queues[0] for queues in flowing.values())}
        held = [q for q in by_age if holders.get(q) is not None and q not in aside_queues]
        watched = [*sorted(aside_queues), *held][:WATCH_LIMIT]
        measured_held = held[: max(0, WATCH_LIMIT - len(aside_queues))]
        live = Membership(client, stream, settings.member_ttl_ms).alive()
        return cls(
            client=client,
            stream=stream,
            config=config,
            settings=settings,
            stream_paused=StreamPolicies(client, stream).load().paused,
            flowing=flowing,
            parked=parked,
            queue_of=queue_of,
            routes=routes,
            registered=registered,
            holders=holders,
            held=measured_held,
            keys_of=QueueRegistry(client, stream).original_keys(measured_held),
            figures=figures_of(stream, [*watched, config.dead_letter_queue]),
            live=live,
            reports=_reports(client, stream, live),
            walking_letters=bool(client.exists(keys.redrive_lock)),
        )

    def own_queue(self, key: str) -> str:
        """``key``'s own queue (base name): see the module's docstring."""
        return own_queue(self.config, self.routes.get(key), key)

    def applied_by(self, lease: Lease) -> int | None:
        """How many events the holder of ``lease`` has applied, by its report (None: none)."""
        report = self.reports.get(lease.owner)
        return None if report is None else report.events


def own_queue(config: StreamConfig, route: Route | None, key: str) -> str:
    """The base name of the queue whose holder drains what of ``key`` waits aside: its own
    queue while it is promoted (``route``, auto mode), else the queue it is published to."""
    return route.queue if route is not None else config.queue_for(key)


def _current_queues(client: redis.Redis, stream: str, bases: dict[str, str]) -> dict[str, str]:
    """Each key's own queue (``bases``) under its current incarnation."""
    names = sorted(set(bases.values()))
    raw = client.hmget(StreamKeys(stream).incarnations, names) if names else []
    current = {
        base: incarnation_name(base, int(value or 0))
        for base, value in zip(names, raw, strict=True)
    }
    return {key: current[base] for key, base in bases.items()}


def _holders(client: redis.Redis, stream: str, queues: list[str]) -> dict[str, Lease | None]:
    """The holders of ``queues`` (at most ``HOLDERS_LIMIT``), a chunk a round trip."""
    names = list(dict.fromkeys(queues))[:HOLDERS_LIMIT]
    locks = FencedLocks(client, stream)
    found: dict[str, Lease | None] = {}
    for start in range(0, len(names), 1000):
        found.update(locks.holders(names[start : start + 1000]))
    return found


def _reports(client: redis.Redis, stream: str, live: list[str]) -> dict[str, WorkerReport]:
    raws = client.hmget(StreamKeys(stream).member_info, live) if live else []
    return {
        worker: report
        for worker, raw in zip(live, raws, strict=True)
        if (report := WorkerReport.parse(raw, worker=worker, stream=stream)) is not None
    }
