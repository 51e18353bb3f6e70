"""The worker's AMQP connection: one thread owns it, others ask it to do things.

pika connections are not thread-safe, so every channel operation runs on the I/O thread
(``keyq.worker.amqp.io_thread``); the batch loop and the claim loop wait on futures. Each part of
the connection has a thin adapter that other threads call, which runs its verbs there: the
consumed queues (``ConsumerCalls`` over ``keyq.worker.amqp.queue_channels``), the dead letters
(``keyq.worker.amqp.dead_letters``) and the queues' counts (``QueueCounter``). Consumers the broker
takes away are not called back: they are queued (``ConsumerLink.gone``) for the held queues'
owner to drain on its own thread.
"""

from __future__ import annotations

import contextlib
import itertools
import queue as queue_module
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from keyq.broker.connections import describe_exception
from keyq.broker.errors import BrokerUnavailable, KeyqError
from keyq.broker.queue_probe import QueueCounts, QueueProbe
from keyq.broker.settings import Settings
from keyq.broker.urls import split_urls
from keyq.worker.amqp.consume_rounds import Consumed
from keyq.worker.amqp.dead_letters import DeadLetterCalls, DeadLetterPublisher
from keyq.worker.amqp.deliveries import DeliveryBuffer
from keyq.worker.amqp.io_thread import AmqpThread
from keyq.worker.amqp.queue_channels import ConsumerGone, QueueConsumers
from keyq.worker.batch.ports import Acks

T = TypeVar("T")
# Channels a connection keeps for other uses than held queues: confirms and dead letters,
# probes, declaring the dead-letter queue, a queue reopened while its old channel closes.
RESERVED_CHANNELS = 8
# RabbitMQ's default channel_max, if the negotiated one cannot be read.
DEFAULT_CHANNEL_MAX = 2047


