"""A real worker rebuilds each key's order from (producer, seq) whatever order RabbitMQ
delivers in: events behind a gap wait unacked, a consumer whose whole prefetch waits is
reopened wider, and a gap given up after its timeout is reported, its late arrival
dead-lettered. A message the broker counts as delivered but never sent (RabbitMQ 3.10's quorum
queues did so across leader changes; the fault proxy cuts that ``basic.deliver`` out) comes
back when the consumer is reopened, and is never acked by accident. Workers run in the test
process against the real RabbitMQ, Redis and Spark."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pika
import pytest

from keyq import Producer
from keyq.broker.envelope import HEADER_DEAD_REASON
from keyq.broker.naming import dead_letter_queue_name
from keyq.broker.producer_presence import ProducerPresence
from keyq.worker.batch.state_store import StateStore
from keyq.worker.daemon import Worker
from keyq.worker.holding.abandoned_gaps import CHECK_EVERY_S, QUIET_S
from keyq.worker.holding.stuck_gaps import BUSY_FACTOR, REOPEN_AFTER_S
from keyq.worker.spark.engine import SparkEngine
from tests.conftest import StreamFixture
from tests.faults import FaultProxy
from tests.helpers import drain, open_keyed_queue, queue_depth
from tests.test_worker_poison import fast_settings, publish_raw, run, text
from tests.workers import wait_until

pytestmark = pytest.mark.slow


class RawPublisher:
    """Publishes SDK-shaped events of one producer in any order, as a broker could deliver
    them after a quorum queue's returns or a producer's re-sends."""

    def __init__(
        self,
        stream: StreamFixture,
        amqp: pika.BlockingConnection,
        key: str,
        *,
        running: bool = False,
        producer: str = "ext",
    ) -> None:
        """``running``: the producer announces itself as a live one would, so a gap in its
        seqs may still fill; otherwise it is a producer that is gone."""
        self.key = key
        self.producer = producer
        self.queue, self.channel = open_keyed_queue(stream, amqp, key)
        if running:
            ProducerPresence(stream.redis, stream.name).announce(producer, 600_000)

    def publish(self, *seqs: int) -> None:
        for seq in seqs:
            body = orjson.dumps({"n": seq, "producer": self.producer})
            publish_raw(self.channel, self.queue, body, seq, key=self.key, producer=self.producer)


@contextlib.contextmanager
def serving(stream: StreamFixture, engine: SparkEngine, **overrides: Any) -> Iterator[Worker]:
    """A worker serving the stream in a thread (a gap waits up to 60 s), stopped after."""
    worker = Worker(
        stream.name,
        "tests.pipelines:audit",
        mode="key",
        settings=fast_settings(**{"sequence_gap_timeout_ms": 60_000, **overrides}),
        engine=engine,
    )
    thread = threading.Thread(target=worker.run, kwargs={"until_idle": 30}, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(60)


def test_events_delivered_out_of_order_are_applied_in_seq_order(
    stream: StreamFixture, amqp: pika.BlockingConnection, spark_engine: SparkEngine
) -> None:
    """6..12 reach the queue before 1..5, and the prefetch (3) is smaller than what must
    wait: the consumer is reopened wider until 1..5 arrive. In delivery order, 1..5 would be
    skipped as already seen. Beside it, seqs start at 1 again in a second producer instance
    given the same producer_id: not skipped as already applied either."""
    raw = RawPublisher(stream, amqp, "out-of-order")
    raw.publish(*range(6, 13), *range(1, 6))
    ids = []
    for instance in range(2):
        with Producer(
            stream.name, mode="key", settings=stream.settings, producer_id="billing"
        ) as producer:
            ids.append(producer.producer_id)
            for n in range(1, 4):
                producer.publish("acct", {"n": n, "producer": f"instance-{instance}"})
    assert all(found.startswith("billing.") for found in ids) and ids[0] != ids[1]

    worker = run(stream, spark_engine, prefetch=3)

    state = StateStore(stream.redis, stream.name)
    assert state.get(raw.key) == {"applied": 12, "last": {"ext": 12}, "violations": []}
    assert state.get_marks(raw.key).seqs == {"ext": 12}
    restarted = state.get("acct")
    assert restarted is not None and restarted["applied"] == 6, restarted
    stats = worker.stats()
    assert stats["events"] == 12 + 6 and stats["skipped"] == 0
    assert stats["gaps_skipped"] == 0 and stats["waiting"] == 0
    assert queue_depth(amqp, raw.queue) == 0


def test_a_gap_past_its_timeout_is_reported_and_a_late_event_dead_lettered(
    stream: StreamFixture, amqp: pika.BlockingConnection, spark_engine: SparkEngine
) -> None:
    raw = RawPublisher(stream, amqp, "gap")
    raw.publish(3, 4)  # 1 and 2 never come (a producer that died before re-sending them)
    worker = run(stream, spark_engine, sequence_gap_timeout_ms=1500)

    state = StateStore(stream.redis, stream.name)
    # Applied after the timeout, and visibly so: the audit saw seq 3 follow nothing.
    assert state.get(raw.key) == {"applied": 2, "last": {"ext": 4}, "violations": [["ext", 0, 3]]}
    marks = state.get_marks(raw.key)
    assert marks.seqs == {"ext": 4} and marks.gaps == {"ext": [[1, 2]]}
    assert worker.stats()["gaps_skipped"] == 1

    raw.publish(2, 5)  # 2 turns up after all; 5 follows 4
    worker = run(stream, spark_engine, sequence_gap_timeout_ms=1500)
    assert worker.stats()["late"] == 1
    assert state.get(raw.key)["applied"] == 3  # type: ignore[index]
    [letter] = drain(amqp.channel(), dead_letter_queue_name(stream.name))
    assert letter.seq == 2
    reason = text(letter.headers[HEADER_DEAD_REASON])
    assert reason.startswith("late: seq 2 of producer ext"), reason


def test_a_gap_filled_before_its_timeout_leaves_nothing_behind(
    stream: StreamFixture, amqp: pika.BlockingConnection, spark_engine: SparkEngine
) -> None:
    """The events behind a gap wait unacked while the worker serves; status shows the gap;
    once the missing event comes, all are applied in order."""
    raw = RawPublisher(stream, amqp, "late-filler", running=True)
    raw.publish(2, 3)
    with serving(stream, spark_engine) as worker:
        wait_until(lambda: worker.stats()["waiting"] >= 2, 60, "2 events waiting")
        report = worker.stats()
        assert report["gaps_open"] == 1
        [gap] = report["gaps"]
        assert (gap["key"], gap["producer"], gap["first"], gap["last"]) == (raw.key, "ext", 1, 1)
        # Unacked while they wait: the broker still counts them as the queue's. Its producer
        # still runs, so the gap is kept open past the quiet time after which a gone
        # producer's gap is given up.
        time.sleep(QUIET_S + 2 * CHECK_EVERY_S + 1)
        assert worker.stats()["gaps_skipped"] == 0
        assert StateStore(stream.redis, stream.name).get(raw.key) is None

        raw.publish(1)
        wait_until(lambda: worker.stats()["events"] >= 3, 60, "3 events applied")
    state = StateStore(stream.redis, stream.name).get(raw.key)
    assert state == {"applied": 3, "last": {"ext": 3}, "violations": []}
    assert worker.stats()["gaps_open"] == 0
    assert queue_depth(amqp, raw.queue) == 0


def test_a_gone_producers_gap_is_given_up_once_its_queue_is_drained(
    stream: StreamFixture, amqp: pika.BlockingConnection, spark_engine: SparkEngine
) -> None:
    """A producer killed between taking seq 1 and its confirm leaves 2 and 3 behind a gap
    that never fills. With nothing more in the queue and the producer gone, the worker gives
    the gap up within seconds, not after the 60-s gap timeout, and reports it."""
    raw = RawPublisher(stream, amqp, "orphaned")  # no presence: the producer is gone
    raw.publish(2, 3)
    state = StateStore(stream.redis, stream.name)
    with serving(stream, spark_engine) as worker:
        wait_until(lambda: worker.stats()["waiting"] >= 2, 60, "2 events waiting")
        parked_at = time.monotonic()
        wait_until(lambda: worker.stats()["events"] >= 2, 20, "the gap given up")
        waited = time.monotonic() - parked_at
    assert waited + 0.5 >= QUIET_S, waited  # not before the queue had been quiet a while
    assert state.get(raw.key) == {"applied": 2, "last": {"ext": 3}, "violations": [["ext", 0, 2]]}
    assert state.get_marks(raw.key).gaps == {"ext": [[1, 1]]}
    assert worker.stats()["gaps_skipped"] == 1
    assert queue_depth(amqp, raw.queue) == 0


@contextlib.contextmanager
def dropping(stream: StreamFixture, *seqs: int) -> Iterator[tuple[FaultProxy, str]]:
    """The broker behind a fault proxy, and its URL, that drops a delivery of the event with
    each of ``seqs`` (found by what only its RawPublisher body contains)."""
    url = stream.settings.amqp_url
    with FaultProxy("127.0.0.1", pika.URLParameters(url).port) as proxy:
        proxy.drop_deliveries(*[b'{"n":%d,' % seq for seq in seqs])
        yield proxy, proxy.url_for(url)


def test_a_delivery_that_never_arrives_comes_back_when_the_consumer_is_reopened(
    stream: StreamFixture, amqp: pika.BlockingConnection, spark_engine: SparkEngine
) -> None:
    """Seq 3 of a running producer never reaches the worker; the broker would never send it
    again on that consumer: reopening it does, and 1..6 apply in order long before 60 s."""
    raw = RawPublisher(stream, amqp, "never-sent", running=True)
    raw.publish(*range(1, 7))
    with dropping(stream, 3) as (proxy, url):
        with serving(stream, spark_engine, amqp_url=url) as worker:
            started = time.monotonic()
            wait_until(lambda: worker.stats()["events"] >= 6, 45, "all 6 applied")
            took = time.monotonic() - started
            stats = worker.stats()
        assert proxy.deliveries_dropped == 1
    state = StateStore(stream.redis, stream.name)
    assert state.get(raw.key) == {"applied": 6, "last": {"ext": 6}, "violations": []}
    assert stats["gap_reopens"] >= 1 and stats["gaps_skipped"] == 0, stats
    assert took >= REOPEN_AFTER_S - 1, took  # 3 came back only with the reopening
    assert queue_depth(amqp, raw.queue) == 0


def test_a_queue_that_keeps_receiving_is_reopened_for_its_gap_too(
    stream: StreamFixture, amqp: pika.BlockingConnection, spark_engine: SparkEngine
) -> None:
    """As above, but another producer of the key publishes every 0.25 s throughout, as a
    busy bucket receives: the queue is never quiet for QUIET_S, and its gap must still get a
    reopening within the 60-s gap timeout, or seq 3 would come back late, dead-lettered."""
    raw = RawPublisher(stream, amqp, "busy", running=True)
    raw.publish(*range(1, 7))
    stop, sent = threading.Event(), [0]

    def keep_publishing() -> None:
        connection = pika.BlockingConnection(pika.URLParameters(stream.settings.amqp_url))
        other = RawPublisher(stream, connection, raw.key, producer="other")
        try:
            while not stop.wait(0.25):
                sent[0] += 1
                other.publish(sent[0])
        finally:
            connection.close()

    busy = threading.Thread(target=keep_publishing, daemon=True)
    state = StateStore(stream.redis, stream.name)
    with dropping(stream, 3) as (proxy, url):
        with serving(stream, spark_engine, amqp_url=url) as worker:
            busy.start()
            started = time.monotonic()
            try:
                wait_until(lambda: _last(state, raw.key, "ext") == 6, 45, "ext's 6 applied")
                took = time.monotonic() - started
            finally:
                stop.set()
                busy.join(10)
            wait_until(lambda: _last(state, raw.key, "other") == sent[0], 60, "all of other's")
            stats = worker.stats()
        assert proxy.deliveries_dropped == 1
    assert sent[0] >= took / 0.25 * 0.5, sent  # it kept receiving while the gap waited
    expected = {"applied": 6 + sent[0], "last": {"ext": 6, "other": sent[0]}, "violations": []}
    assert state.get(raw.key) == expected
    assert stats["gap_reopens"] >= 1 and stats["gaps_skipped"] == 0, stats
    assert took >= REOPEN_AFTER_S * BUSY_FACTOR - 1, took  # 3 came back with the reopening
    assert queue_depth(amqp, raw.queue) == 0


def _last(state: StateStore, key: str, producer: str) -> int | None:
    found = state.get(key)
    return None if found is None else found["last"].get(producer)


def test_a_gap_given_up_never_acks_the_message_that_did_not_arrive(
    stream: StreamFixture, amqp: pika.BlockingConnection, spark_engine: SparkEngine
) -> None:
    """Seq 3 kept from the reopened consumers too: its gap is given up and 4..6 acked, but
    never by a multiple ack settling 3 (lost for good): 3 comes back, dead-lettered as late."""
    raw = RawPublisher(stream, amqp, "given-up")
    raw.publish(*range(1, 7))
    with dropping(stream, 3, 3, 3, 3) as (proxy, url):  # the first delivery, redeliveries
        worker = run(stream, spark_engine, amqp_url=url, sequence_gap_timeout_ms=int(QUIET_S * 500))
        assert 1 <= proxy.deliveries_dropped < 4
    state = StateStore(stream.redis, stream.name)
    assert state.get(raw.key) == {"applied": 5, "last": {"ext": 6}, "violations": [["ext", 2, 4]]}
    assert worker.stats()["gaps_skipped"] == 1
    assert queue_depth(amqp, raw.queue) == 1, "seq 3 was acked without ever being applied"

    worker = run(stream, spark_engine)  # 3 comes back: late, dead-lettered with the reason
    assert worker.stats()["late"] == 1
    [letter] = drain(amqp.channel(), dead_letter_queue_name(stream.name))
    assert letter.seq == 3
    reason = text(letter.headers[HEADER_DEAD_REASON])
    assert reason.startswith("late: seq 3 of producer ext"), reason
    assert queue_depth(amqp, raw.queue) == 0
