"""The parts of a worker that only an auto-mode stream has (``keyq.broker.routes``): the
routing stage of its attempts, the closing of moves, and the cap on a promoted key's share of
a batch."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import redis

from keyq.broker.key_control import KeyControl
from keyq.broker.naming import Mode, is_bucket_queue, is_stream_queue
from keyq.broker.registry import QueueRegistry
from keyq.broker.streams import StreamConfig
from keyq.worker.batch.ports import DeadLetterSink
from keyq.worker.batch.route_watch import RouteWatch
from keyq.worker.batch.routing import AutoRouting
from keyq.worker.batch.stats import BatchStats
from keyq.worker.config import WorkerSettings
from keyq.worker.holding.route_moves import RouteMoves

# What a promoted key's events may cost a batch it shares with other queues (``SharedCap``),
# over how many batches a job's fixed cost is judged, and the least an event is taken to cost.
SHARED_BATCH_BUDGET_S = 0.25
FIXED_COST_BATCHES = 200
MIN_EVENT_COST_S = 0.00001


@dataclass(frozen=True)
class AutoParts:
    """What an auto-mode worker adds to its session (both None in other modes)."""

    routing: AutoRouting | None = None
    moves: RouteMoves | None = None


def auto_parts(
    settings: WorkerSettings, config: StreamConfig, client: redis.Redis, sink: DeadLetterSink
) -> AutoParts:
    if config.mode is not Mode.AUTO:
        return AutoParts()
    watch = RouteWatch(rate=settings.auto_promote_rate, backlog=settings.auto_promote_backlog)
    routing = AutoRouting(
        client=client,
        config=config,
        registry=QueueRegistry(client, config.stream),
        control=KeyControl(client, config.stream),
        watch=watch,
        sink=sink,
        lease_ms=settings.publish_lease_ms,
    )
    return AutoParts(routing, RouteMoves(client, config.stream))


def is_own_queue(config: StreamConfig | None, queue: str) -> bool:
    """Whether ``queue`` is a promoted key's own queue in an auto stream."""
    if config is None or config.mode is not Mode.AUTO:
        return False
    stream = config.stream
    return is_stream_queue(stream, queue) and not is_bucket_queue(stream, queue)


class SharedCap:
    """Auto mode: how many events a promoted key's own queue may give a batch it shares with
    other queues. A hot, slow key cannot then hold the keys of the buckets the same worker
    holds (its own events apply one after another anyway), and a hot, fast one is not held to
    a trickle while they have events waiting: the cap is what fills ``SHARED_BATCH_BUDGET_S``
    of Spark at what an event has cost lately beyond a job's fixed cost (the least a recent job
    took), and at least ``auto_key_batch_max``, which is also the cap before the first batch."""

    def __init__(self, floor: int) -> None:
        self._floor = floor
        self.stats: BatchStats | None = None  # the batch processor's, once serving
        self._seen = 0  # batches learned from
        self._jobs: deque[float] = deque(maxlen=FIXED_COST_BATCHES)  # Spark seconds
        self._per_event_s: float | None = None

    def __call__(self, config: StreamConfig | None, queue: str) -> int | None:
        if not is_own_queue(config, queue):
            return None
        self._learn()
        if self._per_event_s is None:
            return self._floor
        return max(self._floor, int(SHARED_BATCH_BUDGET_S / self._per_event_s))

    def _learn(self) -> None:
        stats = self.stats
        if stats is None or stats.batches == self._seen or stats.last_batch_events <= 0:
            return
        self._seen = stats.batches
        self._jobs.append(stats.last_spark_seconds)
        beyond = stats.last_spark_seconds - min(self._jobs)
        self._per_event_s = max(beyond / stats.last_batch_events, MIN_EVENT_COST_S)
