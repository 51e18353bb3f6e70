"""A worker's start-up steps before it serves: reach its services, read the stream's config,
count the Redis replicas commits wait for, and finish output committed before a crash.

Each step outlives a service that is away (a daemon started beside its broker, or while it
restarts, waits for it); bad credentials or a wrong vhost fail at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import redis
import redis.exceptions

from keyq.broker.backoff import Backoff
from keyq.broker.connections import open_blocking_connection, open_redis, redis_errors
from keyq.broker.errors import (
    KeyqError,
    RedisUnavailable,
    ServiceUnavailable,
    StreamConfigMismatch,
)
from keyq.broker.naming import Mode
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.redis_topology import connected_replicas
from keyq.broker.streams import StreamConfig, ensure_stream_config, load_stream_config
from keyq.worker.batch.state_store import StateStore
from keyq.worker.config import WorkerSettings
from keyq.worker.holding.peer_reaper import client_name
from keyq.worker.spark.sinks import ParquetSink

_T = TypeVar("_T")

log = logging.getLogger("keyq.worker")


def wait_for_services(
    settings: WorkerSettings, worker_id: str, stop: threading.Event
) -> redis.Redis | None:
    """Reach Redis and RabbitMQ before Spark starts; None if stopped while waiting."""
    backoff = Backoff(0.5, 5.0)
    while True:
        try:
            client = open_redis(settings, client_name=client_name(worker_id))
            try:
                open_blocking_connection(settings, f"worker-check-{worker_id}").close()
            except BaseException:
                client.close()
                raise
            return client
        except ServiceUnavailable as exc:
            delay = backoff.next()
            log.warning("waiting for the services, retrying in %.1fs: %s", delay, exc)
            if stop.wait(delay):
                return None


def while_redis_is_away(
    settings: WorkerSettings, stop: threading.Event, what: str, step: Callable[[], _T]
) -> _T | None:
    """Run a start-up step, waiting with backoff while Redis is away (cut or restarting
    after the services check passed). None if stopped while waiting."""
    backoff = Backoff(0.5, 5.0)
    while not stop.is_set():
        try:
            with redis_errors(settings.redis_url):
                return step()
        except RedisUnavailable as exc:
            delay = backoff.next()
            log.warning("%s: retrying in %.1fs: %s", what, delay, exc)
            stop.wait(delay)
    return None


def replicas_required(settings: WorkerSettings, client: redis.Redis, stream: str) -> int:
    """How many Redis replicas must confirm each commit before its events are acked:
    ``KEYQ_REDIS_MIN_REPLICAS``, or 1 when the stream's primary has a replica now."""
    wanted = settings.redis_min_replicas
    if wanted is None:
        try:
            found = connected_replicas(client, StreamKeys(stream).commits)
        except redis.exceptions.ResponseError as exc:  # INFO not permitted
            log.warning("cannot count Redis replicas (%s): commits do not wait for any", exc)
            found = 0
        wanted = 1 if found else 0
    if wanted:
        log.info("each commit waits for %d Redis replica(s) before its events are acked", wanted)
    else:
        log.info("commits do not wait for Redis replicas (none required or none found)")
    return wanted


def stream_config(
    settings: WorkerSettings,
    client: redis.Redis,
    stream: str,
    *,
    mode: str | Mode | None,
    buckets: int | None,
    stop: threading.Event,
) -> StreamConfig:
    """The stream's config; without a mode given, wait for the first producer to set it.
    A queue type asked for (``KEYQ_QUEUE_TYPE``) must be the stream's."""
    asked_type = settings.queue_type
    with redis_errors(settings.redis_url):
        if mode is not None or buckets is not None:
            return ensure_stream_config(client, stream, mode, buckets, asked_type)
        waited = False
        while not stop.is_set():
            config = load_stream_config(client, stream)
            if config is not None:
                if asked_type is not None and asked_type != config.queue_type:
                    raise StreamConfigMismatch(
                        f"stream {stream!r} is fixed at {config.describe()}; this "
                        f"worker asked for queue type {asked_type}"
                    )
                return config
            if not waited:
                log.info("stream %s has no producer yet; waiting for one", stream)
                waited = True
            stop.wait(1.0)
    raise KeyqError("stopped before the stream was configured")


def recover_sink(sink: ParquetSink | None, store: StateStore) -> None:
    """Finish making visible any batch output that was committed but not renamed."""
    if sink is None:
        return
    pending = store.pending_sink_records()
    for token, staged in pending.items():
        sink.publish(token, staged)
        store.forget_sink_record(token)
    sink.sweep_orphans(set(pending.values()))
