"""Helpers shared by keyq's benchmarks: machine facts, payloads, broker bookkeeping, cleanup.

Every benchmark runs against the services named by ``KEYQ_AMQP_URL`` / ``KEYQ_REDIS_URL``,
creates only queues and Redis keys of its own streams, and removes them again.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Protocol

import orjson
import pika
import pika.exceptions
import redis

from keyq import Producer
from keyq.broker.connections import open_blocking_connection, open_redis
from keyq.broker.errors import KeyqError
from keyq.broker.naming import dead_letter_queue_name
from keyq.broker.packs import HEADER_PACK
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.settings import Settings

DELETE_CHUNK = 500
DELETE_CONNECTIONS = 4

_STARTED = time.monotonic()


def emit(result: dict[str, Any], out: Path | None) -> None:
    """The benchmark's one JSON object: to stdout, and to ``out`` when given."""
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2).decode()
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative(text: str) -> int:
    """An argparse type: a whole number of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def publish_all(
    producer: Producer, events: Iterable[tuple[str, dict[str, Any]]], flush_timeout: float
) -> float:
    """Publish every (key, event) and flush: the seconds from the first publish until every
    event is confirmed."""
    publish = producer.publish
    started = time.perf_counter()
    for key, event in events:
        publish(key, event)
    producer.flush(timeout=flush_timeout)
    return time.perf_counter() - started


def log(message: str) -> None:
    """Progress line on stderr (stdout carries only the final JSON)."""
    print(f"[{time.monotonic() - _STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


# ------------------------------------------------------------------------- machine facts
def rabbitmq_version() -> str | None:
    """The version the broker at ``KEYQ_AMQP_URL`` announces when a client connects, or None
    when it cannot be reached. (Asked over AMQP: ``rabbitmqctl`` is only ever pointed at
    nodes a benchmark started itself.)"""
    from keyq.broker.settings import load_settings

    try:
        connection = open_blocking_connection(load_settings(), "bench-version")
    except (KeyqError, pika.exceptions.AMQPError, OSError):
        return None
    try:
        version = connection._impl.server_properties.get("version")
    finally:
        with suppress(Exception):
            connection.close()
    if isinstance(version, bytes):
        version = version.decode()
    return str(version) if version else None


def machine_info(
    broker_version: Callable[[], str | None] = rabbitmq_version,
) -> dict[str, Any]:
    """What the figures were measured on. ``broker_version`` asks the broker's version (by
    default the machine's own node; a benchmark on a broker of its own passes its own)."""
    return {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "pika": pika.__version__,
        "redis_py": redis.__version__,
        "orjson": orjson.__version__,
        "rabbitmq": broker_version(),
        "loadavg_start": list(os.getloadavg()),
    }


def keyq_settings_from_env() -> dict[str, str]:
    """The ``KEYQ_`` settings in this process's environment, which its workers inherit: what
    a run was tuned with. Those that may carry credentials are named, not shown."""
    hidden = ("URL", "TOKEN", "AUTH", "PASSWORD", "SECRET")
    return {
        name: "(set)" if any(word in name for word in hidden) else value
        for name, value in sorted(os.environ.items())
        if name.startswith("KEYQ_")
    }


# ------------------------------------------------------------------------------ payloads
def padded_event(index: int, key: str, pad: str) -> dict[str, Any]:
    """A typical small event; ``pad`` brings it to the wanted size."""
    return {"id": index, "key": key, "kind": "bench", "ts": 1_700_000_000_000 + index, "pad": pad}


def pad_for(payload_bytes: int, sample_key: str) -> str:
    """Padding that makes ``padded_event`` serialise to about ``payload_bytes`` bytes."""
    bare = len(orjson.dumps(padded_event(0, sample_key, "")))
    return "x" * max(0, payload_bytes - bare)


def mean_size(events: Iterable[tuple[str, dict[str, Any]]]) -> float:
    sizes = [len(orjson.dumps(event)) for _, event in events]
    return sum(sizes) / len(sizes) if sizes else 0.0


# ----------------------------------------------------------------------- broker helpers
@contextmanager
def amqp(settings: Settings, name: str = "bench") -> Iterator[pika.BlockingConnection]:
    """A short-lived blocking connection (short-lived: an idle one misses heartbeats)."""
    connection = open_blocking_connection(settings, name)
    try:
        yield connection
    finally:
        with suppress(pika.exceptions.AMQPError, OSError):
            if connection.is_open:
                connection.close()


def message_counts(settings: Settings, queues: Sequence[str]) -> dict[str, int | None]:
    """Messages ready in each queue (passive declare), None for a queue that does not exist."""
    counts: dict[str, int | None] = {}
    with amqp(settings, "bench-count") as connection:
        channel = connection.channel()
        for queue in queues:
            try:
                frame = channel.queue_declare(queue, passive=True)
                counts[queue] = int(frame.method.message_count)
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 404:
                    raise
                counts[queue] = None
                channel = connection.channel()  # a failed passive declare closes the channel
    return counts


