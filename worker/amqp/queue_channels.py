"""The queues a worker's connection consumes: a channel each, opened in pipelined rounds.

Runs on the connection's I/O thread only (``keyq.worker.amqp.io_thread``). Each held queue gets
its own channel: an exclusive consume that the broker refuses (403) closes only that channel,
and closing a queue's channel hands its unacked messages back, in order.

A message that is a pack of several events (``keyq.broker.packs``) is unpacked here, as it
arrives: each event becomes a delivery of its own, in order, and the message is acked once
every one of them is settled (``keyq.worker.amqp.ack_ledger``). A message labelled as a pack that
cannot be read stays one delivery, marked malformed, and is dead-lettered whole.
"""

from __future__ import annotations

import contextlib
import logging
import queue as queue_module
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from keyq.broker.connections import describe_exception
from keyq.broker.packs import HEADER_PACK, MalformedPack, PackedEvent, decode_pack, is_pack
from keyq.worker.amqp.ack_ledger import AckLedger
from keyq.worker.amqp.acks import buffer_ack, flush_acks
from keyq.worker.amqp.channel_close import close_all_keeping_consumers, close_keeping_consumers
from keyq.worker.amqp.consume_rounds import (
    Consumed,
    ConsumeOutcome,
    ConsumeReply,
    ConsumeRequest,
    OnMessage,
    first_burst,
    next_burst,
    open_consumers,
    refused,
)
from keyq.worker.amqp.deliveries import Delivery, DeliveryBuffer
from keyq.worker.batch.ports import Acks

log = logging.getLogger("keyq.worker.amqp")


@dataclass(frozen=True)
class ConsumerGone:
    """The broker took consumer ``epoch`` of ``queue`` away (cancelled it, closed its channel
    or the connection), and why."""

    queue: str
    epoch: int
    why: str


