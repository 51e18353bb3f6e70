"""The copy a dead letter is published as (pure logic; publishing it is covered by
tests/test_worker_poison.py)."""

from __future__ import annotations

import time

import pika

from keyq.broker.envelope import (
    HEADER_ATTEMPTS,
    HEADER_DEAD_AT,
    HEADER_DEAD_QUEUE,
    HEADER_DEAD_REASON,
)
from keyq.worker.amqp.dead_letters import MAX_REASON_CHARS, DeadLetter, dead_letter_properties
from keyq.worker.amqp.deliveries import Delivery


def delivery(headers: dict[str, object]) -> Delivery:
    return Delivery(
        queue="keyq.s.k.abc",
        channel_epoch=3,
        delivery_tag=7,
        redelivered=False,
        headers=dict(headers),
        content_type="application/json",
        message_id="m-1",
        body=b"{}",
    )


def test_the_copy_keeps_the_message_and_says_why_from_where_after_how_many_attempts() -> None:
    original = delivery({"x-keyq-seq": 4})
    properties = dead_letter_properties(DeadLetter(original, "bad json", attempts=3))
    assert properties.delivery_mode == pika.DeliveryMode.Persistent.value
    assert properties.content_type == "application/json"
    assert properties.message_id == "m-1"
    assert properties.headers is not None
    dead_at = properties.headers.pop(HEADER_DEAD_AT)
    assert abs(dead_at - time.time() * 1000) < 60_000  # when, in ms since the epoch
    assert properties.headers == {
        "x-keyq-seq": 4,
        HEADER_DEAD_REASON: "bad json",
        HEADER_DEAD_QUEUE: "keyq.s.k.abc",
        HEADER_ATTEMPTS: 3,
    }
    assert original.headers == {"x-keyq-seq": 4}  # the delivery itself is left as it was
    long = dead_letter_properties(DeadLetter(delivery({}), "x" * 5000, attempts=1))
    assert long.headers is not None
    assert long.headers[HEADER_DEAD_REASON] == "x" * MAX_REASON_CHARS, "a long reason is cut"
