"""Packs (``keyq.broker.packs``, several events of one queue in a message) reaching a real
worker: unpacked, each event applied once in its key's order, the message acked once all are
settled. Packs are built by hand with the headers the SDK gives each event."""

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
from tests.test_worker_poison import fast_settings, text
from tests.workers import wait_until

pytestmark = pytest.mark.slow

CONTENT_JSON = "application/json"


class PackPublisher:
    """One producer's events of one key, as packs or alone, to the key's queue; each body is
    ``{"n": seq, "producer": "pk"}``, what the audit fold checks the order of."""

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


def test_packs_are_applied_once_in_order_a_poison_event_dead_lettered_alone_a_bad_pack_whole(
    stream: StreamFixture, amqp: pika.BlockingConnection, spark_engine: SparkEngine
) -> None:
    """One run over three keys: packs of 5 to 10 with singles between (one pack ahead of its
    turn); a pack whose 4th event fails the pipeline; a pack cut short."""
    mixed = PackPublisher(stream, amqp, "mixed")
    mixed.pack(range(1, 6))
    mixed.single(6)
    mixed.pack(range(17, 24))  # ahead of 7..16: its events wait for them
    mixed.pack(range(7, 17))
    mixed.single(24)
    mixed.pack(range(25, 31))
    assert queue_depth(amqp, mixed.queue) == 6
    poisoned = PackPublisher(stream, amqp, "poisoned")
    poisoned.pack(range(1, 8), poison=4)
    poisoned.pack(range(8, 11))
    malformed = PackPublisher(stream, amqp, "malformed")
    malformed.pack(range(1, 4))
    _id, headers, body = malformed.event(99)
    broken = MAGIC + encode_record("x", CONTENT_JSON, headers, body)[:-3]  # cut short
    malformed.raw_pack(broken, 1)
    malformed.pack(range(4, 7))

    worker = run_worker(stream, spark_engine, max_attempts=2, retry_backoff_ms=50)

    store = StateStore(stream.redis, stream.name)
    assert store.get(mixed.key) == audit_of(30, 30), "packs and singles applied once, in order"
    assert store.get_marks(mixed.key).seqs == {mixed.producer_id: 30}
    assert store.get(poisoned.key) == audit_of(9, 10, [["pk", 3, 5]]), "all but the poison"
    assert store.get_marks(poisoned.key).seqs == {poisoned.producer_id: 10}
    assert store.get(malformed.key) == audit_of(6, 6), "the key goes on past a bad pack"
    stats = worker.stats()
    assert (stats["events"], stats["skipped"], stats["dead_lettered"]) == (45, 0, 2), stats
    # Stopped, the worker closed its consumers: anything it had not acked would be back.
    for sender in (mixed, poisoned, malformed):
        assert queue_depth(amqp, sender.queue) == 0, f"{sender.key}'s packs acked"

    found = letters(amqp, stream)
    dead = {text(letter.headers[HEADER_DEAD_QUEUE]): (letter, body) for letter, body in found}
    assert len(found) == 2 and set(dead) == {poisoned.queue, malformed.queue}, "a letter each"
    letter, body = dead[poisoned.queue]  # one message of one event, not a pack
    assert letter.content_type == CONTENT_JSON
    assert orjson.loads(body) == {"n": 4, "producer": "pk", "poison": True}
    headers = letter.headers
    assert text(headers[HEADER_KEY]) == poisoned.key and headers[HEADER_SEQ] == 4
    assert text(headers[HEADER_PRODUCER]) == poisoned.producer_id
    assert letter.message_id is not None and letter.message_id.startswith(poisoned.producer_id)
    assert text(headers["trace"]) == "t-4"
    assert HEADER_PACK not in headers
    reason = text(headers[HEADER_DEAD_REASON])
    assert "poison event 4" in reason, reason
    assert headers[HEADER_ATTEMPTS] == 2
    letter, body = dead[malformed.queue]
    assert body == broken, "nothing of a malformed pack is lost"
    assert letter.content_type == PACK_CONTENT_TYPE
    assert letter.headers[HEADER_PACK] == 1
    reason = text(letter.headers[HEADER_DEAD_REASON])
    assert reason.startswith("malformed pack: ") and "runs past the end" in reason, reason
    assert letter.headers[HEADER_ATTEMPTS] == 1, "a malformed pack is never retried"


def test_a_worker_killed_while_holding_packs_leaves_them_to_another(
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    workers: Any,
    tmp_path: Path,
) -> None:
    """kill -9 mid-batch: unacked packs go back whole, their committed events are skipped on
    redelivery, and the next worker applies the rest once, in order."""
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
    """prefetch 40 events, packs of 20: an AMQP prefetch of 2 messages, so all but two packs
    stay ready while the worker sits in a batch."""
    sender = PackPublisher(stream, amqp, "wide")
    for first in range(1, 201, 20):
        sender.pack(range(first, first + 20))
    assert queue_depth(amqp, sender.queue) == 10
    marker = tmp_path / "batch"
    monkeypatch.setenv("KEYQ_TEST_BATCH_MARKER", str(marker))
    monkeypatch.setenv("KEYQ_TEST_BATCH_PAUSE", "2")
    seen: list[int | None] = []

    def watch() -> None:
        wait_until(marker.exists, 60, "the first batch")
        time.sleep(0.5)  # the batch's pipeline sleeps: nothing is acked meanwhile
        seen.append(queue_depth(amqp, sender.queue))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    run_worker(stream, spark_engine, "tests.pipelines:audit_slow", prefetch=40, pack_max_events=20)
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
    """An AMQP prefetch of 2 messages, both waiting for the third pack: the consumer is reopened
    wider (its whole prefetch parked, counted in messages)."""
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
    """prefetch 100 events, packs of 20 (room for 5 messages), then single events: widened to
    100 messages within seconds of its first reopening, not a shrink cool-down (5 s) later."""
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
    """prefetch 100 events, batches of 2,000, 3,000 events in one queue: widened to a batch's
    worth once it shows full, rather than 30 nearly empty batches."""
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
