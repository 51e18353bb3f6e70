"""The producer's connection to RabbitMQ, owned by one I/O thread.

Only this thread touches pika objects. Application threads hand events over through a deque
and wait on a condition for room in the confirm window; the I/O thread publishes them with
``mandatory`` on a confirm-mode channel, tracks confirms by delivery tag, re-sends events the
broker returned (their queue was deleted) in order, and after a lost connection reconnects and
re-sends every unconfirmed event in submission order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions
from pika.adapters.select_connection import IOLoop

from keyq.broker.connections import (
    amqp_failure,
    amqp_parameters,
    describe_exception,
    handshake_timeout,
)
from keyq.broker.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    KeyqError,
    ProducerClosed,
    PublishError,
    PublishTimeout,
    TopologyError,
)
from keyq.broker.naming import base_queue_name, incarnation_name
from keyq.broker.queue_refusals import unreachable_queue
from keyq.broker.settings import Settings
from keyq.broker.topology import dead_letter_queue_arguments, keyed_queue_arguments
from keyq.broker.urls import scrub
from keyq.producer.declarers import Declarers
from keyq.producer.outgoing import AsideChannel, Outgoing, QueueState

log = logging.getLogger("keyq.producer")

DRAIN_BATCH = 500
FORGET_STATES_ABOVE = 50_000
RECONNECT_DELAYS = (0.1, 0.25, 0.5, 1.0, 2.0)
# A queue whose node is down is declared again on a channel of its own after these delays.
PROBE_DELAYS = (0.5, 1.0, 2.0, 4.0)
# Before re-sending to a queue that returned events again right after its last recovery (a
# quorum queue electing a leader keeps returning them): no tight loop of returns.
RECOVERY_DELAYS = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0)
# A queue refused this many times in a row is given a fresh connection, to the next node: a
# channel on which a quorum queue nacks every publish after a node's loss can stay so until
# that node is back, while a channel opened afresh is served.
RECONNECT_AFTER_RECOVERIES = 6
# Unconfirmed events a queue that RabbitMQ keeps refusing may hold: past that, publishing to
# it waits (and times out), so one broken queue cannot fill the window every key shares.
REFUSING_QUEUE_ROOM = 100
# How often the I/O thread looks for an event whose confirm is overdue (``confirm_timeout``).
CONFIRM_CHECK_S = 1.0
# A queue whose confirm was overdue is *silent* until it confirms again, and its events go on
# a channel of its own, this many at a time. RabbitMQ 3.10 registers a channel with a quorum
# queue on its first publish there, synchronously, for up to net_ticktime + 5 s (65 s), and
# again on the next publish if that timed out: a queue that cannot reach a quorum froze the
# whole channel for minutes, and with it every other key of the connection (the cluster soak:
# hundreds of queues, no confirm at all, reconnect after reconnect). On a channel of its own it
# freezes only itself.
SILENT_QUEUE_IN_FLIGHT = 1

NewQueues = Callable[[dict[str, str | None]], None]


class PublisherLink:
    """Publishes ``Outgoing`` events with confirms on a background I/O thread."""

    def __init__(
        self,
        settings: Settings,
        stream: str,
        dead_letter_queue: str,
        queue_type: str,
        *,
        on_new_queues: NewQueues,
        request_lease: Callable[[str], None],
    ) -> None:
        self._settings = settings
        self._stream = stream
        self._dlq = dead_letter_queue
        self._queue_type = queue_type
        self._queue_args = keyed_queue_arguments(stream, queue_type)
        self._on_new_queues = on_new_queues
        self._request_lease = request_lease
        self._lease_s = settings.publish_lease_ms / 1000
        self.returned_events = 0  # events the broker returned and that were sent again
        self.resent_events = 0  # events sent again after a lost connection
        self.late_confirms = 0  # events confirmed after their queue's lease ran out: sent again
        self.overdue_reconnects = 0  # reconnects because a confirm did not come in time
        self.silent_channel_resets = 0  # a silent queue's own channel reopened, likewise
        self.reconnects = 0  # connections opened again after one was lost or closed

        # Shared with application threads, guarded by ``cond``.
        self.cond = threading.Condition()
        self._outbox: deque[Outgoing] = deque()
        self._unsettled = 0
        self._unsettled_by_queue: dict[str, int] = {}
        self._refusing: set[str] = set()  # queues refused over and over, until one confirm
        self._silent: set[str] = set()  # queues whose confirm was overdue, until one confirm
        self._wake_scheduled = False
        self._blocked = False
        self._failure: KeyqError | None = None
        self._ready = threading.Event()

        # Owned by the I/O thread.
        self._ioloop = IOLoop()
        self._connection: pika.SelectConnection | None = None
        self._channel: Any = None
        self._declarers: Declarers | None = None
        self._stopping = False
        self._next_tag = 1
        self._inflight: deque[Outgoing] = deque()
        self._by_number: dict[int, Outgoing] = {}
        self._queues: dict[str, QueueState] = {}
        self._resend: list[Outgoing] = []
        self._aside: dict[str, AsideChannel] = {}  # silent queue -> its own channel
        # Queues whose node is down, kept across reconnects, so that their events wait while
        # every other queue's flow; and the queues being declared aside until they answer.
        self._unreachable: dict[str, str] = {}  # base name -> the incarnation that was down
        # queue -> the token of its one live chain of declarations (a new connection starts
        # a new chain; an older chain that sees another token stops).
        self._probing: dict[str, object] = {}
        self._lost_at: float | None = None
        self._attempt = 0
        self._last_settled_at = time.monotonic()
        self._stuck_reported_at = 0.0
        self._thread = threading.Thread(target=self._run, name="keyq-producer-io", daemon=True)

    # ----------------------------------------------------------- application threads
    def start(self) -> None:
        """Connect, or raise the reason the broker cannot be used."""
        self._thread.start()
        limit = self._settings.connect_timeout * 3 + 1
        if not self._ready.wait(limit):
            self.stop()
            raise BrokerUnavailable(f"RabbitMQ did not answer within {limit:.0f} s")
        with self.cond:
            failure = self._failure
        if failure is not None:
            self.stop()
            raise failure

    def submit(self, message: Outgoing, deadline: float) -> None:
        """Queue an event for the I/O thread, waiting while the window is full or the
        broker blocks publishers. Call with ``cond`` held."""
        while True:
            if self._failure is not None:
                raise ProducerClosed(f"producer failed: {self._failure}") from self._failure
            queue = message.queue
            waiting_here = self._unsettled_by_queue.get(queue, 0)
            crowded = (
                queue in self._refusing or queue in self._silent
            ) and waiting_here >= REFUSING_QUEUE_ROOM
            if (
                self._unsettled < self._settings.confirm_window
                and not self._blocked
                and not crowded
            ):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if self._blocked:
                    why = "RabbitMQ is blocking publishers (flow control)"
                elif crowded and queue in self._refusing:
                    why = (
                        f"RabbitMQ keeps refusing events for {queue}: {waiting_here} of its "
                        f"events await confirmation (other keys are not held up)"
                    )
                elif crowded:
                    why = (
                        f"RabbitMQ stopped confirming events for {queue}: {waiting_here} of "
                        f"its events await confirmation (other keys are not held up)"
                    )
                else:
                    why = (
                        f"{self._unsettled} events await confirmation "
                        f"(window {self._settings.confirm_window})"
                    )
                raise PublishTimeout(f"publish timed out: {why}")
            self.cond.wait(remaining)
        self._unsettled += 1
        self._unsettled_by_queue[message.queue] = self._unsettled_by_queue.get(message.queue, 0) + 1
        self._outbox.append(message)
        if not self._wake_scheduled:
            self._wake_scheduled = True
            self._ioloop.add_callback_threadsafe(self._drain)

    def wait_settled(self, deadline: float | None) -> None:
        """Block until every submitted event is confirmed (or raise why not)."""
        with self.cond:
            while self._unsettled:
                if self._failure is not None:
                    raise ProducerClosed(
                        f"producer failed with {self._unsettled} events unconfirmed: "
                        f"{self._failure}"
                    ) from self._failure
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise PublishTimeout(f"flush timed out: {self._unsettled} events unconfirmed")
                self.cond.wait(remaining if remaining is not None else 1.0)

    @property
    def unsettled(self) -> int:
        return self._unsettled

    def unsettled_by_queue(self) -> dict[str, int]:
        with self.cond:
            return dict(self._unsettled_by_queue)

    @property
    def failure(self) -> KeyqError | None:
        return self._failure

    def stop(self) -> None:
        """Close the connection and end the I/O thread (unconfirmed events are abandoned)."""
        if self._thread.is_alive():
            self._ioloop.add_callback_threadsafe(self._shutdown)
            self._thread.join(timeout=self._settings.connect_timeout + 5)

    # ----------------------------------------------------------------- I/O thread
    def _run(self) -> None:
        try:
            self._connect()
            self._ioloop.call_later(CONFIRM_CHECK_S, self._watch_confirms)
            while True:
                try:
                    self._ioloop.start()
                    break
                except ValueError as exc:
                    if "getpeername" not in str(exc):
                        raise
                    # pika's connector raises out of the loop when the broker resets the
                    # socket between connect() and its first check: a failed attempt.
                    self._connection = None
                    self._on_open_error(None, ConnectionResetError(str(exc)))
        except Exception as exc:  # any bug here must fail the producer, loudly
            log.exception("producer I/O thread failed")
            reason = scrub(describe_exception(exc), self._settings.amqp_url)
            with self.cond:
                if self._failure is None:
                    self._failure = PublishError(f"producer I/O thread failed: {reason}")
                self.cond.notify_all()
            self._ready.set()
            with contextlib.suppress(Exception):
                if self._connection is not None and not self._connection.is_closed:
                    self._connection.close()
        finally:
            self._ioloop.close()

    def _connect(self) -> None:
        params = amqp_parameters(self._settings, f"producer-{self._stream}")
        self._connection = pika.SelectConnection(
            params,
            on_open_callback=self._on_open,
            on_open_error_callback=self._on_open_error,
            on_close_callback=self._on_closed,
            custom_ioloop=self._ioloop,
        )

    def _on_open(self, connection: pika.SelectConnection) -> None:
        connection.add_on_connection_blocked_callback(self._on_blocked)
        connection.add_on_connection_unblocked_callback(self._on_unblocked)
        connection.channel(on_open_callback=self._on_channel_open)
        self._declarers = Declarers(connection, self._on_channel_closed)

    def _on_channel_open(self, channel: Any) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(ack_nack_callback=self._on_confirm, callback=self._on_confirm_ok)

    def _on_confirm_ok(self, _frame: Any) -> None:
        # Aside: a dead-letter queue whose node is down must not stop publishing.
        self._probe(self._dlq, dead_letter_queue_arguments(self._queue_type))
        for queue in self._unreachable.values():
            self._probe(queue, self._queue_args)
        self._next_tag = 1
        self._attempt = 0
        if self._lost_at is not None:
            self.reconnects += 1
            log.info("reconnected to RabbitMQ; re-sending %d unconfirmed events", len(self._resend))
        self._lost_at = None
        resend, self._resend = self._resend, []
        self.resent_events += len(resend)
        for message in resend:
            self._send(message)
        self._ready.set()
        self._drain()

    def _on_open_error(self, connection: Any, error: BaseException) -> None:
        if connection is not None and connection is not self._connection:
            return  # a timer of an abandoned attempt: its failure was handled already
        failure = amqp_failure(
            error, self._settings.amqp_url, handshake_s=handshake_timeout(self._settings)
        )
        if not self._ready.is_set():
            self._fail(failure)
            return
        # Reconnecting: even a refusal of credentials that worked a moment ago is retried
        # (a broker starting or stopping can drop a handshake half-way) until
        # reconnect_timeout, then the producer fails with it.
        self._schedule_reconnect(failure)

    def _on_closed(self, connection: Any, reason: BaseException) -> None:
        if connection is not self._connection:
            return  # an abandoned attempt
        self._channel = None
        self._declarers = None
        if self._stopping:
            self._ioloop.stop()
            return
        if self._failure is not None:
            self._ioloop.stop()
            return
        text = scrub(describe_exception(reason), self._settings.amqp_url)
        log.warning("connection to RabbitMQ lost (%s); reconnecting", text)
        self._collect_unsettled()
        self._schedule_reconnect(BrokerUnavailable(f"connection to RabbitMQ lost: {text}"))

    def _on_channel_closed(self, _channel: Any, reason: BaseException) -> None:
        if self._stopping or self._connection is None or not self._connection.is_open:
            return
        code = getattr(reason, "reply_code", 0)
        text = getattr(reason, "reply_text", str(reason))
        if code in (403, 406):
            error: KeyqError = (
                AuthenticationFailed(f"RabbitMQ refused access: {text}")
                if code == 403
                else TopologyError(f"RabbitMQ refused a queue declaration: {text}")
            )
            self._fail(error)
            self._connection.close()
            return
        queue = unreachable_queue(code, text)
        if queue and base_queue_name(queue) not in self._unreachable:
            # A queue on a node that is down (a classic queue on a cluster): its events wait
            # and it is declared again aside until its node is back; the others go on.
            log.warning("queue %s is unavailable (%s); its events wait for it", queue, text)
            self._unreachable[base_queue_name(queue)] = queue
        # Start over on a fresh connection, re-sending what is unconfirmed.
        log.warning("channel closed by RabbitMQ (%s %s); reconnecting", code, text)
        self._connection.close()

    def _schedule_reconnect(self, failure: KeyqError) -> None:
        now = time.monotonic()
        if self._lost_at is None:
            self._lost_at = now
        if now - self._lost_at > self._settings.reconnect_timeout:
            self._fail(
                BrokerUnavailable(
                    f"RabbitMQ unreachable for over {self._settings.reconnect_timeout:.0f} s: "
                    f"{failure}"
                )
            )
            self._ioloop.stop()
            return
        delay = RECONNECT_DELAYS[min(self._attempt, len(RECONNECT_DELAYS) - 1)]
        self._attempt += 1
        self._ioloop.call_later(delay, self._connect)

    def _fail(self, failure: KeyqError) -> None:
        with self.cond:
            if self._failure is None:
                self._failure = failure
            self.cond.notify_all()
        self._ready.set()
        if self._connection is None or self._connection.is_closed:
            self._ioloop.stop()

    def _shutdown(self) -> None:
        self._stopping = True
        if self._connection is not None and not (
            self._connection.is_closed or self._connection.is_closing
        ):
            self._connection.close()
        else:
            self._ioloop.stop()

    def _on_blocked(self, _connection: Any, _frame: Any) -> None:
        log.warning("RabbitMQ is blocking publishers (resource alarm); publish will wait")
        with self.cond:
            self._blocked = True

    def _on_unblocked(self, _connection: Any, _frame: Any) -> None:
        log.info("RabbitMQ unblocked publishers")
        with self.cond:
            self._blocked = False
            self.cond.notify_all()

    # ----------------------------------------------------------- sending and confirms
    def _drain(self) -> None:
        with self.cond:
            self._wake_scheduled = False
        if self._channel is None or not self._channel.is_open or self._lost_at is not None:
            return
        outbox = self._outbox
        for _ in range(DRAIN_BATCH):
            try:
                message = outbox.popleft()
            except IndexError:
                break
            self._send(message)
        else:
            if outbox:
                with self.cond:
                    if not self._wake_scheduled:
                        self._wake_scheduled = True
                        self._ioloop.add_callback_threadsafe(self._drain)
        if len(self._queues) > FORGET_STATES_ABOVE:
            self._forget_quiet_queues()

    def _state(self, message: Outgoing) -> QueueState:
        state = self._queues.get(message.queue)
        if state is None:
            state = self._queues[message.queue] = QueueState(key=message.key)
            state.unreachable = message.queue in self._unreachable
        return state

    def _send(self, message: Outgoing) -> None:
        state = self._state(message)
        silent = message.queue in self._silent
        channel = self._channel
        blocked = state.waiting
        if silent and not blocked:
            channel = None if state.parked else self._aside_channel(message.queue)
        if blocked or channel is None or not channel.is_open:
            # A closed channel (a lease granted while reconnecting): parked events are
            # collected and re-sent in order once the connection is back. A silent queue's
            # events wait for its own channel to have room (``_release_parked``).
            state.parked.append(message)
            return
        now = time.monotonic()
        if now >= state.lease_until:
            state.held = True
            state.parked.append(message)
            self._ask_lease(message.queue, state)
            return
        if now >= state.lease_until - self._lease_s / 2:
            self._ask_lease(message.queue, state)  # renew ahead, without holding anything
        name = incarnation_name(message.queue, state.incarnation)
        if not state.declared:
            if not silent and self._declare_apart(message.queue, state, name):
                state.parked.append(message)  # sent once its queue exists
                return
            # nowait: the broker handles the declare before the publish that follows it on
            # this channel, so no round trip is spent per new key.
            channel.queue_declare(name, durable=True, arguments=self._queue_args)
            state.declared = True
        if silent:
            aside = self._aside[message.queue]
            message.tag = aside.next_tag
            aside.next_tag += 1
            aside.inflight.append(message)
        else:
            message.tag = self._next_tag
            self._next_tag += 1
            self._inflight.append(message)
        message.returned = False
        message.settled = False
        message.sent_at = now
        message.sent_to = name
        channel.basic_publish("", name, message.body, message.properties, mandatory=True)
        self._by_number[message.number] = message
        state.inflight += 1

    def _declare_apart(self, queue: str, state: QueueState, name: str) -> bool:
        """Declare a new key's queue on a declaring channel (``keyq.producer.declarers``);
        its events park until the broker answers. False when no such channel is open."""
        declarers = self._declarers
        if declarers is None:
            return False

        def on_declared() -> None:
            if self._queues.get(queue) is not state or state.declaring != name:
                return  # reconnected or recovered since: that state is gone
            state.declaring = None
            state.declared = incarnation_name(queue, state.incarnation) == name
            log.debug("declared %s: %d events parked", name, len(state.parked))
            self._release_parked(queue)

        if not declarers.declare(name, self._queue_args, on_declared):
            return False
        log.debug("declaring %s apart", name)
        state.declaring = name
        return True

    def _reset_overdue_declarations(self) -> None:
        """A declaration unanswered past ``confirm_timeout`` (its queue is stuck): that queue
        goes silent, as if its confirm were overdue, and is declared on a channel of its own
        with its events; the declarations that waited behind it are asked again."""
        if self._declarers is None or self._blocked:
            return
        overdue = self._declarers.overdue(self._settings.confirm_timeout)
        if not (overdue.stuck or overdue.behind):
            return
        log.warning(
            "declaring %s went unanswered for over %.0f s; it is declared on a channel of its "
            "own, and %d declarations that waited behind it are sent again",
            ", ".join(overdue.stuck),
            self._settings.confirm_timeout,
            len(overdue.behind),
        )
        stuck = {base_queue_name(name) for name in overdue.stuck}
        with self.cond:
            self._silent |= stuck
        for name in [*overdue.stuck, *overdue.behind]:
            queue = base_queue_name(name)
            state = self._queues.get(queue)
            if state is not None and state.declaring == name:
                state.declaring = None
                self._release_parked(queue)

    def _on_return(self, _channel: Any, _method: Any, properties: Any, _body: bytes) -> None:
        message_id = getattr(properties, "message_id", None) or ""
        number = message_id.rpartition(":")[2]
        message = self._by_number.get(int(number)) if number.isdigit() else None
        if message is None:
            return
        message.returned = True
        self._queues[message.queue].recovering = True
        log.debug("event %d returned by %s", message.number, message.sent_to)

    def _on_confirm(self, frame: Any) -> None:
        self._settle_confirmed(self._inflight, frame)

    def _settle_confirmed(self, inflight: deque[Outgoing], frame: Any) -> None:
        """Settle what one ack or nack of a channel covers (``inflight``: that channel's
        events in tag order, tags consecutive)."""
        method = frame.method
        nacked = isinstance(method, pika.spec.Basic.Nack)
        tag = method.delivery_tag
        if not inflight:
            return
        to_recover: list[str] = []
        published: list[str] = []  # the queue of each event now published
        if method.multiple:
            for message in inflight:
                if message.tag > tag:
                    break
                if not message.settled and self._settle(message, nacked, to_recover):
                    published.append(message.queue)
        else:
            index = tag - inflight[0].tag
            if 0 <= index < len(inflight):
                message = inflight[index]
                if not message.settled and self._settle(message, nacked, to_recover):
                    published.append(message.queue)
        while inflight and inflight[0].settled:
            inflight.popleft()
        self._after_settling(published, to_recover)

    def _after_settling(self, published: list[str], to_recover: list[str]) -> None:
        """What follows confirms: the window's counts, silent queues heard again (their own
        channel closed, their parked events sent on the main one), recoveries."""
        self._last_settled_at = time.monotonic()
        if published:
            heard_again = set(published) & self._silent
            with self.cond:
                self._unsettled -= len(published)
                for queue in published:
                    left = self._unsettled_by_queue[queue] - 1
                    if left:
                        self._unsettled_by_queue[queue] = left
                    else:
                        del self._unsettled_by_queue[queue]
                    self._refusing.discard(queue)
                self._silent -= heard_again
                self.cond.notify_all()
            for queue in heard_again:
                log.info("queue %s confirms again", queue)
                self._close_aside(queue)
                self._release_parked(queue)
        for queue in to_recover:
            state = self._queues.get(queue)
            if state is not None and state.recovering and state.inflight == 0:
                if state.recoveries >= RECONNECT_AFTER_RECOVERIES and queue not in self._silent:
                    # (A silent queue is refused on its own channel: the others flow.)
                    self._reconnect_refused(queue)
                    return
                delay = RECOVERY_DELAYS[min(state.recoveries, len(RECOVERY_DELAYS) - 1)]
                state.recoveries += 1
                if delay:
                    self._ioloop.call_later(
                        delay, lambda q=queue, s=state: self._recover_later(q, s)
                    )
                else:
                    self._recover(queue, state)

    def _settle(self, message: Outgoing, nacked: bool, to_recover: list[str]) -> bool:
        """Mark one event settled; True if it is now published, False if it must go again."""
        message.settled = True
        self._by_number.pop(message.number, None)
        state = self._queues[message.queue]
        state.inflight -= 1
        published = not (message.returned or nacked)
        if published and time.monotonic() >= state.lease_until:
            # RabbitMQ confirms an event whose queue was deleted after routing it: a confirm
            # proves the event reached the queue only while a lease held its deleter off
            # (the grace outlasts every lease granted before a mark). Later, send it again;
            # a copy of an event already applied is dropped by its seq.
            published = False
            self.late_confirms += 1
            log.debug("event %d to %s confirmed after its lease", message.number, message.sent_to)
        if published:
            state.recoveries = 0
            if not state.registered:
                state.registered = True
                self._on_new_queues({message.sent_to: state.key})
        else:
            state.recovering = True
            state.returned.append(message)
            self.returned_events += message.returned or nacked
        if state.recovering and state.inflight == 0:
            to_recover.append(message.queue)
        return published

    def _reconnect_refused(self, queue: str) -> None:
        """Start over on a fresh connection (the next node): every unconfirmed event is
        collected and re-sent in order, the refused ones included."""
        connection = self._connection
        if connection is None or not connection.is_open:
            return
        log.warning("RabbitMQ keeps refusing events for %s on this connection; reconnecting", queue)
        with self.cond:
            self._refusing.add(queue)  # publishing to it waits once it holds its room
        closing: pika.SelectConnection = connection
        closing.close()
        self._ioloop.call_later(
            self._settings.connect_timeout, lambda: self._drop_if_still_closing(closing)
        )

    def _recover_later(self, queue: str, state: QueueState) -> None:
        """A delayed recovery, unless a reconnect collected the queue's events meanwhile."""
        if self._queues.get(queue) is state and state.recovering and state.inflight == 0:
            self._recover(queue, state)

    def _recover(self, queue: str, state: QueueState) -> None:
        """Re-declare a deleted queue and re-send its returned events, then the parked ones."""
        returned = sorted(state.returned, key=lambda message: message.number)
        parked = state.parked
        state.returned = []
        state.parked = deque()
        state.recovering = False
        state.declared = False
        state.registered = False
        log.debug("queue %s was deleted; re-declaring and re-sending %d", queue, len(returned))
        for message in returned:
            # A fresh record: the settled one may still sit in the in-flight window (behind
            # an older unconfirmed event), where its delivery tag must stay what it was.
            self._send(dataclasses.replace(message, tag=0, returned=False, settled=False))
        for message in parked:
            self._send(message)

    def _collect_unsettled(self) -> None:
        """After a lost connection: everything not confirmed goes out again, in order."""
        pending = [message for message in self._inflight if not message.settled]
        for aside in self._aside.values():
            pending.extend(message for message in aside.inflight if not message.settled)
        self._aside.clear()
        for state in self._queues.values():
            pending.extend(state.returned)
            pending.extend(state.parked)
        pending.extend(self._resend)
        pending.sort(key=lambda message: message.number)
        self._resend = pending
        self._inflight.clear()
        self._by_number.clear()
        self._queues.clear()

    # ------------------------------------------------------------------ silent queues
    def _aside_channel(self, queue: str) -> Any:
        """The silent ``queue``'s own channel if it has room for an event now, else None
        (opening it when there is none yet)."""
        aside = self._aside.get(queue)
        if aside is None:
            self._open_aside(queue)
            return None
        channel = aside.channel
        if (
            channel is None
            or not aside.ready
            or not channel.is_open
            or len(aside.inflight) >= SILENT_QUEUE_IN_FLIGHT
        ):
            return None
        return channel

    def _open_aside(self, queue: str) -> None:
        connection = self._connection
        if connection is None or not connection.is_open or self._stopping:
            return  # its events wait in ``parked``; a reconnect collects them
        aside = self._aside[queue] = AsideChannel()

        def on_open(channel: Any) -> None:
            if self._aside.get(queue) is not aside:
                with contextlib.suppress(Exception):
                    channel.close()
                return
            aside.channel = channel
            channel.add_on_close_callback(lambda _ch, why: self._on_aside_closed(queue, aside, why))
            channel.add_on_return_callback(self._on_return)
            channel.confirm_delivery(
                ack_nack_callback=lambda frame: self._on_aside_confirm(queue, aside, frame),
                callback=lambda _frame: self._on_aside_ready(queue, aside),
            )

        connection.channel(on_open_callback=on_open)

    def _on_aside_ready(self, queue: str, aside: AsideChannel) -> None:
        if self._aside.get(queue) is aside:
            aside.ready = True
            self._release_parked(queue)

    def _on_aside_confirm(self, queue: str, aside: AsideChannel, frame: Any) -> None:
        if self._aside.get(queue) is aside:
            self._settle_confirmed(aside.inflight, frame)
        if queue in self._silent:
            self._release_parked(queue)  # the next one goes

    def _on_aside_closed(self, queue: str, aside: AsideChannel, reason: BaseException) -> None:
        """Its unconfirmed events go back in front of the queue's parked ones; unless the
        whole connection is going (which collects them), it is opened again a moment later."""
        if self._aside.get(queue) is not aside:
            return  # closed by us, or collected with its connection
        del self._aside[queue]
        pending = [message for message in aside.inflight if not message.settled]
        aside.inflight.clear()
        if pending:
            state = self._queues.setdefault(queue, QueueState(key=pending[0].key))
            for message in pending:
                self._by_number.pop(message.number, None)
            state.inflight -= len(pending)
            state.parked = deque(
                sorted([*pending, *state.parked], key=lambda message: message.number)
            )
        connection = self._connection
        if self._stopping or connection is None or not connection.is_open:
            return
        log.warning(
            "the channel of silent queue %s closed (%s); opening it again",
            queue,
            describe_exception(reason),
        )
        self._ioloop.call_later(1.0, lambda: self._release_parked(queue))

    def _reset_overdue_asides(self, now: float) -> None:
        """A silent queue's event unconfirmed past ``confirm_timeout`` on its own channel: that
        channel is closed (only it), and the event goes again on a fresh one."""
        for queue, aside in list(self._aside.items()):
            channel = aside.channel
            if not aside.inflight or channel is None or not channel.is_open:
                continue
            waited = now - aside.inflight[0].sent_at
            if waited < self._settings.confirm_timeout:
                continue
            self.silent_channel_resets += 1
            log.warning(
                "silent queue %s has not confirmed for %.0f s on its own channel; sending "
                "again on a fresh one",
                queue,
                waited,
            )
            with contextlib.suppress(Exception):
                channel.close()

    def _close_aside(self, queue: str) -> None:
        """A silent queue confirmed: close its channel once nothing is in flight there."""
        aside = self._aside.get(queue)
        if aside is None or aside.inflight:
            return
        del self._aside[queue]
        if aside.channel is not None and aside.channel.is_open:
            with contextlib.suppress(Exception):
                aside.channel.close()

    # ------------------------------------------------------------------ overdue confirms
    def _watch_confirms(self) -> None:
        """Reconnect when the oldest event sent on this connection has waited past
        ``confirm_timeout`` for its confirm. A quorum queue that lost its leader can leave a
        channel's publishes unanswered for good; a fresh connection, to the next node, sends
        them again (a copy of an event that did arrive is dropped by its seq)."""
        if self._stopping or self._failure is not None:
            return
        self._ioloop.call_later(CONFIRM_CHECK_S, self._watch_confirms)
        now = time.monotonic()
        self._report_if_stuck(now)
        self._reset_overdue_asides(now)
        self._reset_overdue_declarations()
        connection = self._connection
        if (
            connection is None
            or not connection.is_open
            or self._blocked  # flow control delays confirms on purpose
            or self._lost_at is not None
        ):
            return
        oldest = next((message for message in self._inflight if not message.settled), None)
        if oldest is None:
            return
        waited = now - oldest.sent_at
        if waited < self._settings.confirm_timeout:
            return
        waiting = {message.queue for message in self._inflight if not message.settled}
        unconfirmed = sum(not message.settled for message in self._inflight)
        self.overdue_reconnects += 1
        log.warning(
            "%d events of %d queues await their confirms on this connection, the oldest (for "
            "%s) for %.0f s; reconnecting to send them again, each of those queues on a channel "
            "of its own, %d at a time, until it confirms",
            unconfirmed,
            len(waiting),
            oldest.queue,
            waited,
            SILENT_QUEUE_IN_FLIGHT,
        )
        # Any of them may be the one that stopped the connection: each is silent until it
        # confirms again, which the others do at once on the new connection.
        with self.cond:
            self._silent |= waiting  # publishing to them waits once each holds its room
        closing: pika.SelectConnection = connection
        closing.close()
        self._ioloop.call_later(
            self._settings.connect_timeout, lambda: self._drop_if_still_closing(closing)
        )

    def _drop_if_still_closing(self, connection: pika.SelectConnection) -> None:
        """RabbitMQ stops reading a connection whose channel is held by flow control (a queue
        that does not answer), so it never answers the close either: drop the socket, as
        pika itself does on a missed heartbeat (``_terminate_stream``, a pika internal; pika
        is pinned below 1.5, and the test of silent queues exercises it)."""
        current = self._connection
        if current is None or current is not connection or not current.is_closing:
            return
        log.warning("RabbitMQ did not answer the close; dropping the connection")
        current._terminate_stream(
            pika.exceptions.StreamLostError("RabbitMQ did not answer the close")
        )

    def _release_parked(self, queue: str) -> None:
        """Send a queue's parked events now that nothing else holds them (those beyond a
        silent queue's room park again, in order)."""
        state = self._queues.get(queue)
        if state is None or state.waiting:
            return
        parked, state.parked = state.parked, deque()
        for message in parked:
            self._send(message)

    def _report_if_stuck(self, now: float) -> None:
        """Say where unconfirmed events wait when nothing has settled for a long time, so a
        stall can be told apart: leases, a deleted queue, a node that is down, the broker."""
        if not self._unsettled:
            self._last_settled_at = now  # nothing owed: the wait starts with the next event
            return
        quiet_for = now - self._last_settled_at
        if (
            quiet_for < 2 * self._settings.confirm_timeout
            or now - self._stuck_reported_at < self._settings.confirm_timeout
        ):
            return
        self._stuck_reported_at = now
        states = self._queues.values()
        log.warning(
            "no confirm for %.0f s with %d events unconfirmed: %d in flight (%d on the channels "
            "of %d silent queues), %d waiting to be sent, %d to re-send after a reconnect; "
            "parked: %d for a lease (%d queues), %d behind a deleted queue (%d queues), %d for "
            "a node that is down (%d queues)",
            quiet_for,
            self._unsettled,
            sum(not message.settled for message in self._inflight)
            + sum(len(aside.inflight) for aside in self._aside.values()),
            sum(len(aside.inflight) for aside in self._aside.values()),
            len(self._aside),
            len(self._outbox),
            len(self._resend),
            sum(len(state.parked) for state in states if state.held),
            sum(1 for state in states if state.held),
            sum(len(state.parked) + len(state.returned) for state in states if state.recovering),
            sum(1 for state in states if state.recovering),
            sum(len(state.parked) for state in states if state.unreachable),
            sum(1 for state in states if state.unreachable),
        )

    # ------------------------------------------------------------- unreachable queues
    def _probe(self, queue: str, arguments: dict[str, Any]) -> None:
        """Start declaring ``queue`` aside on this connection, in place of any earlier chain:
        one that a lost connection cut off must not leave the queue waiting for good."""
        token = object()
        self._probing[queue] = token
        self._declare_aside(queue, arguments, token, 0)

    def _declare_aside(
        self, queue: str, arguments: dict[str, Any], token: object, attempt: int
    ) -> None:
        """Declare ``queue`` on a channel of its own, so that a 404 (its node is down)
        closes only that channel; retried with backoff until it works, or until the next
        connection starts a chain of its own (``_probe``)."""
        if self._stopping or self._probing.get(queue) is not token:
            return  # stopping, declared, or superseded by a newer connection's chain
        connection = self._connection
        delay = PROBE_DELAYS[min(attempt, len(PROBE_DELAYS) - 1)]

        def again() -> None:  # called at most once: each way out below takes one path
            self._ioloop.call_later(
                delay, lambda: self._declare_aside(queue, arguments, token, attempt + 1)
            )

        if connection is None or not connection.is_open:
            again()
            return
        declared: list[bool] = []

        def on_declared(channel: Any) -> None:
            declared.append(True)
            if self._probing.get(queue) is token:
                del self._probing[queue]
            with contextlib.suppress(Exception):
                channel.close()
            self._reachable(queue)

        def on_closed(_channel: Any, reason: BaseException) -> None:
            if declared or self._stopping:
                return
            if attempt == 0:
                log.warning("%s is unavailable, retrying: %s", queue, reason)
            again()

        def on_open(channel: Any) -> None:
            channel.queue_declare(
                queue, durable=True, arguments=arguments, callback=lambda _f: on_declared(channel)
            )

        try:
            channel = connection.channel(on_open_callback=on_open)
        except pika.exceptions.AMQPError:
            again()
            return
        # Registered before the channel opens: a connection lost while it is still opening
        # closes it too, and the chain must go on.
        channel.add_on_close_callback(on_closed)

    def _reachable(self, queue: str) -> None:
        """``queue`` was declared: its waiting events go, in order."""
        base = base_queue_name(queue)
        if self._unreachable.get(base) != queue:
            return
        del self._unreachable[base]
        log.info("queue %s is available again", queue)
        state = self._queues.get(base)
        if state is None:
            return
        state.unreachable = False
        state.declared = True
        if not (state.recovering or state.held):
            parked, state.parked = state.parked, deque()
            for message in parked:
                self._send(message)

    # ------------------------------------------------------------------------ leases
    def _ask_lease(self, queue: str, state: QueueState) -> None:
        if not state.leasing:
            state.leasing = True
            self._request_lease(queue)

    def apply_leases(self, granted: dict[str, int | None], issued_at: float) -> None:
        """From the Redis thread: hand lease results to the I/O thread."""
        # If the I/O loop is already gone there is nothing left to publish.
        with contextlib.suppress(RuntimeError, OSError, AttributeError):
            self._ioloop.add_callback_threadsafe(lambda: self._apply_leases(granted, issued_at))

    def _apply_leases(self, granted: dict[str, int | None], issued_at: float) -> None:
        for queue, incarnation in granted.items():
            state = self._queues.get(queue)
            if state is None:
                continue
            state.leasing = False
            if incarnation is not None:
                if incarnation != state.incarnation:
                    # Deleted and moved on since (quorum): declared anew under the next name.
                    state.incarnation = incarnation
                    state.declared = False
                    state.registered = False
                state.lease_until = issued_at + self._lease_s
                self._ioloop.call_later(
                    self._lease_s / 2, lambda q=queue, s=state: self._renew_in_flight(q, s)
                )
                if state.held:
                    state.held = False
                    if not state.recovering:
                        parked, state.parked = state.parked, deque()
                        for message in parked:
                            self._send(message)
            else:
                # Being retired: hold its events, and declare it again once the mark is gone.
                log.debug("queue %s is being retired: its events wait", queue)
                state.lease_until = 0.0
                state.held = True
                state.declared = False
                state.registered = False
                self._ioloop.call_later(self._lease_s / 4, lambda q=queue: self._retry_lease(q))

    def _renew_in_flight(self, queue: str, state: QueueState) -> None:
        """Keep a queue leased while its events await their confirms, so a slow confirm is
        not mistaken for one that came after its queue was deleted (see ``_settle``)."""
        if (
            self._queues.get(queue) is state
            and state.inflight > 0
            and not state.held
            and time.monotonic() >= state.lease_until - self._lease_s / 2
        ):
            self._ask_lease(queue, state)

    def _retry_lease(self, queue: str) -> None:
        state = self._queues.get(queue)
        if state is not None and state.held:
            self._ask_lease(queue, state)

    def _forget_quiet_queues(self) -> None:
        """Bound memory with many keys: drop states of queues with nothing in flight."""
        for queue in [queue for queue, state in self._queues.items() if state.quiet]:
            del self._queues[queue]
