"""Moving messages to a stream's dead-letter queue (copies with the reason), and a paused or
parked key's events to the queue they wait in aside: confirmed copies either way.

``DeadLetterPublisher`` runs on the connection's I/O thread (``keyq.worker.amqp.io_thread``), on
a confirming channel of its own opened with each connection; ``DeadLetterCalls`` is how the
batch loop reaches it (the batch's ``DeadLetterSink``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from keyq.broker.clock import now_ms
from keyq.broker.confirm_window import ConfirmWindow
from keyq.broker.connections import describe_exception
from keyq.broker.envelope import (
    HEADER_ATTEMPTS,
    HEADER_DEAD_AT,
    HEADER_DEAD_QUEUE,
    HEADER_DEAD_REASON,
    HEADER_KEY,
    HEADER_PUBLISHED_AT,
    HEADER_STREAM,
)
from keyq.broker.errors import BrokerUnavailable
from keyq.broker.naming import dead_letter_queue_name
from keyq.broker.packs import HEADER_PACK, PACK_CONTENT_TYPE, encode_pack, encode_record
from keyq.broker.topology import dead_letter_queue_arguments, keyed_queue_arguments
from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.amqp.io_thread import AmqpThread

log = logging.getLogger("keyq.worker.amqp")

MAX_REASON_CHARS = 1000


@dataclass(frozen=True)
class DeadLetter:
    """A message to move to the stream's dead-letter queue, and why."""

    delivery: Delivery
    reason: str
    attempts: int


def dead_letter_properties(letter: DeadLetter) -> pika.BasicProperties:
    """The copy's properties: persistent, the original headers plus why, from which queue,
    after how many attempts (the reason cut to ``MAX_REASON_CHARS``)."""
    delivery = letter.delivery
    headers = dict(delivery.headers)
    headers[HEADER_DEAD_REASON] = letter.reason[:MAX_REASON_CHARS]
    headers[HEADER_DEAD_QUEUE] = delivery.queue
    headers[HEADER_ATTEMPTS] = letter.attempts
    headers[HEADER_DEAD_AT] = now_ms()
    return pika.BasicProperties(
        delivery_mode=pika.DeliveryMode.Persistent,
        headers=headers,
        content_type=delivery.content_type,
        message_id=delivery.message_id,
    )


def aside_properties(delivery: Delivery, key: str) -> pika.BasicProperties:
    """A set-aside copy's properties: persistent, the original headers, and the key (a
    key-mode event from another client carries it only in its queue's name)."""
    headers = dict(delivery.headers)
    headers[HEADER_KEY] = key
    return pika.BasicProperties(
        delivery_mode=pika.DeliveryMode.Persistent,
        headers=headers,
        content_type=delivery.content_type,
        message_id=delivery.message_id,
    )


def packed(
    deliveries: Sequence[Delivery], key: str, most: int, most_bytes: int
) -> list[tuple[bytes, pika.BasicProperties]]:
    """A promoted key's forwarded ``deliveries`` as messages: packs of up to ``most`` events
    and about ``most_bytes`` (``keyq.broker.packs``), in order, so its own queue's prefetch
    holds as many events as a bucket's and the second trip costs the broker what the first
    did; a pack of one is sent as the event itself."""
    messages: list[tuple[bytes, pika.BasicProperties]] = []
    run: list[tuple[Delivery, bytes]] = []
    size = 0

    def flush() -> None:
        if len(run) == 1:
            delivery = run[0][0]
            messages.append((delivery.body, aside_properties(delivery, key)))
        elif run:
            messages.append(pack_message([record for _, record in run], run[0][0], key))
        run.clear()

    for delivery in deliveries:
        properties = aside_properties(delivery, key)
        record = encode_record(
            properties.message_id, properties.content_type, properties.headers or {}, delivery.body
        )
        if run and (len(run) >= most or size + len(record) > most_bytes):
            flush()
            size = 0
        run.append((delivery, record))
        size += len(record)
    flush()
    return messages


