"""Opening many exclusive consumers with the round trips of one.

A consumer costs three round trips: open a channel, set its prefetch, consume. pika's
``BlockingConnection`` waits for each reply before sending the next request, so a claim
round of N queues waits 3N times for the broker, and a broker busy delivering answers each
in milliseconds: under load a worker claimed only about a hundred queues a second.

The broker needs no such wait: requests on different channels are independent, and pika's
channel queues a second request until the first is answered. So this module sends every
channel open, then every prefetch and consume, and waits for the replies together: a round
costs about three round trips, whatever its size. Each queue keeps a channel of its own, so a
refused consume (403, 404) still closes only that queue's channel.

pika has no public way to do this on a blocking connection. The channels built here are the
same ``BlockingChannel`` objects ``BlockingConnection.channel()`` builds, and their consumers
are registered as ``BlockingChannel.basic_consume`` registers them, so deliveries, acks,
cancels and closes work on them as on any other. ``tests/test_consume_rounds.py`` pins the
pika internals used here.

What became of each consume (``ConsumeOutcome``) and how many go to the broker in one burst
are read here too, as pure functions.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
from pika.adapters import blocking_connection
from pika.adapters.blocking_connection import BlockingChannel

from keyq.broker.queue_refusals import QueueRefusal, classify

OnMessage = Callable[[BlockingChannel, Any, pika.BasicProperties, bytes], None]


@dataclass(frozen=True)
class ConsumeRequest:
    queue: str
    prefetch: int
    on_message: OnMessage


@dataclass(frozen=True)
class ConsumeReply:
    """A consuming channel, or the broker's reason for closing it instead (None if it was
    closed some other way)."""

    channel: BlockingChannel | None
    refusal: pika.exceptions.ChannelClosedByBroker | None = None


def open_consumers(
    connection: pika.BlockingConnection, requests: Sequence[ConsumeRequest]
) -> list[ConsumeReply]:
    """Consume each request's queue exclusively on a new channel of its own, pipelined.

    Must run on the thread that owns ``connection``. Raises pika's connection errors if the
    connection fails meanwhile (no channel of this round is then usable).
    """
    if not requests:
        return []
    blocking: Any = connection
    channels: list[BlockingChannel] = []
    try:
        for _request in requests:
            channels.append(_open_channel(blocking))
        blocking._flush_output(lambda: all(_opened(channel) for channel in channels))
    except pika.exceptions.NoFreeChannels:
        # None of the round is used: let the channels finish opening, then give them back.
        blocking._flush_output(lambda: all(_opened(channel) for channel in channels))
        for channel in channels:
            with contextlib.suppress(pika.exceptions.AMQPError):
                channel.close()
        raise

    for channel, request in zip(channels, requests, strict=True):
        if channel.is_open:
            _send_consume(channel, request)
    blocking._flush_output(lambda: all(_consume_answered(channel) for channel in channels))

    replies: list[ConsumeReply] = []
    for channel in channels:
        inner: Any = channel
        if channel.is_open:
            inner._basic_consume_ok_result.reset()  # ready for nothing else: one per channel
            for info in inner._consumer_infos.values():
                if info.setting_up:  # not if the broker already cancelled it
                    info.state = blocking_connection._ConsumerInfo.ACTIVE
            replies.append(ConsumeReply(channel))
            continue
        # Closed by the broker (a refusal, with its reason), or otherwise (no reason): only
        # this queue failed; the channels of the round that are consuming are reported, so
        # the caller records them instead of leaving their consumers unknown.
        reason = inner._closing_reason
        refusal = reason if isinstance(reason, pika.exceptions.ChannelClosedByBroker) else None
        replies.append(ConsumeReply(None, refusal))
    return replies


def _open_channel(connection: Any) -> BlockingChannel:
    """As ``BlockingConnection.channel()`` does, without waiting for channel.open-ok."""
    impl_channel = connection._impl.channel(on_open_callback=lambda _channel: None)
    channel = BlockingChannel(impl_channel, connection)
    impl_channel._set_cookie(channel)
    return channel


def _opened(channel: BlockingChannel) -> bool:
    return bool(channel.is_open or channel.is_closed)


def _send_consume(channel: BlockingChannel, request: ConsumeRequest) -> None:
    """basic.qos then basic.consume, sent without waiting: pika's channel holds the consume
    until the qos is answered. The consumer is registered first, as
    ``BlockingChannel.basic_consume`` does, so a delivery right after consume-ok finds it."""
    inner: Any = channel
    impl = inner._impl
    tag = impl._generate_consumer_tag()
    inner._consumer_infos[tag] = blocking_connection._ConsumerInfo(
        tag, auto_ack=False, on_message_callback=request.on_message
    )
    impl.basic_qos(prefetch_count=request.prefetch, callback=lambda _frame: None)
    impl.basic_consume(
        request.queue,
        on_message_callback=inner._on_consumer_message_delivery,
        exclusive=True,
        consumer_tag=tag,
    )


def _consume_answered(channel: BlockingChannel) -> bool:
    inner: Any = channel
    return bool(channel.is_closed or inner._basic_consume_ok_result.is_ready())


# ---- what became of a claim's consume, and how many go to the broker at once (pure) ----
# Consumers opened per pipelined burst: a claim round's budget is checked between bursts. The
# first burst is small; the next ones are sized from the time a claim took in the last, so a
# broker slow to answer does not make one burst outlast the budget (and the locks held).
PIPELINE_DEPTH = 25
FIRST_BURST = 8


class ConsumeOutcome(enum.Enum):
    CONSUMING = "consuming"
    BUSY = "busy"  # another consumer holds it exclusively
    MISSING = "missing"  # the queue does not exist (deleted by the janitor)
    UNREACHABLE = "unreachable"  # its node is down (a classic queue on a cluster)
    FAILED = "failed"  # the channel or the connection failed while consuming
    NOT_TRIED = "not tried"  # the claim round's time ran out first


@dataclass(frozen=True)
class Consumed:
    outcome: ConsumeOutcome
    epoch: int = 0


def refused(refusal: pika.exceptions.ChannelClosedByBroker | None) -> ConsumeOutcome:
    """The outcome of a consume whose channel closed instead (``refusal`` is the broker's
    reason, None if it closed some other way): 403 is an exclusive consumer elsewhere, 404 a
    queue deleted or one whose node is down; anything else failed."""
    if refusal is not None and refusal.reply_code == 403:
        return ConsumeOutcome.BUSY
    if refusal is not None and refusal.reply_code == 404:
        if classify(404, str(refusal.reply_text)) is QueueRefusal.MISSING:
            return ConsumeOutcome.MISSING
        return ConsumeOutcome.UNREACHABLE
    return ConsumeOutcome.FAILED


def first_burst(budgeted: bool) -> int:
    """Claims in a round's first burst: small when the round has a time budget to keep."""
    return FIRST_BURST if budgeted else PIPELINE_DEPTH


def next_burst(elapsed_s: float, claims: int, time_left_s: float) -> int:
    """Claims in the next burst of a budgeted round, when the last burst of ``claims`` took
    ``elapsed_s``: as many as fit in the time left at that pace, at least one, at most
    ``PIPELINE_DEPTH``."""
    per_claim = max(elapsed_s / claims, 1e-4)
    return max(1, min(PIPELINE_DEPTH, int(time_left_s / per_claim)))
