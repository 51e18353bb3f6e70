"""Packs reaching a real worker: a message holding several events of one queue
(``keyq.broker.packs``) is unpacked into its events, each applied exactly once and in its
key's order, and the message is acked once every event is settled. A poison event in a pack is
dead-lettered alone; a malformed pack is dead-lettered whole; a worker killed while holding
packs leaves them to another; the AMQP prefetch counts packs, not events. Packs are built
here by hand, with the headers the SDK's producer gives each event, against the real RabbitMQ,
Redis and Spark."""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pika
import pytest

from keyq.broker.clock import now_ms
from keyq.broker.envelope import (
    HEADER_ATTEMPTS,
    HEADER_DEAD_QUEUE,
    HEADER_DEAD_REASON,
    HEADER_KEY,
    HEADER_PRODUCER,
    HEADER_PUBLISHED_AT,
    HEADER_SEQ,
    HEADER_STREAM,
)
from keyq.broker.naming import dead_letter_queue_name
from keyq.broker.packs import HEADER_PACK, MAGIC, PACK_CONTENT_TYPE, encode_pack, encode_record
from keyq.worker.batch.state_store import StateStore
from keyq.worker.daemon import Worker
from keyq.worker.spark.engine import SparkEngine
from tests.conftest import StreamFixture
from tests.helpers import drain, open_keyed_queue, queue_depth
from tests.test_worker_poison import fast_settings
from tests.workers import wait_until

pytestmark = pytest.mark.slow

CONTENT_JSON = "application/json"


def text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class PackPublisher:
    """One producer's events of one key, published as packs or alone, to the key's queue
    declared and registered as the SDK's producer does. Each event's headers are those the
    producer gives a message of its own; its body is ``{"n": seq, "producer": "pk"}``, what
    the audit fold checks the order of."""

    def __init__(self, stream: StreamFixture, amqp: pika.BlockingConnection, key: str) -> None:
        self.stream = stream.name
        self.key = key
        self.queue, self.channel = open_keyed_queue(stream, amqp, key)
        self.producer_id = f"pk-{uuid.uuid4().hex[:8]}"
        self._numbers = itertools.count(1)

    def event(self, seq: int, **extra: Any) -> tuple[str, dict[str, Any], bytes]:
        """(message id, headers, body) of event ``seq``, as ``Producer._accept`` makes them."""
        headers: dict[str, Any] = {
            "trace": f"t-{seq}",  # a header of the application's own
            HEADER_STREAM: self.stream,
            HEADER_KEY: self.key,
            HEADER_PRODUCER: self.producer_id,
            HEADER_SEQ: seq,
            HEADER_PUBLISHED_AT: now_ms(),
        }
        body = orjson.dumps({"n": seq, "producer": "pk", **extra})
        return f"{self.producer_id}:{next(self._numbers)}", headers, body

    def single(self, seq: int, **extra: Any) -> None:
        message_id, headers, body = self.event(seq, **extra)
        self._publish(body, CONTENT_JSON, message_id, headers)

    def pack(self, seqs: Sequence[int], poison: int | None = None) -> None:
        records = []
        for seq in seqs:
            message_id, headers, body = self.event(
                seq, **({"poison": True} if seq == poison else {})
            )
            records.append(encode_record(message_id, CONTENT_JSON, headers, body))
        self.raw_pack(encode_pack(records), len(records))

    def raw_pack(self, body: bytes, count: int) -> None:
        """A message labelled as a pack of ``count`` events, whatever ``body`` is."""
        headers = {
            HEADER_STREAM: self.stream,
            HEADER_PRODUCER: self.producer_id,
            HEADER_PACK: count,
            HEADER_KEY: self.key,
        }
        self._publish(body, PACK_CONTENT_TYPE, f"pack:{self.producer_id}:{count}", headers)

    def _publish(
        self, body: bytes, content_type: str, message_id: str, headers: dict[str, Any]
    ) -> None:
        self.channel.basic_publish(
            "",
            self.queue,
            body,
            pika.BasicProperties(
                delivery_mode=pika.DeliveryMode.Persistent,
                content_type=content_type,
                message_id=message_id,
                headers=headers,
            ),
            mandatory=True,
        )


