"""A claim round on the real broker: many consumers opened in one call to the I/O thread,
pipelined, each with its own outcome, and a round that runs out of time leaves the rest
untried."""

from __future__ import annotations

from collections.abc import Iterator

import pika
import pytest

from keyq.broker.naming import key_queue_name
from keyq.broker.settings import Settings
from keyq.worker.amqp.consume_rounds import FIRST_BURST, ConsumeOutcome
from keyq.worker.amqp.link import ConsumerLink
from tests.conftest import StreamFixture
from tests.workers import bare_link, wait_until

QUEUES = 30


@pytest.fixture
def link(settings: Settings, stream: StreamFixture) -> Iterator[ConsumerLink]:
    started = bare_link(settings, stream.name, "test-claim-rounds", prefetch=10)
    started.start()
    yield started
    started.stop()


def declare(amqp: pika.BlockingConnection, stream: StreamFixture, count: int) -> list[str]:
    names = [key_queue_name(stream.name, f"round-{n}") for n in range(count)]
    stream.track(*names)
    channel = amqp.channel()
    for name in names:
        channel.queue_declare(name, durable=True)
        channel.basic_publish("", name, b"{}")
    channel.close()
    return names


def test_one_round_opens_many_consumers_and_reports_each_outcome(
    link: ConsumerLink, amqp: pika.BlockingConnection, stream: StreamFixture
) -> None:
    names = declare(amqp, stream, QUEUES)
    busy = names[3]
    rival = amqp.channel()
    rival.basic_consume(busy, lambda *_args: None, exclusive=True)
    missing = key_queue_name(stream.name, "never-declared")
    claims = [(name, link.consumers.new_epoch()) for name in [*names, missing]]

    results = link.consumers.consume_many(claims)

    outcomes = {queue: result.outcome for (queue, _), result in zip(claims, results, strict=True)}
    assert outcomes.pop(busy) is ConsumeOutcome.BUSY
    assert outcomes.pop(missing) is ConsumeOutcome.MISSING
    assert set(outcomes.values()) == {ConsumeOutcome.CONSUMING}
    held = link.consumers.held()
    assert set(held) == set(outcomes)
    assert all(held[queue] == epoch for queue, epoch in claims if queue in held)
    # Every consumer is real: the broker delivers each queue's message to this link.
    wait_until(lambda: link.counts.message_count(names[0]) == 0, 10, "a queue drained to the link")
    for name in outcomes:
        assert amqp.channel().queue_declare(name, passive=True).method.consumer_count == 1
    rival.close()


def test_a_round_out_of_time_tries_the_first_burst_and_leaves_the_rest(
    link: ConsumerLink, amqp: pika.BlockingConnection, stream: StreamFixture
) -> None:
    names = declare(amqp, stream, FIRST_BURST + 5)
    claims = [(name, link.consumers.new_epoch()) for name in names]

    results = link.consumers.consume_many(claims, budget_s=0.0)

    assert [result.outcome for result in results] == [
        *[ConsumeOutcome.CONSUMING] * FIRST_BURST,
        *[ConsumeOutcome.NOT_TRIED] * 5,
    ]
    assert set(link.consumers.held()) == set(names[:FIRST_BURST])
    for name in names[FIRST_BURST:]:
        assert amqp.channel().queue_declare(name, passive=True).method.consumer_count == 0