def pack_message(
    records: list[bytes], first: Delivery, key: str
) -> tuple[bytes, pika.BasicProperties]:
    headers: dict[str, Any] = {HEADER_PACK: len(records), HEADER_KEY: key}
    for name in (HEADER_STREAM, HEADER_PUBLISHED_AT):
        if name in first.headers:
            headers[name] = first.headers[name]
    properties = pika.BasicProperties(
        delivery_mode=pika.DeliveryMode.Persistent,
        content_type=PACK_CONTENT_TYPE,
        message_id=f"forward:{first.message_id}",
        headers=headers,
    )
    return encode_pack(records), properties


class DeadLetterPublisher:
    """The dead-letter queue of one stream, declared on each connection, and the confirming
    channel that publishes to it and to the queues keys' events are set aside in."""

    def __init__(
        self,
        *,
        stream: str,
        queue_type: str,
        connection: Callable[[], pika.BlockingConnection | None],
        pack_limits: tuple[int, int] = (1, 0),
    ) -> None:
        self._stream = stream
        self._pack_limits = pack_limits  # most events and bytes of a forwarded pack
        self._queue_type = queue_type  # the stream's, for its dead-letter queue
        self._connection = connection
        self.queue = dead_letter_queue_name(stream)
        self._channel: BlockingChannel | None = None
        self._ready = False  # the dead-letter queue was declared on this connection

    def open(self) -> None:
        """On a new connection: open the confirming channel, declare the queue. Raises
        pika's errors if the connection fails meanwhile."""
        connection = self._connection()
        assert connection is not None
        channel = connection.channel()
        channel.confirm_delivery()
        self._ready = self._declare()
        self._channel = channel

    def close(self) -> None:
        """The connection is going: its channel with it."""
        self._channel = None

    def _declare(self) -> bool:
        """Declare the stream's dead-letter queue on a channel of its own. On a cluster, a
        classic dead-letter queue whose node is down answers 404: the worker serves on (keys
        on live nodes must not stop for it) and dead letters wait until it is back."""
        connection = self._connection()
        assert connection is not None
        channel = connection.channel()
        try:
            channel.queue_declare(
                self.queue, durable=True, arguments=dead_letter_queue_arguments(self._queue_type)
            )
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != 404:
                raise
            log.warning(
                "dead-letter queue %s is unavailable (%s); serving on, dead letters wait for it",
                self.queue,
                exc.reply_text,
            )
            return False
        with contextlib.suppress(pika.exceptions.AMQPError):
            channel.close()
        return True

    def publish(self, letters: Sequence[DeadLetter]) -> list[tuple[bytes, pika.BasicProperties]]:
        """Publish each letter's copy, confirmed (pika raises if one is not); declares the
        queue first if it was unavailable so far. Returns the copies, for the index."""
        channel = self._channel
        if channel is None:
            raise BrokerUnavailable("not connected to RabbitMQ")
        if not self._ready:
            self._ready = self._declare()
            if not self._ready:
                raise BrokerUnavailable(f"dead-letter queue {self.queue} is unavailable")
        copies = []
        for letter in letters:
            properties = dead_letter_properties(letter)
            channel.basic_publish("", self.queue, letter.delivery.body, properties, mandatory=True)
            copies.append((letter.delivery.body, properties))
        return copies

    def set_aside(self, queue: str, key: str, deliveries: Sequence[Delivery]) -> None:
        """Copy ``deliveries`` (all of ``key``), in order, to ``queue``, declared durable
        first, confirmed (pika raises if one is not, or if the queue is gone: mandatory)."""
        channel = self._channel
        if channel is None:
            raise BrokerUnavailable("not connected to RabbitMQ")
        # Declared as the stream's keyed queues are: for a quorum stream a single active
        # consumer and the delivery limit, since it is consumed and closed like one.
        channel.queue_declare(
            queue, durable=True, arguments=keyed_queue_arguments(self._stream, self._queue_type)
        )
        for delivery in deliveries:
            properties = aside_properties(delivery, key)
            channel.basic_publish("", queue, delivery.body, properties, mandatory=True)

    def declare(self, queues: Sequence[str]) -> None:
        """Declare ``queues`` as the stream's keyed queues are (a promoted key's own queues)."""
        connection = self._connection()
        if connection is None or self._channel is None:
            raise BrokerUnavailable("not connected to RabbitMQ")
        channel = connection.channel()
        arguments = keyed_queue_arguments(self._stream, self._queue_type)
        for queue in queues:
            channel.queue_declare(queue, durable=True, arguments=arguments)
        with contextlib.suppress(pika.exceptions.AMQPError):
            channel.close()

    def forward(self, copies: Sequence[tuple[str, str, Sequence[Delivery]]]) -> None:
        """Copy each ``(queue, key, deliveries)``, in order, to its queue (which must exist:
        mandatory), with their confirms awaited together rather than one by one."""
        connection = self._connection()
        if connection is None or self._channel is None:
            raise BrokerUnavailable("not connected to RabbitMQ")
        window = ConfirmWindow(connection)
        most, most_bytes = self._pack_limits
        try:
            for queue, key, deliveries in copies:
                for body, properties in packed(deliveries, key, most, most_bytes):
                    window.publish(queue, body, properties)
            window.wait()
        finally:
            window.close()

    def delete_drained(self, queue: str) -> bool:
        """Delete ``queue``, found drained by its only consumer
        (``keyq.worker.holding.aside_drains``); False if a classic queue turned out not to be
        empty. A quorum queue answers ``if_empty`` with "not implemented" (closing the
        connection), so it is deleted as it is: the drain checked it has neither messages nor
        consumers."""
        connection = self._connection()
        assert connection is not None
        channel = connection.channel()
        try:
            channel.queue_delete(queue, if_empty=self._queue_type == "classic")
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                return True  # gone already
            if exc.reply_code == 406:
                return False  # not empty
            raise
        with contextlib.suppress(pika.exceptions.AMQPError):
            channel.close()
        return True


