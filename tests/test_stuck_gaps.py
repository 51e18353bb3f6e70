"""A message the broker counts as delivered but never sent (RabbitMQ 3.10's quorum queues did
so across leader changes): the worker gets it back by reopening its consumer, and never acks
it by accident. The fault proxy cuts that ``basic.deliver`` out; the worker runs in process."""

from __future__ import annotations

import threading
import time

import pika
import pytest

from keyq.broker.envelope import HEADER_DEAD_REASON
from keyq.broker.naming import dead_letter_queue_name
from keyq.broker.settings import Settings
from keyq.worker.batch.state_store import StateStore
from keyq.worker.holding.abandoned_gaps import QUIET_S
from keyq.worker.holding.stuck_gaps import BUSY_FACTOR, REOPEN_AFTER_S
from keyq.worker.spark.engine import SparkEngine
from tests.conftest import StreamFixture
from tests.faults import FaultProxy
from tests.helpers import drain, queue_depth
from tests.test_worker_poison import text
from tests.test_worker_sequencing import RawPublisher, run, serving
from tests.workers import wait_until

pytestmark = pytest.mark.slow


def seq_marker(seq: int) -> bytes:
    """What only the body of the event with ``seq`` contains (RawPublisher's bodies)."""
    return b'{"n":%d,' % seq


def test_a_delivery_that_never_arrives_comes_back_when_the_consumer_is_reopened(
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    spark_engine: SparkEngine,
    settings: Settings,
) -> None:
    """Seq 3 of a running producer never reaches the worker; the broker would never send it
    again on that consumer: reopening it does, and 1..6 apply in order long before 60 s."""
    raw = RawPublisher(stream, amqp, "never-sent", running=True)
    raw.publish(*range(1, 7))
    with FaultProxy("127.0.0.1", pika.URLParameters(settings.amqp_url).port) as proxy:
        proxy.drop_deliveries(seq_marker(3))
        with serving(stream, spark_engine, amqp_url=proxy.url_for(settings.amqp_url)) as worker:
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
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    spark_engine: SparkEngine,
    settings: Settings,
) -> None:
    """As above, but another producer of the key publishes every 0.25 s throughout, as a
    busy bucket receives: the queue is never quiet for QUIET_S, and its gap must still get a
    reopening within the 60-s gap timeout, or seq 3 would come back late, dead-lettered."""
    raw = RawPublisher(stream, amqp, "busy", running=True)
    raw.publish(*range(1, 7))
    stop, sent = threading.Event(), [0]

    def keep_publishing() -> None:
        connection = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
        other = RawPublisher(stream, connection, raw.key, producer="other")
        try:
            while not stop.wait(0.25):
                sent[0] += 1
                other.publish(sent[0])
        finally:
            connection.close()

    busy = threading.Thread(target=keep_publishing, daemon=True)
    state = StateStore(stream.redis, stream.name)
    with FaultProxy("127.0.0.1", pika.URLParameters(settings.amqp_url).port) as proxy:
        proxy.drop_deliveries(seq_marker(3))
        with serving(stream, spark_engine, amqp_url=proxy.url_for(settings.amqp_url)) as worker:
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
    assert state.get(raw.key) == {
        "applied": 6 + sent[0],
        "last": {"ext": 6, "other": sent[0]},
        "violations": [],
    }
    assert stats["gap_reopens"] >= 1 and stats["gaps_skipped"] == 0, stats
    assert took >= REOPEN_AFTER_S * BUSY_FACTOR - 1, took  # 3 came back with the reopening
    assert queue_depth(amqp, raw.queue) == 0


def _last(state: StateStore, key: str, producer: str) -> int | None:
    found = state.get(key)
    return None if found is None else found["last"].get(producer)


def test_a_gap_given_up_never_acks_the_message_that_did_not_arrive(
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    spark_engine: SparkEngine,
    settings: Settings,
) -> None:
    """Seq 3 kept from the reopened consumers too: its gap is given up and 4..6 acked, but
    never by a multiple ack settling 3 (lost for good): 3 comes back, dead-lettered as late."""
    raw = RawPublisher(stream, amqp, "given-up")
    raw.publish(*range(1, 7))
    with FaultProxy("127.0.0.1", pika.URLParameters(settings.amqp_url).port) as proxy:
        proxy.drop_deliveries(*[seq_marker(3)] * 4)  # the first delivery and redeliveries
        worker = run(
            stream,
            spark_engine,
            amqp_url=proxy.url_for(settings.amqp_url),
            sequence_gap_timeout_ms=int(QUIET_S * 500),
        )
        assert 1 <= proxy.deliveries_dropped < 4
    state = StateStore(stream.redis, stream.name)
    assert state.get(raw.key) == {
        "applied": 5,
        "last": {"ext": 6},
        "violations": [["ext", 2, 4]],
    }
    assert worker.stats()["gaps_skipped"] == 1
    assert queue_depth(amqp, raw.queue) == 1, "seq 3 was acked without ever being applied"

    worker = run(stream, spark_engine)  # 3 comes back: late, dead-lettered with the reason
    assert worker.stats()["late"] == 1
    [letter] = drain(amqp.channel(), dead_letter_queue_name(stream.name))
    assert letter.seq == 3
    reason = text(letter.headers[HEADER_DEAD_REASON])
    assert reason.startswith("late: seq 3 of producer ext"), reason
    assert queue_depth(amqp, raw.queue) == 0
