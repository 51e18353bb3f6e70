"""Poison never loops: an undecodable message is dead-lettered at once with its reason, and an
event that makes the pipeline fail is retried, isolated and dead-lettered alone, while every
other event is applied exactly once and in order. Workers run in the test process."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pika
import pytest

from keyq import Producer
from keyq.broker.envelope import (
    HEADER_ATTEMPTS,
    HEADER_DEAD_QUEUE,
    HEADER_DEAD_REASON,
    HEADER_KEY,
    HEADER_PRODUCER,
    HEADER_SEQ,
)
from keyq.broker.naming import dead_letter_queue_name, key_queue_name
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import load_settings
from keyq.broker.topology import keyed_queue_arguments
from keyq.worker.batch.state_store import StateStore
from keyq.worker.config import WorkerSettings
from keyq.worker.daemon import Worker
from keyq.worker.spark.engine import SparkEngine
from tests.conftest import StreamFixture
from tests.helpers import Landed, drain, events_in, queue_depth

# Also run on RabbitMQ 4.3 in CI: the core of keyq end to end on a current broker.
pytestmark = [pytest.mark.slow, pytest.mark.broker_versions]


def fast_settings(**overrides: Any) -> WorkerSettings:
    return load_settings(
        WorkerSettings,
        lock_ttl_ms=2000,
        member_ttl_ms=2000,
        tick_ms=200,
        scan_interval_ms=500,
        batch_max_ms=200,
        **overrides,
    )


def text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def publish_valid(producer: Producer, key: str, numbers: range, poison: int | None = None) -> None:
    for n in numbers:
        event: dict[str, Any] = {"n": n, "producer": "p"}
        if n == poison:
            event["poison"] = True
        producer.publish(key, event)
    producer.flush(timeout=20)


def run_worker(stream: StreamFixture, engine: SparkEngine, settings: WorkerSettings) -> Worker:
    worker = Worker(
        stream.name, "tests.pipelines:audit", mode="key", settings=settings, engine=engine
    )
    started = time.monotonic()
    worker.run(until_idle=3)
    print(f"worker ran {time.monotonic() - started:.1f}s; stats {worker.stats()}")
    return worker


def test_undecodable_payloads_are_dead_lettered_at_once(
    stream: StreamFixture,
    producer: Producer,
    amqp: pika.BlockingConnection,
    spark_engine: SparkEngine,
) -> None:
    key = "mixed"
    queue = key_queue_name(stream.name, key)
    channel = amqp.channel()
    channel.queue_declare(queue, durable=True, arguments=keyed_queue_arguments(stream.name))
    channel.confirm_delivery()
    QueueRegistry(stream.redis, stream.name).register({queue: key})

    bad: list[tuple[bytes, str]] = [
        (b'\xff\xfe{"n": 1}', "not UTF-8"),
        (b"this is not json {", "not JSON"),
    ]

    def publish_raw(seq: int, body: bytes) -> None:
        headers = {HEADER_KEY: key, HEADER_PRODUCER: "raw", HEADER_SEQ: seq}
        channel.basic_publish(
            "",
            queue,
            body,
            pika.BasicProperties(
                headers=headers,
                delivery_mode=pika.DeliveryMode.Persistent,
                content_type="application/json",
                message_id=f"raw-{seq}",
            ),
            mandatory=True,
        )

    publish_valid(producer, key, range(1, 4))
    publish_raw(1, bad[0][0])
    publish_valid(producer, key, range(4, 7))
    publish_raw(2, bad[1][0])
    publish_valid(producer, key, range(7, 10))
    assert events_in(amqp, queue) == 11

    worker = run_worker(stream, spark_engine, fast_settings())

    letters: list[Landed] = drain(amqp.channel(), dead_letter_queue_name(stream.name))
    assert len(letters) == 2, [(x.body, x.headers) for x in letters]
    for (body, words), letter in zip(bad, letters, strict=True):
        assert letter.body == body
        reason = text(letter.headers[HEADER_DEAD_REASON])
        assert reason.startswith("undecodable payload: "), reason
        assert words in reason, reason
        assert text(letter.headers[HEADER_DEAD_QUEUE]) == queue
        assert letter.key == key
        assert letter.producer == "raw"
        assert letter.headers[HEADER_ATTEMPTS] == 1  # never retried
    assert [letter.seq for letter in letters] == [1, 2]

    store = StateStore(stream.redis, stream.name)
    assert store.get(key) == {"applied": 9, "last": {"p": 9}, "violations": []}
    marks = store.get_marks(key)
    assert marks.applied == 9
    assert marks.seqs == {producer.producer_id: 9, "raw": 2}

    stats = worker.stats()
    assert stats["dead_lettered"] == 2
    assert stats["events"] == 9
    assert stats["pipeline_failures"] == 0
    assert queue_depth(amqp, queue) == 0


def test_a_poison_event_is_isolated_and_dead_lettered_alone(
    stream: StreamFixture,
    producer: Producer,
    amqp: pika.BlockingConnection,
    spark_engine: SparkEngine,
) -> None:
    keys = [f"k{index}" for index in range(10)]
    per_key = 12
    poisoned_key, poison_seq = "k1", 5
    for n in range(1, per_key + 1):
        for key in keys:
            event: dict[str, Any] = {"n": n, "producer": "p"}
            if key == poisoned_key and n == poison_seq:
                event["poison"] = True
            producer.publish(key, event)
    producer.flush(timeout=20)

    settings = fast_settings(max_attempts=2, retry_backoff_ms=50)
    started = time.monotonic()
    worker = run_worker(stream, spark_engine, settings)
    elapsed = time.monotonic() - started
    assert elapsed < 60, f"the worker took {elapsed:.0f}s: a retry loop?"

    letters = drain(amqp.channel(), dead_letter_queue_name(stream.name))
    assert len(letters) == 1, [(x.body, x.headers) for x in letters]
    letter = letters[0]
    assert letter.key == poisoned_key
    assert letter.seq == poison_seq
    assert letter.producer == producer.producer_id
    assert orjson.loads(letter.body) == {"n": poison_seq, "producer": "p", "poison": True}
    reason = text(letter.headers[HEADER_DEAD_REASON])
    assert "poison event" in reason, reason
    assert f"seq {poison_seq}" in reason, reason
    assert letter.headers[HEADER_ATTEMPTS] == 2
    assert text(letter.headers[HEADER_DEAD_QUEUE]) == key_queue_name(stream.name, poisoned_key)

    store = StateStore(stream.redis, stream.name)
    for key in keys:
        state = store.get(key)
        assert state is not None, key
        if key == poisoned_key:
            assert state == {
                "applied": per_key - 1,
                "last": {"p": per_key},
                "violations": [["p", poison_seq - 1, poison_seq + 1]],
            }
        else:
            assert state == {"applied": per_key, "last": {"p": per_key}, "violations": []}, key
        marks = store.get_marks(key)
        assert marks.seqs == {producer.producer_id: per_key}
        assert marks.applied == (per_key - 1 if key == poisoned_key else per_key)

    stats = worker.stats()
    assert stats["dead_lettered"] == 1
    assert stats["events"] == len(keys) * per_key - 1
    assert stats["skipped"] == 0
    # The batch failed twice, then the event the fold named was retried alone once: no
    # bisection, since the failure says which event it was.
    assert stats["pipeline_failures"] == 3, stats
    # The poison's queue is isolated (the events before it, it, the events after it) and
    # the other nine queues run again together: one job for them, not one per queue. The
    # first batch may have been split by arrival, hence "at most" one or two more.
    assert stats["batches"] <= 6, stats
    assert "keyq-event" not in reason, reason
    for key in keys:
        assert queue_depth(amqp, key_queue_name(stream.name, key)) == 0