class DeadLetterCalls:
    """``DeadLetterPublisher``'s verbs from other threads, each run on the I/O thread; a copy
    not confirmed raises ``BrokerUnavailable`` (the batch then waits and retries)."""

    def __init__(self, io: AmqpThread, publisher: DeadLetterPublisher) -> None:
        self._io = io
        self._publisher = publisher

    def dead_letter(
        self, letters: Sequence[DeadLetter]
    ) -> list[tuple[bytes, pika.BasicProperties]]:
        """Publish copies with the reason to the dead-letter queue, confirmed, and return
        them (body, properties)."""
        if not letters:
            return []
        try:
            return self._io.call(lambda: self._publisher.publish(letters))
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnavailable(
                f"dead letters not confirmed: {describe_exception(exc)}"
            ) from None

    def set_aside(self, queue: str, key: str, deliveries: Sequence[Delivery]) -> None:
        """Copy a stopped key's deliveries to ``queue``, where they wait, confirmed."""
        if not deliveries:
            return
        try:
            self._io.call(lambda: self._publisher.set_aside(queue, key, deliveries))
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnavailable(
                f"events set aside not confirmed: {describe_exception(exc)}"
            ) from None

    def declare(self, queues: Sequence[str]) -> None:
        """Declare promoted keys' own queues."""
        if not queues:
            return
        try:
            self._io.call(lambda: self._publisher.declare(queues))
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnavailable(f"declaring {queues[0]}: {describe_exception(exc)}") from None

    def forward(self, copies: Sequence[tuple[str, str, Sequence[Delivery]]]) -> None:
        """Copy promoted keys' deliveries from their buckets to their own queues, confirmed."""
        if not copies:
            return
        try:
            self._io.call(lambda: self._publisher.forward(copies))
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnavailable(
                f"events forwarded to {copies[0][0]} not confirmed: {describe_exception(exc)}"
            ) from None

    def delete_drained(self, queue: str) -> bool:
        """Delete a drained aside queue; False if messages are in it."""
        try:
            return self._io.call(lambda: self._publisher.delete_drained(queue))
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnavailable(f"deleting {queue}: {describe_exception(exc)}") from None