class QueueConsumers:
    """Each consumed queue's channel and consumer epoch, and its delivery tags not yet
    acked. A consumer the broker cancelled or whose channel it closed is put on ``gone``:
    the I/O thread never waits on whoever ends its holding."""

    def __init__(
        self,
        *,
        connection: Callable[[], pika.BlockingConnection | None],
        buffer: DeliveryBuffer,
        gone: queue_module.SimpleQueue[ConsumerGone],
    ) -> None:
        self._connection = connection
        self._buffer = buffer
        self._gone = gone
        self._channels: dict[str, tuple[int, BlockingChannel]] = {}
        # Per consumer (queue, epoch): its delivery tags not yet acked.
        self._unacked: dict[tuple[str, int], AckLedger] = {}

    def held(self) -> dict[str, int]:
        """Queues with a live consumer, and their epochs."""
        return {q: e for q, (e, _c) in self._channels.items()}

    def unacked_of(self, queue: str) -> int | None:
        """Messages ``queue``'s live consumer was sent and has not acked; None if it is not
        consumed here."""
        held = self._channels.get(queue)
        if held is None:
            return None
        ledger = self._unacked.get((queue, held[0]))
        return len(ledger) if ledger is not None else 0

    def consume_all(
        self, claims: Sequence[tuple[str, int]], prefetch: int, until: float | None
    ) -> list[Consumed]:
        """Every claim's outcome, each consumer opened with an AMQP prefetch of ``prefetch``
        messages (``ConsumerLink`` sizes it from the events a queue may hold unacked: a
        message may be a pack of several). One that fails does not hide the others' (a
        queue already consuming must be known as held, or its lock would be let go under
        it). Claims go to the broker pipelined, in bursts of at most ``PIPELINE_DEPTH``, each
        sized to fit the time left; the first burst is always tried, so that a slow I/O
        thread still makes progress."""
        results: dict[int, Consumed] = {}
        todo: dict[str, int] = {}  # queue -> index of its first claim in this round
        for index, (queue, _epoch) in enumerate(claims):
            if queue not in self._channels:
                todo.setdefault(queue, index)
        indexes = list(todo.values())
        start, size = 0, first_burst(until is not None)
        while start < len(indexes):
            if start and until is not None and time.monotonic() >= until:
                results.update(
                    (index, Consumed(ConsumeOutcome.NOT_TRIED)) for index in indexes[start:]
                )
                break
            batch = indexes[start : start + size]
            began = time.monotonic()
            outcomes = self._consume_pipelined([claims[index] for index in batch], prefetch)
            results.update(zip(batch, outcomes, strict=True))
            start += len(batch)
            if until is not None:
                now = time.monotonic()
                size = next_burst(now - began, len(batch), until - now)
        for index, (queue, _epoch) in enumerate(claims):
            held = self._channels.get(queue)
            if index not in results and held is not None:  # held already, or claimed twice
                results[index] = Consumed(ConsumeOutcome.CONSUMING, held[0])
        return [results.get(index, Consumed(ConsumeOutcome.FAILED)) for index in range(len(claims))]

    def _consume_pipelined(
        self, claims: Sequence[tuple[str, int]], prefetch: int
    ) -> list[Consumed]:
        connection = self._connection()
        if connection is None or not connection.is_open:
            return [Consumed(ConsumeOutcome.FAILED)] * len(claims)
        ledgers = [AckLedger() for _ in claims]
        requests = [
            ConsumeRequest(queue, prefetch, self._receiver(queue, epoch, ledger))
            for (queue, epoch), ledger in zip(claims, ledgers, strict=True)
        ]
        try:
            replies = open_consumers(connection, requests)
        except (pika.exceptions.AMQPError, OSError) as exc:
            # A connection failure takes this round's channels with it: nothing to record.
            log.warning("consuming %d queue(s) failed: %s", len(claims), describe_exception(exc))
            return [Consumed(ConsumeOutcome.FAILED)] * len(claims)
        return [
            self._consumed(queue, epoch, ledger, reply)
            for (queue, epoch), ledger, reply in zip(claims, ledgers, replies, strict=True)
        ]

    def _receiver(self, queue: str, epoch: int, ledger: AckLedger) -> OnMessage:
        buffer = self._buffer

        def on_message(
            _channel: BlockingChannel,
            method: Any,
            properties: pika.BasicProperties,
            body: bytes,
        ) -> None:
            deliveries = unpack(queue, epoch, method, properties, body)
            ledger.delivered(method.delivery_tag, len(deliveries))
            buffer.add_all(deliveries)

        return on_message

    def _consumed(self, queue: str, epoch: int, ledger: AckLedger, reply: ConsumeReply) -> Consumed:
        channel = reply.channel
        if channel is None:
            refusal = reply.refusal
            outcome = refused(refusal)
            if outcome is ConsumeOutcome.FAILED:
                why = describe_exception(refusal) if refusal is not None else "channel closed"
                log.warning("consuming %s failed: %s", queue, why)
            return Consumed(outcome)
        channel.add_on_cancel_callback(lambda _frame: self._cancelled(queue, epoch))
        if log.isEnabledFor(logging.DEBUG):
            # The tag is what the broker lists (``rabbitmqctl list_consumers``): it names the
            # worker behind a consumer seen on a queue.
            tags: Any = channel
            log.debug(
                "consuming %s as epoch %d on channel %d, consumer %s",
                queue,
                epoch,
                channel.channel_number,
                ",".join(tags._consumer_infos),
            )
        self._channels[queue] = (epoch, channel)
        self._unacked[(queue, epoch)] = ledger
        return Consumed(ConsumeOutcome.CONSUMING, epoch)

    def _cancelled(self, queue: str, epoch: int) -> None:
        held = self._channels.get(queue)
        if held is not None and held[0] == epoch:
            del self._channels[queue]
            self._unacked.pop((queue, epoch), None)
            with contextlib.suppress(Exception):  # already closing
                close_keeping_consumers(held[1])
            self._gone.put(ConsumerGone(queue, epoch, "the broker cancelled the consumer"))

    def check(self) -> None:
        """Put on ``gone`` the consumers whose channel the broker closed since the last check."""
        for queue, (epoch, channel) in list(self._channels.items()):
            if channel.is_closed:
                del self._channels[queue]
                self._unacked.pop((queue, epoch), None)
                self._gone.put(ConsumerGone(queue, epoch, "channel closed by the broker"))

    def close(self, queues: Sequence[tuple[str, int | None]]) -> None:
        """Stop consuming each (queue, epoch) of ``queues`` (only consumer ``epoch``, if not
        None), their channels closed together (``close_all_keeping_consumers``)."""
        channels: list[BlockingChannel] = []
        for queue, epoch in queues:
            held = self._channels.get(queue)
            if held is None or (epoch is not None and held[0] != epoch):
                continue
            del self._channels[queue]
            self._unacked.pop((queue, held[0]), None)
            channels.append(held[1])
            log.debug("closing the consumer of %s (epoch %d)", queue, held[0])
        # Never cancel first: the queue would look unused while it still holds our unacked
        # deliveries, and a janitor's delete(if_empty, if_unused) would take them with it.
        try:
            close_all_keeping_consumers(channels)
        except pika.exceptions.AMQPError as exc:
            log.warning("closing %d consumer(s) failed: %s", len(channels), describe_exception(exc))

    def ack(self, acks: Acks) -> int:
        """Settle (queue, epoch, events), each event a (tag, part): the messages now settled
        whole are acked, with one ``ack(multiple)`` for the oldest run; the tags past a
        delivery still waiting (for an earlier seq, or a pack with an event still waiting),
        or past a tag that never reached us (``keyq.worker.amqp.ack_ledger``), one by one."""
        done = 0
        for queue, epoch, events in acks:
            held = self._channels.get(queue)
            if held is None or held[0] != epoch or not held[1].is_open:
                self._unacked.pop((queue, epoch), None)
                continue  # that consumer is gone: the broker has requeued these already
            ledger = self._unacked.get((queue, epoch))
            if ledger is None:
                continue
            upto, singles = ledger.settle(events)
            if upto:
                buffer_ack(held[1], upto, multiple=True)
            for tag in singles:
                buffer_ack(held[1], tag, multiple=False)
            done += 1
        connection = self._connection()
        if done and connection is not None:
            flush_acks(connection)  # one write for the whole batch (keyq.worker.amqp.acks)
        return done

    def drop(self, connection: pika.BlockingConnection | None) -> list[tuple[str, int]]:
        """Forget every consumer (their connection is going) and return them as (queue,
        epoch). On a connection still open, each channel is closed as in ``close``: never
        cancelled first."""
        lost = list(self._channels.items())
        self._channels.clear()
        self._unacked.clear()
        if connection is not None:
            with contextlib.suppress(Exception):
                close_all_keeping_consumers([channel for _queue, (_epoch, channel) in lost])
        return [(queue, epoch) for queue, (epoch, _channel) in lost]


def unpack(
    queue: str, epoch: int, method: Any, properties: pika.BasicProperties, body: bytes
) -> list[Delivery]:
    """The deliveries a message makes: itself, or the events of a pack, in order. A pack that
    cannot be read is the whole message, marked ``malformed`` with why."""
    malformed: str | None = None
    events = [
        PackedEvent(
            properties.message_id, properties.content_type, dict(properties.headers or {}), body
        )
    ]
    if is_pack(properties.content_type):
        try:
            events = decode_pack(body, (properties.headers or {}).get(HEADER_PACK))
        except MalformedPack as exc:
            log.warning("a malformed pack on %s (it is dead-lettered): %s", queue, exc)
            malformed = str(exc)  # the whole message, as it came
    return [
        Delivery(
            queue=queue,
            channel_epoch=epoch,
            delivery_tag=method.delivery_tag,
            redelivered=bool(method.redelivered),
            headers=event.headers,
            content_type=event.content_type,
            message_id=event.message_id,
            body=event.body,
            part=part,
            parts=len(events),
            malformed=malformed,
        )
        for part, event in enumerate(events)
    ]
