"""Pipelined consumers (``keyq.worker.amqp.consume_rounds``) on the real broker: their channels
behave as pika's own, which pins the pika internals they rely on. Also (pure logic) what a
refused consume means, and how large a claim round's bursts are."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pika
import pika.exceptions
import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyq.broker.naming import key_queue_name
from keyq.broker.settings import Settings
from keyq.worker.amqp.acks import buffer_ack, flush_acks
from keyq.worker.amqp.channel_close import close_keeping_consumers
from keyq.worker.amqp.consume_rounds import (
    FIRST_BURST,
    PIPELINE_DEPTH,
    ConsumeOutcome,
    ConsumeRequest,
    first_burst,
    next_burst,
    open_consumers,
    refused,
)
from tests.conftest import StreamFixture
from tests.helpers import queue_depth


@pytest.fixture
def connection(settings: Settings) -> Iterator[pika.BlockingConnection]:
    opened = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    try:
        yield opened
    finally:
        if opened.is_open:
            opened.close()


def queues(amqp: pika.BlockingConnection, stream: StreamFixture, count: int) -> list[str]:
    names = [key_queue_name(stream.name, f"pipelined-{n}") for n in range(count)]
    stream.track(*names)
    channel = amqp.channel()
    for name in names:
        channel.queue_declare(name, durable=True)
        for n in range(3):
            channel.basic_publish("", name, f"{name}:{n}".encode())
    channel.close()
    return names


Received = dict[str, list[tuple[int, bytes]]]


def receiver(received: Received, queue: str) -> Any:
    """A consumer callback noting (delivery tag, body) of each delivery from ``queue``."""

    def on_message(_channel: Any, method: Any, _properties: Any, body: bytes) -> None:
        received[queue].append((method.delivery_tag, body))

    return on_message


def pump(connection: pika.BlockingConnection, until: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out pumping the connection"
        connection.process_data_events(time_limit=0.05)


def test_pipelined_consumers_deliver_ack_refuse_and_close_like_pikas_own(
    connection: pika.BlockingConnection, amqp: pika.BlockingConnection, stream: StreamFixture
) -> None:
    names = queues(amqp, stream, 40)
    rival = amqp.channel()
    rival.basic_consume(names[0], lambda *_args: None, exclusive=True)
    missing = key_queue_name(stream.name, "pipelined-never-declared")
    received: Received = {name: [] for name in [*names, missing]}
    requests = [ConsumeRequest(name, 2, receiver(received, name)) for name in [*names, missing]]
    replies = open_consumers(connection, requests)

    # The refusals close only their own channels, and say why.
    assert replies[0].channel is None and replies[0].refusal is not None
    assert replies[0].refusal.reply_code == 403
    assert replies[-1].channel is None and replies[-1].refusal is not None
    assert replies[-1].refusal.reply_code == 404
    consuming = {name: reply.channel for name, reply in zip(names, replies, strict=False)}
    del consuming[names[0]]
    assert all(channel is not None and channel.is_open for channel in consuming.values())

    # Deliveries reach each consumer's callback, within its prefetch of 2.
    pump(connection, lambda: all(len(received[name]) == 2 for name in consuming))
    assert received[names[0]] == []
    for name in consuming:
        assert [body for _tag, body in received[name]] == [
            f"{name}:0".encode(),
            f"{name}:1".encode(),
        ]

    # Acks settle on the consumer's channel: the third message follows.
    first = names[1]
    channel = consuming[first]
    assert channel is not None
    channel.basic_ack(received[first][1][0], multiple=True)
    pump(connection, lambda: len(received[first]) == 3)
    assert queue_depth(amqp, first) == 0

    # Closed keeping its consumers, a channel hands its unacked messages back, in order.
    second = names[2]
    closing = consuming[second]
    assert closing is not None
    close_keeping_consumers(closing)
    assert closing.is_closed
    check = amqp.channel()
    assert check.queue_declare(second, passive=True).method.message_count == 3
    assert check.queue_declare(second, passive=True).method.consumer_count == 0
    got = [check.basic_get(second, auto_ack=True)[2] for _ in range(3)]
    assert got == [f"{second}:{n}".encode() for n in range(3)]

    # A queue deleted under its consumer cancels it, through the channel's cancel callback.
    third = names[3]
    cancelled: list[str] = []
    doomed = consuming[third]
    assert doomed is not None
    doomed.add_on_cancel_callback(lambda _frame: cancelled.append(third))
    amqp.channel().queue_delete(third)
    pump(connection, lambda: cancelled == [third])
    rival.close()


def test_acks_buffered_on_many_channels_all_reach_the_broker_with_one_flush(
    connection: pika.BlockingConnection, amqp: pika.BlockingConnection, stream: StreamFixture
) -> None:
    names = queues(amqp, stream, 30)
    received: Received = {name: [] for name in names}
    replies = open_consumers(
        connection, [ConsumeRequest(n, 2, receiver(received, n)) for n in names]
    )
    channels = [reply.channel for reply in replies]
    pump(connection, lambda: all(len(tags) == 2 for tags in received.values()))
    # Tag 1 with multiple on half of them, both tags one by one on the others: nothing is
    # sent until the flush.
    for index, (name, channel) in enumerate(zip(names, channels, strict=True)):
        assert channel is not None
        if index % 2:
            buffer_ack(channel, received[name][0][0], multiple=True)
        else:
            for tag, _body in received[name]:
                buffer_ack(channel, tag, multiple=False)
    flush_acks(connection)
    # Each consumer's third message follows only once its acks made room in its prefetch.
    pump(connection, lambda: all(len(tags) >= 3 for tags in received.values()))
    for name in names:
        assert queue_depth(amqp, name) == 0, name
        assert len(received[name]) == 3, name  # the third came once the acks made room
    for channel in channels:
        assert channel is not None
        close_keeping_consumers(channel)
    # What was not acked went back: odd queues acked 1 of 3, even ones 2 of 3.
    for index, name in enumerate(names):
        assert queue_depth(amqp, name) == (2 if index % 2 else 1), name


def test_a_round_beyond_the_connections_channels_fails_and_leaves_no_channel_open(
    settings: Settings, amqp: pika.BlockingConnection, stream: StreamFixture
) -> None:
    names = queues(amqp, stream, 6)
    url = settings.amqp_url
    limited = pika.URLParameters(url + ("&" if "?" in url else "?") + "channel_max=3")
    connection = pika.BlockingConnection(limited)
    try:
        requests = [ConsumeRequest(name, 1, lambda *_args: None) for name in names]
        with pytest.raises(pika.exceptions.NoFreeChannels):
            open_consumers(connection, requests)
        assert connection.is_open
        opened: Any = connection
        assert not [number for number in opened._impl._channels if number]
        for name in names:  # no consumer was left behind on any queue
            assert amqp.channel().queue_declare(name, passive=True).method.consumer_count == 0
    finally:
        if connection.is_open:
            connection.close()


LOCKED = "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue 'q' in vhost '/'"
DOWN_310 = (
    "NOT_FOUND - home node 'rabbit@b' of durable queue 'q' in vhost '/' is down or inaccessible"
)
DOWN_43 = "NOT_FOUND - queue 'q' in vhost '/' process is stopped by supervisor"


@pytest.mark.parametrize(
    ("code", "text", "outcome"),
    [
        (403, LOCKED, ConsumeOutcome.BUSY),
        (404, "NOT_FOUND - no queue 'q' in vhost '/'", ConsumeOutcome.MISSING),
        (404, DOWN_310, ConsumeOutcome.UNREACHABLE),  # a node down, in RabbitMQ 3.10's words
        (404, DOWN_43, ConsumeOutcome.UNREACHABLE),  # and in 4.3's
        # Waiting for a queue that turns out missing costs a retry; forgetting one strands it.
        (404, "NOT_FOUND - something else", ConsumeOutcome.UNREACHABLE),
        (406, "PRECONDITION_FAILED - unknown delivery tag 1", ConsumeOutcome.FAILED),
        (None, None, ConsumeOutcome.FAILED),
    ],
)
def test_what_a_refused_consume_means(code: int | None, text: str, outcome: ConsumeOutcome) -> None:
    close = None if code is None else pika.exceptions.ChannelClosedByBroker(code, text)
    assert refused(close) is outcome


def test_a_budgeted_round_starts_small_and_a_burst_fits_the_time_left_at_the_last_pace() -> None:
    assert first_burst(budgeted=True) == FIRST_BURST < PIPELINE_DEPTH
    assert first_burst(budgeted=False) == PIPELINE_DEPTH
    # 8 claims took 80 ms: 10 ms a claim, 50 ms left -> 5 claims.
    assert next_burst(0.080, 8, 0.050) == 5
    # A fast broker is capped at the pipeline depth.
    assert next_burst(0.001, 8, 10.0) == PIPELINE_DEPTH
    # Out of time (or past it): still one, the caller checks the deadline before sending.
    assert next_burst(0.080, 8, 0.0) == 1
    assert next_burst(0.080, 8, -1.0) == 1
    # A burst measured as taking no time at all does not divide by zero.
    assert next_burst(0.0, 8, 0.001) == 10


@given(
    elapsed=st.floats(min_value=0, max_value=60),
    claims=st.integers(min_value=1, max_value=PIPELINE_DEPTH),
    left=st.floats(min_value=-60, max_value=60),
)
def test_a_burst_is_never_empty_nor_deeper_than_the_pipeline(
    elapsed: float, claims: int, left: float
) -> None:
    assert 1 <= next_burst(elapsed, claims, left) <= PIPELINE_DEPTH