def letters(amqp: pika.BlockingConnection, stream: StreamFixture) -> list[tuple[Any, bytes]]:
    """The dead-letter queue's messages as they are, (properties, body), acked."""
    channel = amqp.channel()
    found = []
    while True:
        method, properties, body = channel.basic_get(dead_letter_queue_name(stream.name))
        if method is None:
            return found
        channel.basic_ack(method.delivery_tag)
        found.append((properties, body))


def run_worker(
    stream: StreamFixture, engine: SparkEngine, pipeline: str = "tests.pipelines:audit", **opts: Any
) -> Worker:
    worker = Worker(
        stream.name, pipeline, mode="key", settings=fast_settings(**opts), engine=engine
    )
    worker.run(until_idle=3)
    print(f"stats {worker.stats()}")
    return worker


def audit_of(applied: int, last: int, violations: list[list[Any]] | None = None) -> dict[str, Any]:
    return {"applied": applied, "last": {"pk": last}, "violations": violations or []}


def test_packs_and_singles_of_a_key_are_applied_once_in_order(
    stream: StreamFixture, amqp: pika.BlockingConnection, spark_engine: SparkEngine
) -> None:
    """30 events: packs of 5 to 10 with singles between, one pack ahead of its turn."""
    sender = PackPublisher(stream, amqp, "mixed")
    sender.pack(range(1, 6))
    sender.single(6)
    sender.pack(range(17, 24))  # ahead of 7..16: its events wait for them
    sender.pack(range(7, 17))
    sender.single(24)
    sender.pack(range(25, 31))
    assert queue_depth(amqp, sender.queue) == 6

    worker = run_worker(stream, spark_engine)

    store = StateStore(stream.redis, stream.name)
    assert store.get(sender.key) == audit_of(30, 30)
    assert store.get_marks(sender.key).seqs == {sender.producer_id: 30}
    stats = worker.stats()
    assert (stats["events"], stats["skipped"], stats["dead_lettered"]) == (30, 0, 0), stats
    # Stopped, the worker closed its consumer: anything it had not acked would be back.
    assert queue_depth(amqp, sender.queue) == 0
    assert drain(amqp.channel(), dead_letter_queue_name(stream.name)) == []


def test_a_poison_event_in_a_pack_is_dead_lettered_alone(
    stream: StreamFixture, amqp: pika.BlockingConnection, spark_engine: SparkEngine
) -> None:
    """A pack of 7 whose 4th event makes the pipeline fail: the 4th alone goes to the
    dead-letter queue, as a message of its own; the rest of the pack, and the key's later
    events, are applied once, in order."""
    sender = PackPublisher(stream, amqp, "poisoned")
    sender.pack(range(1, 8), poison=4)
    sender.pack(range(8, 11))

    worker = run_worker(stream, spark_engine, max_attempts=2, retry_backoff_ms=50)

    store = StateStore(stream.redis, stream.name)
    assert store.get(sender.key) == audit_of(9, 10, [["pk", 3, 5]])
    assert store.get_marks(sender.key).seqs == {sender.producer_id: 10}
    [(letter, body)] = letters(amqp, stream)  # one message of one event, not a pack
    assert letter.content_type == CONTENT_JSON
    assert orjson.loads(body) == {"n": 4, "producer": "pk", "poison": True}
    headers = letter.headers
    assert text(headers[HEADER_KEY]) == sender.key and headers[HEADER_SEQ] == 4
    assert text(headers[HEADER_PRODUCER]) == sender.producer_id
    assert letter.message_id is not None and letter.message_id.startswith(sender.producer_id)
    assert text(headers["trace"]) == "t-4"
    assert HEADER_PACK not in headers
    reason = text(headers[HEADER_DEAD_REASON])
    assert "poison event 4" in reason, reason
    assert headers[HEADER_ATTEMPTS] == 2
    assert text(headers[HEADER_DEAD_QUEUE]) == sender.queue
    stats = worker.stats()
    assert (stats["events"], stats["dead_lettered"]) == (9, 1), stats
    assert queue_depth(amqp, sender.queue) == 0  # the pack was acked


