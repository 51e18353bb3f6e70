"""The worker's AMQP connection: one thread owns it, others ask it to do things.

pika connections are not thread-safe, so every channel operation runs on the I/O thread
(``add_callback_threadsafe``); the batch loop and the claim loop wait on futures. Each held
queue gets its own channel: an exclusive consume that the broker refuses (403) closes only
that channel, and closing a queue's channel hands its unacked messages back, in order.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from keyq.broker.acks import buffer_ack, flush_acks
from keyq.broker.connections import amqp_failure, describe_exception, open_blocking_connection
from keyq.broker.consume_rounds import ConsumeReply, ConsumeRequest, OnMessage, open_consumers
from keyq.broker.consumers import close_keeping_consumers
from keyq.broker.envelope import HEADER_ATTEMPTS, HEADER_DEAD_QUEUE, HEADER_DEAD_REASON
from keyq.broker.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    ConfigurationError,
    KeyqError,
)
from keyq.broker.naming import dead_letter_queue_name
from keyq.broker.queue_refusals import QueueRefusal, classify
from keyq.broker.settings import Settings
from keyq.broker.topology import dead_letter_queue_arguments
from keyq.worker.ack_ledger import AckLedger
from keyq.worker.deliveries import Delivery, DeliveryBuffer

log = logging.getLogger("keyq.worker.amqp")

T = TypeVar("T")
MAX_REASON_CHARS = 1000
_CHANNEL_CHECK_S = 0.25
# Channels a connection keeps for other uses than held queues: confirms and dead letters,
# probes, declaring the dead-letter queue, a queue reopened while its old channel closes.
RESERVED_CHANNELS = 8
# Consumers opened per pipelined burst: a claim round's budget is checked between bursts. The
# first burst is small; the next ones are sized from the time a claim took in the last, so a
# broker slow to answer does not make one burst outlast the budget (and the locks held).
PIPELINE_DEPTH = 25
FIRST_BURST = 8
# RabbitMQ's default channel_max, if the negotiated one cannot be read.
DEFAULT_CHANNEL_MAX = 2047


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


@dataclass(frozen=True)
class DeadLetter:
    """A message to move to the stream's dead-letter queue, and why."""

    delivery: Delivery
    reason: str
    attempts: int


