"""The parts of a worker that only an auto-mode stream has (``keyq.broker.routes``): the
routing stage of its attempts, the closing of moves, and the cap on a promoted key's share of
a batch."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import redis

from keyq.broker.key_control import KeyControl
from keyq.broker.naming import Mode, is_bucket_queue, is_stream_queue
from keyq.broker.registry import QueueRegistry
from keyq.broker.streams import StreamConfig
from keyq.worker.batch.ports import DeadLetterSink
from keyq.worker.batch.route_watch import RouteWatch
from keyq.worker.batch.routing import AutoRouting
from keyq.worker.config import WorkerSettings
from keyq.worker.holding.route_moves import RouteMoves

# What a promoted key's events may cost a batch they share with other queues, over how many
# batches a job's fixed cost is judged, over how many an event's cost is (a median, so a
# batch slowed by anything else, a collection or a neighbour's burst, does not set it), the
# fewest events whose batch tells their cost, and the least an event costs.
SHARED_BATCH_S = 0.25
FIXED_COST_BATCHES = 200
COST_BATCHES = 15
COST_EVENTS_MIN = 100
MIN_EVENT_COST_S = 0.000005


@dataclass(frozen=True)
class AutoParts:
    """What an auto-mode worker adds to its session (both None in other modes)."""

    routing: AutoRouting | None = None
    moves: RouteMoves | None = None
    cost: OwnEventCost | None = None


def auto_parts(
    settings: WorkerSettings,
    config: StreamConfig,
    client: redis.Redis,
    sink: DeadLetterSink,
    cost: OwnEventCost,
) -> AutoParts:
    """What an auto-mode worker adds; ``cost`` is what its buffer's shared cap reads."""
    if config.mode is not Mode.AUTO:
        return AutoParts()
    cost.config = config
    watch = RouteWatch(
        rate=settings.auto_promote_rate,
        backlog=settings.auto_promote_backlog,
        event_cost=lambda: cost.bucket_s,
    )
    routing = AutoRouting(
        client=client,
        config=config,
        registry=QueueRegistry(client, config.stream),
        control=KeyControl(client, config.stream),
        watch=watch,
        sink=sink,
        lease_ms=settings.publish_lease_ms,
    )
    return AutoParts(routing, RouteMoves(client, config.stream), cost)


def is_own_queue(config: StreamConfig | None, queue: str) -> bool:
    """Whether ``queue`` is a promoted key's own queue in an auto stream."""
    if config is None or config.mode is not Mode.AUTO:
        return False
    stream = config.stream
    return is_stream_queue(stream, queue) and not is_bucket_queue(stream, queue)


class OwnEventCost:
    """What an event of a promoted key's own queue costs a batch's Spark job, learnt from the
    batches: beyond a job's fixed cost (the least a recent job took), less what the batch's
    other events cost (learnt from batches without own-queue events; until then, as much as
    an own-queue event), per own-queue event. Only the events a job applied count: forwarded
    copies and events waiting for their key's move cost it nothing."""

    def __init__(self, config: StreamConfig | None = None) -> None:
        self.config = config  # the stream's, once read
        self._jobs: deque[float] = deque(maxlen=FIXED_COST_BATCHES)  # Spark seconds
        self._other: deque[float] = deque(maxlen=COST_BATCHES)  # seconds an event, per batch
        self._own: deque[float] = deque(maxlen=COST_BATCHES)

    @property
    def own_s(self) -> float | None:
        return statistics.median(self._own) if self._own else None

    @property
    def bucket_s(self) -> float | None:
        """What an event of the buckets has cost lately (a median), if known."""
        return statistics.median(self._other) if self._other else None

    def note(self, applied: Mapping[str, int], spark_s: float) -> None:
        """A Spark job of ``spark_s`` applied ``applied`` events from each queue. A commit
        that applied nothing (its events all forwarded, duplicates or dead letters) ran no
        job, and says nothing of a job's fixed cost."""
        if not applied or spark_s <= 0:
            return
        own = sum(n for queue, n in applied.items() if is_own_queue(self.config, queue))
        other = sum(applied.values()) - own
        self._jobs.append(spark_s)
        beyond = spark_s - min(self._jobs)
        if own == 0 and other >= COST_EVENTS_MIN:
            self._other.append(beyond / other)
        elif own < COST_EVENTS_MIN:
            return
        elif self._other:
            rest = max(beyond - statistics.median(self._other) * other, 0.0)
            self._own.append(rest / own)
        else:
            self._own.append(beyond / (own + other))


def shared_cap(settings: WorkerSettings, queue: str, cost: OwnEventCost, others: int) -> int | None:
    """Auto mode: a promoted key's own queue gives a batch it shares with other queues (which
    have ``others`` events ready) at most as many events as fill ``SHARED_BATCH_S`` of Spark
    at what they have cost, and at least ``auto_key_batch_max``: a hot, slow key cannot hold
    the keys of the buckets the same worker holds (its events apply one after another
    anyway), and a hot, cheap one is not held to a trickle. Until that cost is known, it gives
    ``auto_key_batch_max`` or as many as the others, if more. Not after: a bucket's events
    counted there may be the key's own, still to be forwarded, costing the job nothing."""
    if not is_own_queue(cost.config, queue):
        return None
    floor, own_s = settings.auto_key_batch_max, cost.own_s  # own_s: a median, read once
    if own_s is None:
        return max(floor, others)
    return max(floor, int(SHARED_BATCH_S / max(own_s, MIN_EVENT_COST_S)))