def test_a_malformed_pack_is_dead_lettered_whole_and_the_key_goes_on(
    stream: StreamFixture, amqp: pika.BlockingConnection, spark_engine: SparkEngine
) -> None:
    sender = PackPublisher(stream, amqp, "malformed")
    sender.pack(range(1, 4))
    _id, headers, body = sender.event(99)
    broken = MAGIC + encode_record("x", CONTENT_JSON, headers, body)[:-3]  # cut short
    sender.raw_pack(broken, 1)
    sender.pack(range(4, 7))

    worker = run_worker(stream, spark_engine)

    store = StateStore(stream.redis, stream.name)
    assert store.get(sender.key) == audit_of(6, 6)
    [(letter, body)] = letters(amqp, stream)
    assert body == broken  # nothing of it is lost
    assert letter.content_type == PACK_CONTENT_TYPE
    assert letter.headers[HEADER_PACK] == 1
    reason = text(letter.headers[HEADER_DEAD_REASON])
    assert reason.startswith("malformed pack: ") and "runs past the end" in reason, reason
    assert letter.headers[HEADER_ATTEMPTS] == 1  # never retried
    assert worker.stats()["dead_lettered"] == 1
    assert queue_depth(amqp, sender.queue) == 0


def test_a_worker_killed_while_holding_packs_leaves_them_to_another(
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    workers: Any,
    tmp_path: Path,
) -> None:
    """kill -9 mid-batch: its unacked packs go back whole, events it had committed among
    them are skipped on redelivery, and the next worker applies the rest once, in order."""
    keys, per_key = [f"k{index}" for index in range(4)], 60
    senders = [PackPublisher(stream, amqp, key) for key in keys]
    for sender in senders:
        seq = 1
        for size in itertools.cycle((5, 1, 10, 7, 3, 8)):
            if seq > per_key:
                break
            last = min(per_key, seq + size - 1)
            if last == seq:
                sender.single(seq)
            else:
                sender.pack(range(seq, last + 1))
            seq = last + 1
    marker = tmp_path / "batch"
    env = {
        "KEYQ_TEST_BATCH_MARKER": str(marker),
        "KEYQ_TEST_BATCH_PAUSE": "1.5",
        "KEYQ_BATCH_MAX_EVENTS": "25",  # a pack's events span batches
        "KEYQ_PREFETCH": "40",
    }
    first = workers(stream.name, pipeline="tests.pipelines:audit_slow", env=env).wait_ready()
    store = StateStore(stream.redis, stream.name)

    def applied() -> int:
        return sum((store.get(key) or {"applied": 0})["applied"] for key in keys)

    wait_until(lambda: applied() >= 20, 90, "a first commit")
    wait_until(marker.exists, 30, "the worker to be inside a batch")
    first.kill()
    assert applied() < len(keys) * per_key, "the first worker finished before it was killed"

    second = workers(stream.name, pipeline="tests.pipelines:audit").wait_ready()
    wait_until(lambda: applied() >= len(keys) * per_key, 120, "every event to be applied", 0.5)
    time.sleep(1)  # anything applied twice would show in the audit by now
    for key in keys:
        assert store.get(key) == audit_of(per_key, per_key), key
    for sender in senders:
        wait_until(lambda s=sender: queue_depth(amqp, s.queue) == 0, 30, f"{sender.queue} acked")
    assert second.process.poll() is None
    assert drain(amqp.channel(), dead_letter_queue_name(stream.name)) == []


