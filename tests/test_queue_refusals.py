"""A 404 about a queue means "missing" or "there but unreachable", by meaning, on every release.

The unreachable texts are the ones RabbitMQ 3.10 and 4.3 send for a classic queue whose node
is stopped (seen on the clusters of tests/test_cluster.py, which check the behaviour end to
end); the missing text is asked of the real broker here.
"""

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


@pytest.mark.parametrize("text", [HOME_NODE_DOWN_3_10, STOPPED_4_3])
def test_a_queue_whose_node_is_down_is_unreachable_on_each_release(text: str) -> None:
    assert classify(404, text) is QueueRefusal.UNREACHABLE
    assert unreachable_queue(404, text) == QUEUE


def test_a_queue_that_does_not_exist_is_missing() -> None:
    assert classify(404, MISSING) is QueueRefusal.MISSING
    assert unreachable_queue(404, MISSING) is None


def test_a_404_that_names_a_queue_in_words_not_known_yet_is_unreachable() -> None:
    """A later release's wording: waiting for the queue is the safe reading."""
    text = f"NOT_FOUND - queue '{QUEUE}' in vhost 'prod' has no running replica"
    assert classify(404, text) is QueueRefusal.UNREACHABLE
    assert unreachable_queue(404, text) == QUEUE


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (404, "NOT_FOUND - no exchange 'keyq.x' in vhost '/'"),
        (406, f"PRECONDITION_FAILED - queue '{QUEUE}' in vhost '/' not empty"),
        (403, f"ACCESS_REFUSED - queue '{QUEUE}' in vhost '/' in exclusive use"),
    ],
)
def test_other_refusals_are_not_about_reachability(code: int, text: str) -> None:
    assert classify(code, text) is QueueRefusal.OTHER
    assert unreachable_queue(code, text) is None


@pytest.mark.broker_versions
def test_the_brokers_own_answer_for_a_missing_queue_reads_as_missing(
    amqp: pika.BlockingConnection,
) -> None:
    channel = amqp.channel()
    name = f"keyq.refusals.{uuid.uuid4().hex}"
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
        channel.queue_declare(name, passive=True)
    assert classify(refused.value.reply_code, refused.value.reply_text) is QueueRefusal.MISSING
