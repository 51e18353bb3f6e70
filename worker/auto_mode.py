"""The parts of a worker that only an auto-mode stream has (``keyq.broker.routes``): the
routing stage of its attempts, the closing of moves, and the cap on a promoted key's share of
a batch."""

from __future__ import annotations

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


def shared_cap(settings: WorkerSettings, config: StreamConfig | None, queue: str) -> int | None:
    """Auto mode: a promoted key's own queue gives a batch it shares with other queues at most
    ``auto_key_batch_max`` events, so a hot or slow key cannot hold the keys of the buckets the
    same worker holds (its events apply one after another anyway)."""
    return settings.auto_key_batch_max if is_own_queue(config, queue) else None