class ConsumerLink:
    """The I/O thread and its connection; reconnects by itself until stopped.

    Its parts, for other threads: ``consumers`` (the consumed queues; an ``Acker``),
    ``dead_letters`` (a ``DeadLetterSink``), ``counts`` (a ``QueueDepths``), and ``gone``: a
    consumer the broker cancelled or whose channel it closed, and every held queue once the
    connection is lost, as a ``ConsumerGone`` event. Queuing one never holds the I/O thread
    up (``max_loop_gap_s``).
    """

    def __init__(
        self,
        *,
        settings: Settings,
        stream: str,
        name: str,
        buffer: DeliveryBuffer,
        prefetch: int,
        on_disconnected: Callable[[str], None],
        queue_type: str = "classic",
    ) -> None:
        self._io = AmqpThread(
            settings=settings,
            name=name,
            on_open=self._opened,
            on_tick=self._tick,
            on_close=self._closing,
            on_disconnected=on_disconnected,
        )
        connection = self._current_connection
        self.gone: queue_module.SimpleQueue[ConsumerGone] = queue_module.SimpleQueue()
        self._queues = QueueConsumers(connection=connection, buffer=buffer, gone=self.gone)
        self._dead_letters = DeadLetterPublisher(
            stream=stream,
            queue_type=queue_type,
            connection=connection,
            pack_limits=(settings.pack_max_events, settings.pack_max_bytes),
        )
        # ``prefetch`` counts events; a message may be a pack of up to ``pack_max_events``,
        # so a consumer's AMQP prefetch (messages) is sized to hold no more events than that.
        self.consumers = ConsumerCalls(self._io, self._queues, settings.amqp_prefetch(prefetch))
        self.dead_letters = DeadLetterCalls(self._io, self._dead_letters)
        self.counts = QueueCounter(self._io)
        self._settings = settings

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
        thread was held up at most, every delivery, ack and call waiting meanwhile. A
        measurement only: the loop does the same with or without anyone reading it."""
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
        self.counts.close()

        def report() -> None:
            for queue, epoch in lost:
                self.gone.put(ConsumerGone(queue, epoch, "connection lost"))

        return report

    # ---- calls from other threads ---------------------------------------------------------

    def call(self, action: Callable[[], T], timeout: float = 30.0) -> T:
        """Run ``action`` on the I/O thread and wait for its result."""
        return self._io.call(action, timeout)

    @property
    def single_node(self) -> bool:
        """Only one broker URL is configured: a move would come back to the same node."""
        return len(split_urls(self._settings.amqp_url)) == 1


class ConsumerCalls:
    """The consumed queues (``QueueConsumers``), for the claim loop and the batch loop: each
    verb runs on the I/O thread while the caller waits. The batch's ``Acker``."""

    def __init__(self, io: AmqpThread, queues: QueueConsumers, prefetch: int) -> None:
        self._io = io
        self._queues = queues
        # The AMQP prefetch (messages) a consumer opens with: the worker's prefetch (events)
        # over the most events a pack holds (``Settings.amqp_prefetch``).
        self.prefetch = prefetch
        self._epochs = itertools.count(1)
        self._epoch_lock = threading.Lock()

    def new_epoch(self) -> int:
        """A fresh consumer incarnation number, taken before consuming so that the queue can
        be recorded as held before its first delivery can arrive."""
        with self._epoch_lock:
            return next(self._epochs)

    def consume(self, queue: str, epoch: int, prefetch: int | None = None) -> Consumed:
        """Consume ``queue`` as consumer ``epoch``, with an AMQP prefetch of ``prefetch``
        messages (a consumer reopened wider), or else ``self.prefetch``."""
        prefetch = prefetch or self.prefetch
        return self._io.call(lambda: self._queues.consume_all([(queue, epoch)], prefetch, None)[0])

    def consume_many(
        self, claims: Sequence[tuple[str, int]], *, budget_s: float | None = None
    ) -> list[Consumed]:
        """Consume each (queue, epoch) in one call to the I/O thread: a claim round of
        hundreds of queues costs their channels' round trips, not a thread hand-off each.
        Claims still waiting ``budget_s`` after the I/O thread began the call are
        ``NOT_TRIED`` (the time the call waited for a busy I/O thread is not counted)."""
        if not claims:
            return []

        def consume_all() -> list[Consumed]:
            until = None if budget_s is None else time.monotonic() + budget_s
            return self._queues.consume_all(claims, self.prefetch, until)

        return self._io.call(consume_all, 30.0 + 0.05 * len(claims))

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
            self._io.call(lambda: self._queues.close(queues), 30.0 + 0.05 * len(queues))

    def ack(self, acks: Acks) -> int:
        """Settle (queue, epoch, events), each event a (tag, part), acking the messages
        settled whole; returns how many consumers were still there to ack."""
        return self._io.call(lambda: self._queues.ack(acks))

    def held(self) -> dict[str, int]:
        """Queues with a live consumer, and their epochs."""
        return dict(self._io.call(self._queues.held))

    def unacked_of(self, queue: str) -> int | None:
        """Messages ``queue``'s consumer was sent and has not acked; None if it is not
        consumed here."""
        return self._io.call(lambda: self._queues.unacked_of(queue))


class QueueCounter:
    """Queues' counts by passive declare (``QueueProbe``, on the I/O thread, its channel
    going with the connection); pika's errors are ``BrokerUnavailable``. The
    ``QueueDepths`` of the aside drains and the gap checks."""

    def __init__(self, io: AmqpThread) -> None:
        self._io = io
        self._probe = QueueProbe(self._open_channel)

    def _open_channel(self) -> BlockingChannel:
        connection = self._io.connection
        assert connection is not None
        return connection.channel()

    def close(self) -> None:
        """On the I/O thread: the connection is going, the probe's channel with it."""
        self._probe.close()

    def counts(self, queue: str) -> QueueCounts:
        """Messages ready in ``queue`` and its consumers (0, 0 if it does not exist)."""
        return self._call(lambda: self._probe.counts(queue) or QueueCounts(0, 0), queue)

    def message_count(self, queue: str) -> int:
        """Messages ready in ``queue`` (0 if it does not exist)."""
        return self.counts(queue).ready

    def message_counts(self, queues: Sequence[str]) -> dict[str, int]:
        """Messages ready in each of ``queues``, in one call to the I/O thread."""

        def ready() -> dict[str, int]:
            found = self._probe.counts_of(queues)
            return {queue: counts.ready if counts else 0 for queue, counts in found.items()}

        return self._call(ready, "queues")

    def _call(self, action: Callable[[], T], what: str) -> T:
        try:
            return self._io.call(action)
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnavailable(f"probing {what}: {describe_exception(exc)}") from None
