"""Quorum keyed queues: RabbitMQ ignores ``exclusive`` on their consumers, so keyq declares
them with single active consumer; a second consumer gets nothing while the first is attached,
and every message once it is gone. (Not necessarily in order: a quorum queue may hand the
dead consumer's unacked messages back after newer ones, which is why keyq's per-key order is
promised for classic queues only; see docs/operations.md.)"""

from __future__ import annotations

from typing import Any

import pika
import pytest

from keyq import Producer
from keyq.broker.naming import key_queue_name
from keyq.broker.topology import keyed_queue_arguments
from keyq.worker.batch.state_store import StateStore
from tests.helpers import queue_depth

# Quorum queues ignore exclusive consumers and changed defaults on 4.x: run on 4.3 in CI too.
pytestmark = pytest.mark.broker_versions


def test_a_second_consumer_of_a_quorum_keyed_queue_waits_for_the_first(
    stream: Any, settings: Any, amqp: pika.BlockingConnection
) -> None:
    queue = key_queue_name(stream.name, "acct-1")
    stream.track(queue)
    first = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    try:
        channel = first.channel()
        arguments = keyed_queue_arguments(stream.name, "quorum")
        channel.queue_declare(queue, durable=True, arguments=arguments)
        channel.basic_qos(prefetch_count=1)
        got_first: list[bytes] = []
        channel.basic_consume(queue, lambda c, m, p, b: got_first.append(b), exclusive=True)
        got_second: list[bytes] = []
        amqp.channel().basic_consume(queue, lambda c, m, p, b: got_second.append(b), exclusive=True)
        publisher = amqp.channel()
        for n in range(1, 6):
            publisher.basic_publish("", queue, str(n).encode())
        first.process_data_events(time_limit=1.0)
        amqp.process_data_events(time_limit=1.0)
        assert got_first == [b"1"]  # prefetch 1, never acked
        assert got_second == []  # attached, but idle while the first consumer lives
        first.close()  # the first worker dies: its unacked message goes back to the queue
        for _ in range(50):
            amqp.process_data_events(time_limit=0.1)
            if len(got_second) == 5:
                break
        assert sorted(got_second) == [b"1", b"2", b"3", b"4", b"5"], got_second
    finally:
        if first.is_open:
            first.close()


@pytest.mark.slow
def test_a_worker_serves_a_quorum_stream_that_adopts_its_type(
    stream: Any, workers: Any, amqp: Any
) -> None:
    """The producer fixes quorum; a worker started without any queue type setting adopts it
    (its dead-letter queue declaration would be refused otherwise) and applies every event."""
    with Producer(stream.name, mode="key", queue_type="quorum", settings=stream.settings) as p:
        for n in range(1, 21):
            for key in ("acct-1", "acct-2"):
                p.publish(key, {"n": n, "producer": "p"})
        p.flush()
    worker = workers(stream.name, until_idle=3)
    assert worker.wait(180) == 0, worker.log()[-3000:]
    store = StateStore(stream.redis, stream.name)
    for key in ("acct-1", "acct-2"):
        state = store.get(key)
        assert state == {"applied": 20, "last": {"p": 20}, "violations": []}, (key, state)
        assert queue_depth(amqp, key_queue_name(stream.name, key)) == 0
