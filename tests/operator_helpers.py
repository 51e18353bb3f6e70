"""Helpers for the operator commands' tests: a recorded stream config, dead letters published as a
worker does, reading a queue back, running ``keyq`` in-process."""

from __future__ import annotations

import itertools
import subprocess
import sys
from typing import Any

import orjson
import pika
from click.testing import CliRunner, Result

from keyq.broker.connections import open_redis
from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.broker.dead_letter_queue import letters_of
from keyq.broker.envelope import CONTENT_JSON, HEADER_KEY, HEADER_PRODUCER, HEADER_SEQ
from keyq.broker.naming import dead_letter_queue_name
from keyq.broker.settings import load_settings
from keyq.broker.streams import StreamConfig, ensure_stream_config
from keyq.broker.topology import dead_letter_queue_arguments
from keyq.cli.root import cli
from keyq.worker.amqp.dead_letters import DeadLetter, dead_letter_properties
from keyq.worker.amqp.deliveries import Delivery
from tests.conftest import StreamFixture
from tests.support import KEYQ_WITH_SEAMS
from tests.workers import REPO, keyq_environment, wait_until

_tags = itertools.count(1)


def keyq_delivery(queue: str, key: str, producer: str, seq: int, body: bytes) -> Delivery:
    headers = {HEADER_KEY: key, HEADER_PRODUCER: producer, HEADER_SEQ: seq}
    return Delivery(queue, 1, next(_tags), False, headers, CONTENT_JSON, f"{producer}-{seq}", body)


def foreign_delivery(queue: str, body: bytes, headers: dict[str, Any]) -> Delivery:
    return Delivery(queue, 1, next(_tags), False, dict(headers), "text/plain", None, body)


def record_stream(
    stream: StreamFixture, *, mode: str = "key", queue_type: str = "classic"
) -> StreamConfig:
    buckets = 4 if mode == "bucket" else None
    return ensure_stream_config(stream.redis, stream.name, mode, buckets, queue_type)


def dead_letter(
    connection: pika.BlockingConnection,
    stream: str,
    deliveries: list[Delivery],
    *,
    queue_type: str = "classic",
    reason: str = "poison: bad payload",
    indexed: bool = True,
) -> None:
    """Publish dead letters, confirmed, exactly as a worker's ``DeadLetterPublisher`` does, and
    index them as its batch does (``indexed=False``: as RabbitMQ dead-letters, unindexed)."""
    channel = connection.channel()
    queue = dead_letter_queue_name(stream)
    channel.queue_declare(queue, durable=True, arguments=dead_letter_queue_arguments(queue_type))
    channel.confirm_delivery()
    copies = []
    for delivery in deliveries:
        properties = dead_letter_properties(DeadLetter(delivery, reason, attempts=3))
        channel.basic_publish("", queue, delivery.body, properties, mandatory=True)
        copies.extend(letters_of(0, 0, delivery.body, properties))
    channel.close()
    if indexed:
        client = open_redis(load_settings())
        try:
            DeadLetterIndex(client, stream).add(copies)
        finally:
            client.close()


def letters_for(stream: str, plan: list[tuple[str, int]], producer: str = "p1") -> list[Delivery]:
    """Deliveries of keyq events: (key, seq) each, from ``stream``'s key queues."""
    queue = f"keyq.{stream}.k."
    return [
        keyq_delivery(queue + k, k, producer, s, orjson.dumps({"k": k, "s": s})) for k, s in plan
    ]


def peek_all(connection: pika.BlockingConnection, queue: str) -> list[tuple[dict[str, Any], bytes]]:
    """(headers, body) of every message in ``queue``, in order, handed back unchanged (by a
    consumer: a quorum queue with a single active consumer refuses ``basic.get``)."""
    channel = connection.channel()
    ready = int(channel.queue_declare(queue, passive=True).method.message_count)
    seen: list[tuple[dict[str, Any], bytes]] = []
    if ready:
        channel.basic_qos(prefetch_count=ready)
        for method, properties, body in channel.consume(queue, inactivity_timeout=5):
            if method is None:
                break
            seen.append((dict(properties.headers or {}), bytes(body)))
            if len(seen) == ready:
                break
        # Handed back by a nack, then awaited: a quorum queue requeues a closed channel's
        # messages asynchronously, and RabbitMQ 4 counts that against their delivery limit.
        channel.cancel()
        channel.basic_nack(0, multiple=True, requeue=True)
        wait_until(
            lambda: channel.queue_declare(queue, passive=True).method.message_count >= ready,
            10,
            f"{queue} to show its {ready} messages again",
        )
    channel.close()
    return seen


def ids_in(connection: pika.BlockingConnection, queue: str) -> list[str]:
    """``producer:seq`` (or the body, for foreign messages) of each message, in order."""
    found = []
    for headers, body in peek_all(connection, queue):
        producer, seq = headers.get(HEADER_PRODUCER), headers.get(HEADER_SEQ)
        if isinstance(producer, bytes):
            producer = producer.decode()
        found.append(f"{producer}:{seq}" if producer is not None else body.decode())
    return found


def keyq(*args: str) -> Result:
    """``keyq ARGS`` in this process; stdout and stderr apart."""
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def keyq_json(*args: str) -> dict[str, Any]:
    """``keyq ARGS --json``, checked to succeed; its output parsed."""
    result = keyq(*args, "--json")
    assert result.exit_code == 0, result.stderr
    return dict(orjson.loads(result.stdout))


def with_seams(stream: StreamFixture, seams: list[str], *command: str) -> subprocess.Popen[str]:
    """``keyq COMMAND`` started in a process of its own, with the test seams given."""
    return subprocess.Popen(
        [sys.executable, str(KEYQ_WITH_SEAMS), *seams, "--", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=keyq_environment(stream.settings),
        cwd=REPO,
    )


def one_line_error(result: Result, code: int) -> str:
    """Check the result failed with ``code`` and one line ``keyq: ...``; returns the line."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("keyq: "), result.stderr
    return lines[0]