class ConsumerLink:
    """The I/O thread and its connection; reconnects by itself until stopped."""

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
        self._settings = settings
        self._queue_type = queue_type  # the stream's, for its dead-letter queue
        self._stream = stream
        self._name = name
        self._buffer = buffer
        self._prefetch = prefetch
        self._on_queue_lost = on_queue_lost
        self._on_disconnected = on_disconnected
        self._dlq = dead_letter_queue_name(stream)
        self._connection: pika.BlockingConnection | None = None
        self._channels: dict[str, tuple[int, BlockingChannel]] = {}
        # Per consumer (queue, epoch): its delivery tags not yet acked.
        self._unacked: dict[tuple[str, int], AckLedger] = {}
        self._dead_letter_channel: BlockingChannel | None = None
        self._dead_letter_ready = False  # the dead-letter queue was declared on this connection
        self._probe_channel: BlockingChannel | None = None
        self._epochs = itertools.count(1)
        self._pending: set[Future[Any]] = set()
        self._pending_lock = threading.Lock()
        self._connected = threading.Event()
        self._stopping = threading.Event()
        self._first_attempt = threading.Event()
        self._fatal: KeyqError | None = None
        self._thread = threading.Thread(target=self._run, name="keyq-amqp", daemon=True)
        self.reconnects = 0
        self._lost_at: float | None = None  # when the connection last went away

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self, give_up: threading.Event | None = None) -> None:
        """Connect, waiting while RabbitMQ is unreachable; raise if it refuses the
        credentials, or ``BrokerUnavailable`` once ``give_up`` is set."""
        self._thread.start()
        while not self._connected.wait(0.1):
            if self._fatal is not None:
                raise self._fatal
            if give_up is not None and give_up.is_set():
                self.stop()
                raise BrokerUnavailable("stopped before RabbitMQ answered")

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def capacity(self) -> int:
        """How many queues this connection can hold: a channel each, as many as the broker
        negotiated (``channel_max``) less the ones keyq keeps for itself."""
        connection = self._connection
        impl = getattr(connection, "_impl", None)  # pika keeps the negotiated value there
        params = getattr(impl, "params", None)
        channel_max = getattr(params, "channel_max", None)
        if not isinstance(channel_max, int) or channel_max <= 0:
            channel_max = DEFAULT_CHANNEL_MAX
        return max(1, channel_max - RESERVED_CHANNELS)

    @property
    def failure(self) -> KeyqError | None:
        """Why the link gave up for good (bad credentials), if it did."""
        return self._fatal

    def stop(self) -> None:
        self._stopping.set()
        connection = self._connection
        if connection is not None:
            with contextlib.suppress(Exception):  # already closed is fine
                connection.add_callback_threadsafe(lambda: None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            self._pump()
        except Exception as exc:  # never die silently: the worker must see it
            log.exception("the AMQP I/O thread failed")
            self._fatal = BrokerUnavailable(
                f"the AMQP I/O thread failed: {describe_exception(exc)}"
            )
            self._connected.clear()

    def _pump(self) -> None:
        started = time.monotonic()
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                self._connect()
            except ConfigurationError as exc:
                self._fatal = exc
                log.error("worker cannot connect to RabbitMQ: %s", exc)
                return
            except AuthenticationFailed as exc:
                # Reconnecting, a refusal of credentials that worked before is retried for
                # reconnect_timeout: a broker starting or stopping can drop a handshake.
                lost_for = time.monotonic() - (self._lost_at or started)
                if self.reconnects == 0 or lost_for > self._settings.reconnect_timeout:
                    self._fatal = exc
                    log.error("worker cannot connect to RabbitMQ: %s", exc)
                    return
                log.warning("RabbitMQ refused a reconnect, retrying in %.1fs: %s", backoff, exc)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            except KeyqError as exc:  # unreachable: a daemon waits for its broker
                log.warning("RabbitMQ unavailable, retrying in %.1fs: %s", backoff, exc)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            self._lost_at = None
            reason = self._serve()
            self._teardown(reason)
            if reason is not None and not self._stopping.is_set():
                self._lost_at = time.monotonic()
                self.reconnects += 1
                self._on_disconnected(reason)
        self._teardown(None)

    def _connect(self) -> None:
        connection = open_blocking_connection(self._settings, self._name)
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            self._connection = connection
            self._dead_letter_ready = self._declare_dead_letter_queue()
        except (pika.exceptions.AMQPError, OSError) as exc:
            self._connection = None
            with contextlib.suppress(Exception):  # a half-open connection: drop it
                connection.close()
            raise amqp_failure(exc, self._settings.amqp_url) from None
        self._dead_letter_channel = channel
        self._connected.set()

    def _declare_dead_letter_queue(self) -> bool:
        """Declare the stream's dead-letter queue on a channel of its own. On a cluster, a
        classic dead-letter queue whose node is down answers 404: the worker serves on (keys
        on live nodes must not stop for it) and dead letters wait until it is back."""
        assert self._connection is not None
        channel = self._connection.channel()
        try:
            channel.queue_declare(
                self._dlq, durable=True, arguments=dead_letter_queue_arguments(self._queue_type)
            )
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != 404:
                raise
            log.warning(
                "dead-letter queue %s is unavailable (%s); serving on, dead letters wait for it",
                self._dlq,
                exc.reply_text,
            )
            return False
        with contextlib.suppress(pika.exceptions.AMQPError):
            channel.close()
        return True

    def _serve(self) -> str | None:
        """Pump the connection until it fails (returns why) or we stop (returns None)."""
        assert self._connection is not None
        next_check = time.monotonic() + _CHANNEL_CHECK_S
        while not self._stopping.is_set():
            if not self._connection.is_open:  # lost inside a call made on this thread
                return "connection to RabbitMQ lost"
            try:
                self._connection.process_data_events(time_limit=0.05)
            except (pika.exceptions.AMQPError, OSError) as exc:
                return str(amqp_failure(exc, self._settings.amqp_url))
            except ValueError as exc:
                # pika's timers raise ValueError once a lost connection closed its loop
                # ("Timeout closed before call"): a lost connection like any other.
                if self._connection.is_open:
                    raise
                return f"connection to RabbitMQ lost: {describe_exception(exc)}"
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + _CHANNEL_CHECK_S
                self._check_channels()
        return None

    def _teardown(self, reason: str | None) -> None:
        self._connected.clear()
        lost = list(self._channels.items())
        self._channels.clear()
        self._unacked.clear()
        self._dead_letter_channel = None
        self._probe_channel = None
        connection, self._connection = self._connection, None
        if connection is not None and connection.is_open:
            for _queue, (_epoch, channel) in lost:  # each atomically, as in _close_queue
                with contextlib.suppress(Exception):
                    close_keeping_consumers(channel)
            with contextlib.suppress(Exception):  # closing a broken connection
                connection.close()
        with self._pending_lock:
            pending, self._pending = self._pending, set()
        for future in pending:
            if not future.done():
                future.set_exception(BrokerUnavailable(reason or "the worker is stopping"))
        if reason is not None:
            for queue, (epoch, _channel) in lost:
                self._on_queue_lost(queue, epoch, "connection lost")

    def _check_channels(self) -> None:
        for queue, (epoch, channel) in list(self._channels.items()):
            if channel.is_closed:
                del self._channels[queue]
                self._unacked.pop((queue, epoch), None)
                self._on_queue_lost(queue, epoch, "channel closed by the broker")

    # ---- calls from other threads ---------------------------------------------------------

    def call(self, action: Callable[[], T], timeout: float = 30.0) -> T:
        """Run ``action`` on the I/O thread and wait for its result."""
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(action())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

        connection = self._connection
        if connection is None or not self._connected.is_set():
            raise BrokerUnavailable("not connected to RabbitMQ")
        with self._pending_lock:
            self._pending.add(future)
        try:
            connection.add_callback_threadsafe(run)
        except Exception:  # noqa: BLE001 - the connection closed under us
            with self._pending_lock:
                self._pending.discard(future)
            raise BrokerUnavailable("the connection to RabbitMQ closed") from None
        try:
            return future.result(timeout)
        finally:
            with self._pending_lock:
                self._pending.discard(future)

    def new_epoch(self) -> int:
        """A fresh consumer incarnation number, taken before consuming so that the queue can
        be recorded as held before its first delivery can arrive."""
        with self._pending_lock:
            return next(self._epochs)

    def consume(self, queue: str, epoch: int, prefetch: int | None = None) -> Consumed:
        """Consume ``queue`` as consumer ``epoch``, with the settings' prefetch or more."""
        return self.call(lambda: self._consume(queue, epoch, prefetch or self._prefetch))

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
            return self._consume_all(claims, self._prefetch, until)

        return self.call(consume_all, timeout)

    def close_queue(self, queue: str, epoch: int | None = None) -> None:
        """Stop consuming ``queue`` (only that consumer incarnation, if ``epoch`` is given);
        its unacked messages go back to it, in order."""
        # If the connection is gone, so is the consumer; if the I/O thread is slow to get to
        # it (a stalled link), the close is still queued there and happens when it does.
        with contextlib.suppress(BrokerUnavailable, TimeoutError):
            self.call(lambda: self._close_queue(queue, epoch))

    def ack(self, acks: Sequence[tuple[str, int, Sequence[int]]]) -> int:
        """Ack (queue, epoch, tags); returns how many consumers were still there to ack."""
        return self.call(lambda: self._ack(acks))

    def dead_letter(self, letters: Sequence[DeadLetter]) -> None:
        """Publish copies with the reason to the dead-letter queue, confirmed. Raises
        ``BrokerUnavailable`` when they are not (the batch then waits and retries)."""
        if not letters:
            return
        try:
            self.call(lambda: self._dead_letter(letters))
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnavailable(
                f"dead letters not confirmed: {describe_exception(exc)}"
            ) from None

    def message_count(self, queue: str) -> int:
        """Messages ready in ``queue`` (0 if it does not exist)."""
        return self.call(lambda: self._message_count(queue))

    def held(self) -> dict[str, int]:
        """Queues with a live consumer, and their epochs."""
        return dict(self.call(lambda: {q: e for q, (e, _c) in self._channels.items()}))

    # ---- on the I/O thread ----------------------------------------------------------------

    def _consume(self, queue: str, epoch: int, prefetch: int) -> Consumed:
        return self._consume_all([(queue, epoch)], prefetch, None)[0]

    def _consume_all(
        self, claims: Sequence[tuple[str, int]], prefetch: int, until: float | None
    ) -> list[Consumed]:
        """Every claim's outcome; one that fails does not hide the others' (a queue already
        consuming must be known as held, or its lock would be let go under it). Claims go to
        the broker pipelined, in bursts of at most ``PIPELINE_DEPTH``, each sized to fit the
        time left; the first burst is always tried, so that a slow I/O thread still makes
        progress."""
        results: dict[int, Consumed] = {}
        todo: dict[str, int] = {}  # queue -> index of its first claim in this round
        for index, (queue, _epoch) in enumerate(claims):
            if queue not in self._channels:
                todo.setdefault(queue, index)
        indexes = list(todo.values())
        start, size = 0, FIRST_BURST if until is not None else PIPELINE_DEPTH
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
                per_claim = max((time.monotonic() - began) / len(batch), 1e-4)
                size = max(1, min(PIPELINE_DEPTH, int((until - time.monotonic()) / per_claim)))
        for index, (queue, _epoch) in enumerate(claims):
            held = self._channels.get(queue)
            if index not in results and held is not None:  # held already, or claimed twice
                results[index] = Consumed(ConsumeOutcome.CONSUMING, held[0])
        return [results.get(index, Consumed(ConsumeOutcome.FAILED)) for index in range(len(claims))]

    def _consume_pipelined(
        self, claims: Sequence[tuple[str, int]], prefetch: int
    ) -> list[Consumed]:
        if self._connection is None or not self._connection.is_open:
            return [Consumed(ConsumeOutcome.FAILED)] * len(claims)
        ledgers = [AckLedger() for _ in claims]
        requests = [
            ConsumeRequest(queue, prefetch, self._receiver(queue, epoch, ledger))
            for (queue, epoch), ledger in zip(claims, ledgers, strict=True)
        ]
        try:
            replies = open_consumers(self._connection, requests)
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
            ledger.delivered(method.delivery_tag)
            buffer.add(
                Delivery(
                    queue=queue,
                    channel_epoch=epoch,
                    delivery_tag=method.delivery_tag,
                    redelivered=bool(method.redelivered),
                    headers=dict(properties.headers or {}),
                    content_type=properties.content_type,
                    message_id=properties.message_id,
                    body=body,
                )
            )

        return on_message

    def _consumed(self, queue: str, epoch: int, ledger: AckLedger, reply: ConsumeReply) -> Consumed:
        channel = reply.channel
        if channel is None:
            refusal = reply.refusal
            if refusal is not None and refusal.reply_code == 403:
                return Consumed(ConsumeOutcome.BUSY)
            if refusal is not None and refusal.reply_code == 404:
                if classify(404, str(refusal.reply_text)) is QueueRefusal.MISSING:
                    return Consumed(ConsumeOutcome.MISSING)
                return Consumed(ConsumeOutcome.UNREACHABLE)
            why = describe_exception(refusal) if refusal is not None else "channel closed"
            log.warning("consuming %s failed: %s", queue, why)
            return Consumed(ConsumeOutcome.FAILED)
        channel.add_on_cancel_callback(lambda _frame: self._cancelled(queue, epoch))
        self._channels[queue] = (epoch, channel)
        self._unacked[(queue, epoch)] = ledger
        return Consumed(ConsumeOutcome.CONSUMING, epoch)

    def _message_count(self, queue: str) -> int:
        assert self._connection is not None
        channel = self._probe_channel
        if channel is None or channel.is_closed:
            channel = self._probe_channel = self._connection.channel()
        try:
            declared = channel.queue_declare(queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._probe_channel = None
            if exc.reply_code == 404:
                return 0
            raise
        return int(declared.method.message_count)

    def _cancelled(self, queue: str, epoch: int) -> None:
        held = self._channels.get(queue)
        if held is not None and held[0] == epoch:
            del self._channels[queue]
            self._unacked.pop((queue, epoch), None)
            with contextlib.suppress(Exception):  # already closing
                close_keeping_consumers(held[1])
            self._on_queue_lost(queue, epoch, "the broker cancelled the consumer")

    def _close_queue(self, queue: str, epoch: int | None) -> None:
        held = self._channels.get(queue)
        if held is None or (epoch is not None and held[0] != epoch):
            return
        del self._channels[queue]
        self._unacked.pop((queue, held[0]), None)
        # Never cancel first: the queue would look unused while it still holds our unacked
        # deliveries, and a janitor's delete(if_empty, if_unused) would take them with it.
        with contextlib.suppress(pika.exceptions.AMQPError):
            close_keeping_consumers(held[1])

    def _ack(self, acks: Sequence[tuple[str, int, Sequence[int]]]) -> int:
        """One ``ack(multiple)`` for the oldest run of tags being settled; the tags past a
        delivery still waiting (for an earlier seq), or past a tag that never reached us
        (``keyq.worker.ack_ledger``), are acked one by one."""
        done = 0
        for queue, epoch, tags in acks:
            held = self._channels.get(queue)
            if held is None or held[0] != epoch or not held[1].is_open:
                self._unacked.pop((queue, epoch), None)
                continue  # that consumer is gone: the broker has requeued these already
            ledger = self._unacked.get((queue, epoch))
            if ledger is None:
                continue
            upto, singles = ledger.settle(tags)
            if upto:
                buffer_ack(held[1], upto, multiple=True)
            for tag in singles:
                buffer_ack(held[1], tag, multiple=False)
            done += 1
        if done and self._connection is not None:
            flush_acks(self._connection)  # one write for the whole batch (keyq.broker.acks)
        return done

    def _dead_letter(self, letters: Sequence[DeadLetter]) -> None:
        channel = self._dead_letter_channel
        if channel is None:
            raise BrokerUnavailable("not connected to RabbitMQ")
        if not self._dead_letter_ready:
            self._dead_letter_ready = self._declare_dead_letter_queue()
            if not self._dead_letter_ready:
                raise BrokerUnavailable(f"dead-letter queue {self._dlq} is unavailable")
        for letter in letters:
            delivery = letter.delivery
            headers = dict(delivery.headers)
            headers[HEADER_DEAD_REASON] = letter.reason[:MAX_REASON_CHARS]
            headers[HEADER_DEAD_QUEUE] = delivery.queue
            headers[HEADER_ATTEMPTS] = letter.attempts
            properties = pika.BasicProperties(
                delivery_mode=pika.DeliveryMode.Persistent,
                headers=headers,
                content_type=delivery.content_type,
                message_id=delivery.message_id,
            )
            channel.basic_publish("", self._dlq, delivery.body, properties, mandatory=True)
