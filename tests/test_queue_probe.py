"""The shared queue probe on the real broker: counts, a 404 read as what it means, and the
channel a 404 closed opened again for the next queue."""

from __future__ import annotations

import uuid

import pika

from keyq.broker.queue_probe import QueueCounts, QueueProbe
from keyq.broker.queue_refusals import QueueRefusal


def test_a_probe_tells_a_missing_queue_and_goes_on_with_the_next(
    amqp: pika.BlockingConnection,
) -> None:
    name = f"keyq.probe.{uuid.uuid4().hex}"
    amqp.channel().queue_declare(name, durable=True)
    probe = QueueProbe(amqp.channel)
    try:
        assert probe.look(f"{name}.gone") is QueueRefusal.MISSING
        assert probe.counts(name) == QueueCounts(ready=0, consumers=0)
        assert probe.counts_of([f"{name}.gone", name, name]) == {
            f"{name}.gone": None,
            name: QueueCounts(ready=0, consumers=0),
        }
    finally:
        probe.close()
        amqp.channel().queue_delete(name)