def test_the_prefetch_counts_events_so_a_consumer_holds_prefetch_over_pack_size_packs(
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    spark_engine: SparkEngine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """prefetch 40 events, packs of up to 20: the consumer's AMQP prefetch is 2 messages, so
    while the worker sits in a batch, the broker still has all but two packs ready."""
    sender = PackPublisher(stream, amqp, "wide")
    for first in range(1, 201, 20):
        sender.pack(range(first, first + 20))
    assert queue_depth(amqp, sender.queue) == 10
    marker = tmp_path / "batch"
    monkeypatch.setenv("KEYQ_TEST_BATCH_MARKER", str(marker))
    monkeypatch.setenv("KEYQ_TEST_BATCH_PAUSE", "2")
    worker = Worker(
        stream.name,
        "tests.pipelines:audit_slow",
        mode="key",
        settings=fast_settings(prefetch=40, pack_max_events=20),
        engine=spark_engine,
    )
    seen: list[int | None] = []

    def watch() -> None:
        wait_until(marker.exists, 60, "the first batch")
        time.sleep(0.5)  # the batch's pipeline sleeps: nothing is acked meanwhile
        seen.append(queue_depth(amqp, sender.queue))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    worker.run(until_idle=3)
    watcher.join(10)
    assert seen == [8], seen  # two packs out, unacked: 40 events
    store = StateStore(stream.redis, stream.name)
    assert store.get(sender.key) == audit_of(200, 200)
    assert queue_depth(amqp, sender.queue) == 0


def test_a_small_prefetch_drains_packs_that_arrive_out_of_order(
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    spark_engine: SparkEngine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An AMQP prefetch of 2 messages, and the first two packs both wait for the third: the
    consumer is reopened wider (its whole prefetch parked, counted in messages), and every
    event is applied once, in order."""
    sender = PackPublisher(stream, amqp, "reordered")
    order = [(21, 41), (41, 61), (1, 21), (61, 81), (81, 101)]
    for start, stop in order:
        sender.pack(range(start, stop))

    caplog.set_level(logging.INFO, logger="keyq.worker")
    worker = run_worker(stream, spark_engine, prefetch=40, pack_max_events=20)

    # Both packs out waited: 2 messages parked, reopened with room for 2 more.
    assert "all 2 unacked messages wait for an earlier seq" in caplog.text
    assert "a prefetch of 4 messages" in caplog.text
    store = StateStore(stream.redis, stream.name)
    assert store.get(sender.key) == audit_of(100, 100)
    stats = worker.stats()
    assert (stats["events"], stats["skipped"], stats["gaps_skipped"]) == (100, 0, 0), stats
    assert queue_depth(amqp, sender.queue) == 0


def test_a_queue_whose_packs_give_way_to_single_events_gets_room_for_them_within_seconds(
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    spark_engine: SparkEngine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """prefetch 100 events, packs of up to 20: the consumer starts with room for 5 messages.
    Packs come first, then single events (a hot key's packs forwarded away, its bucket-mates'
    events left): the consumer is widened to 100 messages within a second or two of its first
    reopening, not one shrink cool-down (5 s) later, and every event is applied once, in
    order."""
    sender = PackPublisher(stream, amqp, "narrowing")
    for first in range(1, 201, 20):
        sender.pack(range(first, first + 20))
    for seq in range(201, 1201):
        sender.single(seq)

    caplog.set_level(logging.INFO, logger="keyq.worker")
    # A batch of 100 events leaves no room to widen into: the message size alone is fitted.
    worker = run_worker(
        stream, spark_engine, prefetch=100, pack_max_events=20, batch_max_events=100
    )

    reopenings = [
        (record.created, record.getMessage())
        for record in caplog.records
        if "reopening it with a prefetch of" in record.getMessage()
    ]
    assert reopenings, caplog.text
    wide = [at for at, message in reopenings if "a prefetch of 100 messages" in message]
    assert wide, reopenings
    assert wide[0] - reopenings[0][0] < 3.0, reopenings
    store = StateStore(stream.redis, stream.name)
    assert store.get(sender.key) == audit_of(1200, 1200)
    assert worker.stats()["events"] == 1200
    assert queue_depth(amqp, sender.queue) == 0


def test_a_lone_backed_up_queue_is_widened_to_drain_a_batch_at_a_time(
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    spark_engine: SparkEngine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """prefetch 100 events, batches of up to 2,000: 3,000 events wait in one queue. Held to its
    prefetch, the queue would take at least 30 batches, each nearly empty; its consumer is
    widened to a batch's worth once it shows full, and every event is applied once, in
    order."""
    sender = PackPublisher(stream, amqp, "backlog")
    for first in range(1, 3001, 20):
        sender.pack(range(first, first + 20))

    caplog.set_level(logging.INFO, logger="keyq.worker")
    worker = run_worker(
        stream, spark_engine, prefetch=100, pack_max_events=20, batch_max_events=2000
    )

    assert "reopening it with a prefetch of 100 messages (was 5)" in caplog.text
    stats = worker.stats()
    assert stats["events"] == 3000, stats
    assert stats["batches"] <= 10, stats
    store = StateStore(stream.redis, stream.name)
    assert store.get(sender.key) == audit_of(3000, 3000)
    assert queue_depth(amqp, sender.queue) == 0