def event_counts(settings: Settings, queues: Sequence[str]) -> dict[str, int | None]:
    """Events waiting in each queue, a pack's each counted (its ``x-keyq-pack`` header): read
    without acking and handed back as the channel closes; None for a missing queue."""
    counts: dict[str, int | None] = {}
    with amqp(settings, "bench-count") as connection:
        for queue in queues:
            channel = connection.channel()
            try:
                events = 0
                while True:
                    method, properties, _body = channel.basic_get(queue, auto_ack=False)
                    if method is None:
                        break
                    declared = (properties.headers or {}).get(HEADER_PACK)
                    events += int(declared) if declared is not None else 1
                counts[queue] = events
                channel.close()
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 404:
                    raise
                counts[queue] = None
    return counts


def wait_for_total(
    settings: Settings,
    queues: Sequence[str],
    expected: int,
    timeout: float = 15.0,
    *,
    events: bool = False,
) -> tuple[int, list[str]]:
    """Sum of messages (with ``events``, of events, packs counted by what they hold) in
    ``queues``, polled until it reaches ``expected`` or ``timeout``.

    Unconfirmed publishes may still be on their way into the queues when the publisher
    returns, hence the polling. Returns the last total and the queues that do not exist.
    """
    deadline = time.monotonic() + timeout
    while True:
        counts = (event_counts if events else message_counts)(settings, queues)
        missing = [queue for queue, count in counts.items() if count is None]
        total = sum(count for count in counts.values() if count is not None)
        if (total >= expected and not missing) or time.monotonic() >= deadline:
            return total, missing
        time.sleep(0.5)


def declare_queues(
    settings: Settings, queues: Iterable[str], arguments: dict[str, Any] | None = None
) -> None:
    """Declare durable queues (as keyq declares its keyed queues)."""
    with amqp(settings, "bench-declare") as connection:
        channel = connection.channel()
        for queue in queues:
            channel.queue_declare(queue, durable=True, arguments=arguments)


def _delete_chunk(settings: Settings, queues: Sequence[str]) -> None:
    with amqp(settings, "bench-cleanup") as connection:
        channel = connection.channel()
        for queue in queues:
            try:
                channel.queue_delete(queue)
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 404:
                    raise
                channel = connection.channel()


def delete_queues(settings: Settings, queues: Iterable[str]) -> int:
    """Delete queues (missing ones are fine), over several connections when there are many."""
    names = sorted(set(queues))
    if not names:
        return 0
    size = max(1, min(DELETE_CHUNK, math.ceil(len(names) / DELETE_CONNECTIONS)))
    chunks = [names[start : start + size] for start in range(0, len(names), size)]
    if len(chunks) == 1:
        _delete_chunk(settings, chunks[0])
    else:
        with ThreadPoolExecutor(max_workers=DELETE_CONNECTIONS) as pool:
            for done in pool.map(lambda chunk: _delete_chunk(settings, chunk), chunks):
                assert done is None
    return len(names)


def stream_redis_keys(client: redis.Redis, stream: str) -> list[str]:
    """Every Redis key of ``stream`` (``keyq:{stream}:*``)."""
    found: list[str] = []
    for pattern in StreamKeys(stream).all_patterns():
        found.extend(str(key) for key in client.scan_iter(match=pattern, count=1000))
    return found


def registered_queues(client: redis.Redis, stream: str) -> list[str]:
    return [str(queue) for queue in client.zrange(StreamKeys(stream).registry, 0, -1)]


class Cleanup:
    """Remembers what a benchmark created and removes it: queues, then streams' Redis keys."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self.queues: set[str] = set()
        self.streams: set[str] = set()

    def add_queues(self, queues: Iterable[str]) -> None:
        self.queues.update(queues)

    def add_stream(self, stream: str) -> None:
        self.streams.add(stream)

    def run(self) -> None:
        """Remove everything remembered so far (queues registered in Redis included)."""
        client = open_redis(self._settings)
        try:
            for stream in self.streams:
                self.queues.update(registered_queues(client, stream))
                self.queues.add(dead_letter_queue_name(stream))  # declared by its workers
            if self.queues:
                started = time.monotonic()
                count = delete_queues(self._settings, self.queues)
                if count > 100:
                    log(f"deleted {count} queues in {time.monotonic() - started:.1f} s")
            self.queues.clear()
            for stream in sorted(self.streams):
                keys = stream_redis_keys(client, stream)
                if keys:
                    client.delete(*keys)
            self.streams.clear()
        finally:
            client.close()


class Stoppable(Protocol):
    def stop(self) -> None: ...


def measure_then_clean(measure: Callable[[], None], cleanup: Cleanup, errors: list[str]) -> None:
    """Run ``measure``, then remove what it created whatever happened; a service failure of
    either goes into ``errors`` (the measurement is aborted, the result still reported)."""
    try:
        measure()
    except (KeyqError, pika.exceptions.AMQPError, redis.RedisError, OSError) as exc:
        errors.append(f"aborted: {type(exc).__name__}: {exc}")
    finally:
        try:
            cleanup.run()
        except (KeyqError, pika.exceptions.AMQPError, redis.RedisError, OSError) as exc:
            errors.append(f"cleanup failed: {type(exc).__name__}: {exc}")


def finish_run(
    workers: Iterable[Stoppable], cleanup: Cleanup, client: redis.Redis, errors: list[str]
) -> None:
    """End a benchmark: stop its workers, remove what it created, close its Redis client. A
    failed cleanup goes into ``errors`` so that it neither hides nor replaces the result."""
    for worker in workers:
        worker.stop()
    try:
        cleanup.run()
    except (KeyqError, redis.RedisError, OSError) as exc:
        errors.append(f"cleanup failed: {exc}")
    client.close()
