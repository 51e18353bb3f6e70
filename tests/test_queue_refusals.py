"""A 404 about a queue means "missing" or "there but unreachable", by meaning, on every release.
The unreachable texts are RabbitMQ 3.10's and 4.3's for a classic queue whose node is stopped
(tests/test_cluster.py checks that end to end); the missing one is asked of the real broker."""

from __future__ import annotations

import uuid

import pika
import pika.exceptions
import pytest

from keyq.broker.queue_refusals import QueueRefusal, classify, unreachable_queue

QUEUE = "keyq.orders.k.order-17"
HOME_NODE_DOWN_3_10 = (
    f"NOT_FOUND - home node 'kq2@localhost' of durable queue '{QUEUE}' in vhost '/' is down "
    "or inaccessible"
)
STOPPED_4_3 = f"NOT_FOUND - queue '{QUEUE}' in vhost '/' process is stopped by supervisor"
MISSING = f"NOT_FOUND - no queue '{QUEUE}' in vhost '/'"
# A later release's wording: waiting for the queue is the safe reading.
NEW_WORDING = f"NOT_FOUND - queue '{QUEUE}' in vhost 'prod' has no running replica"
UNREACHABLE, MISSING_, OTHER = QueueRefusal.UNREACHABLE, QueueRefusal.MISSING, QueueRefusal.OTHER


@pytest.mark.parametrize(
    ("code", "text", "refusal", "queue"),
    [
        (404, HOME_NODE_DOWN_3_10, UNREACHABLE, QUEUE),
        (404, STOPPED_4_3, UNREACHABLE, QUEUE),
        (404, NEW_WORDING, UNREACHABLE, QUEUE),
        (404, MISSING, MISSING_, None),
        (404, "NOT_FOUND - no exchange 'keyq.x' in vhost '/'", OTHER, None),
        (406, f"PRECONDITION_FAILED - queue '{QUEUE}' in vhost '/' not empty", OTHER, None),
        (403, f"ACCESS_REFUSED - queue '{QUEUE}' in vhost '/' in exclusive use", OTHER, None),
    ],
)
def test_a_refusal_reads_as_missing_unreachable_or_other(
    code: int, text: str, refusal: QueueRefusal, queue: str | None
) -> None:
    assert classify(code, text) is refusal
    assert unreachable_queue(code, text) == queue


@pytest.mark.broker_versions
def test_the_brokers_own_answer_for_a_missing_queue_reads_as_missing(
    amqp: pika.BlockingConnection,
) -> None:
    channel = amqp.channel()
    name = f"keyq.refusals.{uuid.uuid4().hex}"
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
        channel.queue_declare(name, passive=True)
    assert classify(refused.value.reply_code, refused.value.reply_text) is QueueRefusal.MISSING
