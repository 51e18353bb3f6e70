"""The worker's AMQP connection: one thread owns it, others ask it to do things.

pika connections are not thread-safe, so every channel operation runs on the I/O thread
(``keyq.worker.amqp_thread``); the batch loop and the claim loop wait on futures. The queues
consumed, a channel each, are in ``keyq.worker.consuming``; dead letters are published by
``keyq.worker.dead_letters``. This module puts them together behind one link.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from keyq.broker.connections import describe_exception
from keyq.broker.errors import BrokerUnavailable, KeyqError
from keyq.broker.settings import Settings
from keyq.broker.urls import split_urls
from keyq.worker.amqp_thread import AmqpThread
from keyq.worker.consume_outcomes import FIRST_BURST, PIPELINE_DEPTH, Consumed, ConsumeOutcome
from keyq.worker.consuming import QueueConsumers
from keyq.worker.dead_letters import MAX_REASON_CHARS, DeadLetter, DeadLetterPublisher
from keyq.worker.deliveries import Delivery, DeliveryBuffer

__all__ = [
    "DEFAULT_CHANNEL_MAX",
    "FIRST_BURST",
    "MAX_REASON_CHARS",
    "PIPELINE_DEPTH",
    "RESERVED_CHANNELS",
    "ConsumeOutcome",
    "Consumed",
    "ConsumerLink",
    "DeadLetter",
]

T = TypeVar("T")
# Channels a connection keeps for other uses than held queues: confirms and dead letters,
# probes, declaring the dead-letter queue, a queue reopened while its old channel closes.
RESERVED_CHANNELS = 8
# RabbitMQ's default channel_max, if the negotiated one cannot be read.
DEFAULT_CHANNEL_MAX = 2047


class ConsumerLink:
    """The I/O thread and its connection; reconnects by itself until stopped.

    ``on_queue_lost(queue, epoch, why)`` runs on the I/O thread: for a consumer the broker
    cancelled or whose channel it closed, and for every held queue once the connection is
    lost. Whatever it does holds up every delivery and call meanwhile; ``max_loop_gap_s``
    shows how long (see ``AmqpThread``).
    """

    def __init__(
        self,
        *,
        settings: Settings,
        stream: str,
        name: str,
        buffer: DeliveryBuffer,
        prefetch: int,
        on_queue_lost: Callable[[str, int, str], None],
        on_disconnected: Callable[[str], None],
        queue_type: str = "classic",
    ) -> None:
        # ``prefetch`` counts events; a message may be a pack of up to ``pack_max_events``,
        # so a consumer's AMQP prefetch (messages) is sized to hold no more events than that.
        self._prefetch = settings.amqp_prefetch(prefetch)
        self._on_queue_lost = on_queue_lost
        self._io = AmqpThread(
            settings=settings,
            name=name,
            on_open=self._opened,
            on_tick=self._tick,
            on_close=self._closing,
            on_disconnected=on_disconnected,
        )
        connection = self._current_connection
        self._queues = QueueConsumers(
            connection=connection, buffer=buffer, on_queue_lost=on_queue_lost
        )
        self._dead_letters = DeadLetterPublisher(
            stream=stream, queue_type=queue_type, connection=connection
        )
        self._probe_channel: BlockingChannel | None = None
        self._queue_type = queue_type
        self._settings = settings
        self._epochs = itertools.count(1)
        self._epoch_lock = threading.Lock()

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self, give_up: threading.Event | None = None) -> None:
        """Connect, waiting while RabbitMQ is unreachable; raise if it refuses the
        credentials, or ``BrokerUnavailable`` once ``give_up`` is set."""
        self._io.start(give_up)

    def stop(self) -> None:
        self._io.stop()

    @property
    def connected(self) -> bool:
        return self._io.connected

    @property
    def failure(self) -> KeyqError | None:
        """Why the link gave up for good (bad credentials), if it did."""
        return self._io.failure

    @property
    def node(self) -> str | None:
        """host:port of the node the link is connected to, if it is."""
        return self._io.node

    @property
    def queue_type(self) -> str:
        return self._queue_type

    def move(self, reason: str) -> None:
        """Drop the connection and connect to the next node: every held queue ends as on
        a lost connection, and is claimed again through the new one."""
        self._io.move(reason)

    @property
    def reconnects(self) -> int:
        """How many times the connection was lost and made again."""
        return self._io.reconnects

    @property
    def max_loop_gap_s(self) -> float:
        """The longest time, in monotonic seconds, between two iterations of the I/O loop
        since the link started or ``reset_loop_gap`` was last called: how long the I/O
        thread was held up at most (by ``on_queue_lost``, say), every delivery, ack and
        call waiting meanwhile. A measurement only: the loop does the same with or without
        anyone reading it."""
        return self._io.max_loop_gap_s

    def reset_loop_gap(self) -> None:
        """Start measuring ``max_loop_gap_s`` afresh (a gap under way still counts)."""
        self._io.reset_loop_gap()

    @property
    def capacity(self) -> int:
        """How many queues this connection can hold: a channel each, as many as the broker
        negotiated (``channel_max``) less the ones keyq keeps for itself."""
        connection = self._io.connection
        impl = getattr(connection, "_impl", None)  # pika keeps the negotiated value there
        params = getattr(impl, "params", None)
        channel_max = getattr(params, "channel_max", None)
        if not isinstance(channel_max, int) or channel_max <= 0:
            channel_max = DEFAULT_CHANNEL_MAX
        return max(1, channel_max - RESERVED_CHANNELS)

    # ---- the I/O thread's hooks -----------------------------------------------------------

    def _current_connection(self) -> pika.BlockingConnection | None:
        return self._io.connection

    def _opened(self) -> None:
        self._dead_letters.open()

    def _tick(self) -> None:
        self._queues.check()

    def _closing(self, connection: pika.BlockingConnection | None) -> Callable[[], None]:
        lost = self._queues.drop(connection)
        self._dead_letters.close()
        self._probe_channel = None

        def report() -> None:
            for queue, epoch in lost:
                self._on_queue_lost(queue, epoch, "connection lost")

        return report

    # ---- calls from other threads ---------------------------------------------------------

    def call(self, action: Callable[[], T], timeout: float = 30.0) -> T:
        """Run ``action`` on the I/O thread and wait for its result."""
        return self._io.call(action, timeout)

    def new_epoch(self) -> int:
        """A fresh consumer incarnation number, taken before consuming so that the queue can
        be recorded as held before its first delivery can arrive."""
        with self._epoch_lock:
            return next(self._epochs)

    @property
    def prefetch(self) -> int:
        """The AMQP prefetch (messages) a consumer opens with: the worker's prefetch (events)
        over the most events a pack holds (``Settings.amqp_prefetch``)."""
        return self._prefetch

    def consume(self, queue: str, epoch: int, prefetch: int | None = None) -> Consumed:
        """Consume ``queue`` as consumer ``epoch``, with an AMQP prefetch of ``prefetch``
        messages (a consumer reopened wider), or else ``self.prefetch``."""
        prefetch = prefetch or self._prefetch
        return self.call(lambda: self._queues.consume_all([(queue, epoch)], prefetch, None)[0])

    def unacked_of(self, queue: str) -> int | None:
        """Messages ``queue``'s consumer was sent and has not acked; None if it is not
        consumed here."""
        return self.call(lambda: self._queues.unacked_of(queue))

    def prefetch_of(self, queue: str) -> int | None:
        """The AMQP prefetch (messages) ``queue``'s consumer was opened with; None if it is
        not consumed here."""
        return self.call(lambda: self._queues.prefetch_of(queue))

    def consume_many(
        self, claims: Sequence[tuple[str, int]], *, budget_s: float | None = None
    ) -> list[Consumed]:
        """Consume each (queue, epoch) in one call to the I/O thread: a claim round of
        hundreds of queues costs their channels' round trips, not a thread hand-off each.
        Claims still waiting ``budget_s`` after the I/O thread began the call are
        ``NOT_TRIED`` (the time the call waited for a busy I/O thread is not counted)."""
        if not claims:
            return []
        timeout = 30.0 + 0.05 * len(claims)

        def consume_all() -> list[Consumed]:
            until = None if budget_s is None else time.monotonic() + budget_s
            return self._queues.consume_all(claims, self._prefetch, until)

        return self.call(consume_all, timeout)

    def close_queue(self, queue: str, epoch: int | None = None) -> None:
        """Stop consuming ``queue`` (only that consumer incarnation, if ``epoch`` is given);
        its unacked messages go back to it, in order."""
        self.close_queues([(queue, epoch)])

    def close_queues(self, queues: Sequence[tuple[str, int | None]]) -> None:
        """``close_queue`` for each (queue, epoch) of ``queues``, in one hand-off to the I/O
        thread and the broker round trip of one."""
        if not queues:
            return
        # If the connection is gone, so are the consumers; if the I/O thread is slow to get
        # to them (a stalled link), the closes are still queued there and happen when it does.
        with contextlib.suppress(BrokerUnavailable, TimeoutError):
            self.call(lambda: self._queues.close(queues), 30.0 + 0.05 * len(queues))

    def ack(self, acks: Sequence[tuple[str, int, Sequence[tuple[int, int]]]]) -> int:
        """Settle (queue, epoch, events), each event a (tag, part), acking the messages
        settled whole; returns how many consumers were still there to ack."""
        return self.call(lambda: self._queues.ack(acks))

    def dead_letter(
        self, letters: Sequence[DeadLetter]
    ) -> list[tuple[bytes, pika.BasicProperties]]:
        """Publish copies with the reason to the dead-letter queue, confirmed, and return
        them (body, properties). Raises ``BrokerUnavailable`` when they are not (the batch
        then waits and retries)."""
        if not letters:
            return []
        try:
            return self.call(lambda: self._dead_letters.publish(letters))
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnavailable(
                f"dead letters not confirmed: {describe_exception(exc)}"
            ) from None

    def set_aside(self, queue: str, key: str, deliveries: Sequence[Delivery]) -> None:
        """Copy a stopped key's deliveries to ``queue``, where they wait, confirmed. Raises
        ``BrokerUnavailable`` when they are not (the batch then waits and retries)."""
        if not deliveries:
            return
        try:
            self.call(lambda: self._dead_letters.set_aside(queue, key, deliveries))
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnavailable(
                f"events set aside not confirmed: {describe_exception(exc)}"
            ) from None

    def delete_drained(self, queue: str) -> bool:
        """Delete a drained queue a key's events waited in; False if messages are in it."""
        try:
            return self.call(lambda: self._dead_letters.delete_drained(queue))
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnavailable(f"deleting {queue}: {describe_exception(exc)}") from None

    def message_count(self, queue: str) -> int:
        """Messages ready in ``queue`` (0 if it does not exist)."""
        return self.queue_counts(queue)[0]

    def message_counts(self, queues: Sequence[str]) -> dict[str, int]:
        """Messages ready in each of ``queues``, in one call to the I/O thread."""
        return self._probe(lambda: {q: self._queue_counts(q)[0] for q in queues}, "queues")

    def queue_counts(self, queue: str) -> tuple[int, int]:
        """Messages ready in ``queue`` and its consumers ((0, 0) if it does not exist)."""
        return self._probe(lambda: self._queue_counts(queue), queue)

    def _probe(self, action: Callable[[], T], what: str) -> T:
        """``call`` for a passive declare: pika's errors (the connection or the probe's
        channel failing) are ``BrokerUnavailable``."""
        try:
            return self.call(action)
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnavailable(f"probing {what}: {describe_exception(exc)}") from None

    @property
    def single_node(self) -> bool:
        """Only one broker URL is configured: a move would come back to the same node."""
        return len(split_urls(self._settings.amqp_url)) == 1

    def held(self) -> dict[str, int]:
        """Queues with a live consumer, and their epochs."""
        return dict(self.call(self._queues.held))

    # ---- on the I/O thread ----------------------------------------------------------------

    def _queue_counts(self, queue: str) -> tuple[int, int]:
        connection = self._io.connection
        assert connection is not None
        channel = self._probe_channel
        if channel is None or channel.is_closed:
            channel = self._probe_channel = connection.channel()
        try:
            declared = channel.queue_declare(queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._probe_channel = None
            if exc.reply_code == 404:
                return 0, 0
            raise
        return int(declared.method.message_count), int(declared.method.consumer_count)
