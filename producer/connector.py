"""The producer's connection to RabbitMQ and its publishing channel, on the I/O thread: opened,
lost and opened again (until ``reconnect_timeout``), or failed for good.

Only this thread touches pika objects; the loop runs in ``run``, the I/O thread's target. The
connector is the top of the I/O thread's parts: it hands each new connection and channel to
the others (through ``IoContext``) and what the broker says to the part concerned.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import pika
import pika.exceptions

from keyq.broker.backoff import Backoff
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
    PublishError,
    TopologyError,
)
from keyq.broker.queue_refusals import unreachable_queue
from keyq.broker.urls import scrub
from keyq.producer.context import IoContext
from keyq.producer.declarers import Declarers
from keyq.producer.ledger import ConfirmLedger
from keyq.producer.overdue import ConfirmWatch
from keyq.producer.probes import Probes
from keyq.producer.publisher import Publisher
from keyq.producer.recovery import Recovery
from keyq.producer.stalled import StalledQueues

log = logging.getLogger("keyq.producer")

# Waits before connecting again: from 0.1 s, doubling up to 2 s, with jitter so that the
# producers of many processes that lost the broker together do not come back in lockstep.
RECONNECT_FIRST_S = 0.1
RECONNECT_MAX_S = 2.0


class Connector:
    """Opens the connection, its publishing channel and its declaring channels."""

    def __init__(
        self,
        ctx: IoContext,
        stream: str,
        *,
        ledger: ConfirmLedger,
        publisher: Publisher,
        recovery: Recovery,
        stalled: StalledQueues,
        probes: Probes,
        watch: ConfirmWatch,
    ) -> None:
        self._ctx = ctx
        self._stream = stream
        self._ledger = ledger
        self._publisher = publisher
        self._recovery = recovery
        self._stalled = stalled
        self._probes = probes
        self._watch = watch
        self._delays = Backoff(RECONNECT_FIRST_S, RECONNECT_MAX_S)
        self.ready = threading.Event()  # connected once, or failed
        self.reconnects = 0  # connections opened again after one was lost or closed

    def run(self) -> None:
        ctx = self._ctx
        try:
            self._connect()
            self._watch.start()
            while True:
                try:
                    ctx.ioloop.start()
                    break
                except ValueError as exc:
                    if "getpeername" not in str(exc):
                        raise
                    # pika's connector raises out of the loop when the broker resets the
                    # socket between connect() and its first check: a failed attempt.
                    ctx.connection = None
                    self._on_open_error(None, ConnectionResetError(str(exc)))
        except Exception as exc:  # any bug here must fail the producer, loudly
            log.exception("producer I/O thread failed")
            reason = scrub(describe_exception(exc), ctx.settings.amqp_url)
            ctx.window.fail(PublishError(f"producer I/O thread failed: {reason}"))
            self.ready.set()
            with contextlib.suppress(Exception):
                if ctx.connection is not None and not ctx.connection.is_closed:
                    ctx.connection.close()
        finally:
            ctx.ioloop.close()

    def _connect(self) -> None:
        ctx = self._ctx
        params = amqp_parameters(ctx.settings, f"producer-{self._stream}")
        ctx.connection = pika.SelectConnection(
            params,
            on_open_callback=self._on_open,
            on_open_error_callback=self._on_open_error,
            on_close_callback=self._on_closed,
            custom_ioloop=ctx.ioloop,
        )

    def _on_open(self, connection: pika.SelectConnection) -> None:
        connection.add_on_connection_blocked_callback(self._on_blocked)
        connection.add_on_connection_unblocked_callback(self._on_unblocked)
        connection.channel(on_open_callback=self._on_channel_open)
        self._ctx.declarers = Declarers(connection, self._on_channel_closed)

    def _on_channel_open(self, channel: Any) -> None:
        self._ctx.channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._ledger.on_return)
        channel.confirm_delivery(ack_nack_callback=self.on_confirm, callback=self._on_confirm_ok)

    def on_confirm(self, frame: Any) -> None:
        """An ack or nack of the publishing channel."""
        self._recovery.confirmed(self._ledger.inflight, frame, self._stalled.heard_again)

    def _on_confirm_ok(self, _frame: Any) -> None:
        ctx = self._ctx
        self._probes.probe_all()
        self._delays.reset()
        if ctx.lost_at is not None:
            self.reconnects += 1
            ctx.meter.reconnected()
            log.info(
                "reconnected to RabbitMQ; re-sending %d unconfirmed events",
                len(self._recovery.resend),
            )
        ctx.lost_at = None
        ctx.window.disconnected_since = None
        self._stalled.open_all()
        self._recovery.resend_collected()
        self.ready.set()
        self._publisher.drain()

    def _on_open_error(self, connection: Any, error: BaseException) -> None:
        if connection is not None and connection is not self._ctx.connection:
            return  # a timer of an abandoned attempt: its failure was handled already
        if self._ctx.stopping:  # close() aborted this attempt: no other is to follow
            self._ctx.ioloop.stop()
            return
        settings = self._ctx.settings
        failure = amqp_failure(error, settings.amqp_url, handshake_s=handshake_timeout(settings))
        if not self.ready.is_set():
            self.fail(failure)
            return
        # Reconnecting: even a refusal of credentials that worked a moment ago is retried
        # (a broker starting or stopping can drop a handshake half-way) until
        # reconnect_timeout, then the producer fails with it.
        self._schedule_reconnect(failure)

    def _on_closed(self, connection: Any, reason: BaseException) -> None:
        if connection is not self._ctx.connection:
            return  # an abandoned attempt
        ctx = self._ctx
        ctx.channel = None
        ctx.declarers = None
        if ctx.stopping or ctx.window.failure is not None:
            ctx.ioloop.stop()
            return
        text = scrub(describe_exception(reason), ctx.settings.amqp_url)
        log.warning("connection to RabbitMQ lost (%s); reconnecting", text)
        self._recovery.collect_unsettled()
        # A block was this connection's: the next one is told again if an alarm still holds,
        # and until then publishing goes on into the window.
        ctx.window.set_blocked(False)
        self._schedule_reconnect(BrokerUnavailable(f"connection to RabbitMQ lost: {text}"))

    def _on_channel_closed(self, _channel: Any, reason: BaseException) -> None:
        connection = self._ctx.connection
        if self._ctx.stopping or connection is None or not connection.is_open:
            return
        code = getattr(reason, "reply_code", 0)
        text = getattr(reason, "reply_text", str(reason))
        if code in (403, 406):
            error: KeyqError = (
                AuthenticationFailed(f"RabbitMQ refused access: {text}")
                if code == 403
                else TopologyError(f"RabbitMQ refused a queue declaration: {text}")
            )
            self.fail(error)
            connection.close()
            return
        queue = unreachable_queue(code, text)
        if queue:
            # A queue on a node that is down (a classic queue on a cluster): its events wait
            # and it is probed until its node is back; the others go on.
            self._probes.mark_unreachable(queue, text)
        # Start over on a fresh connection, re-sending what is unconfirmed.
        log.warning("channel closed by RabbitMQ (%s %s); reconnecting", code, text)
        connection.close()

    def _schedule_reconnect(self, failure: KeyqError) -> None:
        ctx = self._ctx
        now = time.monotonic()
        if ctx.lost_at is None:
            ctx.lost_at = now
            ctx.window.disconnected_since = now
        limit = ctx.settings.reconnect_timeout
        if now - ctx.lost_at > limit:
            self.fail(BrokerUnavailable(f"RabbitMQ unreachable for over {limit:.0f} s: {failure}"))
            ctx.ioloop.stop()
            return
        ctx.ioloop.call_later(self._delays.next(), self._connect)

    def fail(self, failure: KeyqError) -> None:
        self._ctx.window.fail(failure)
        self.ready.set()
        if self._ctx.connection is None or self._ctx.connection.is_closed:
            self._ctx.ioloop.stop()

    def shutdown(self) -> None:
        self._ctx.stopping = True
        connection = self._ctx.connection
        if connection is not None and connection.is_open:
            connection.close()  # ``_on_closed`` then stops the loop
        else:
            # An attempt still opening is dropped with the loop: pika's close() during its
            # handshake fails an assertion in pika (pika/pika#970).
            self._ctx.ioloop.stop()

    def _on_blocked(self, _connection: Any, _frame: Any) -> None:
        log.warning("RabbitMQ is blocking publishers (resource alarm); publish will wait")
        self._ctx.window.set_blocked(True)

    def _on_unblocked(self, _connection: Any, _frame: Any) -> None:
        log.info("RabbitMQ unblocked publishers")
        self._ctx.window.set_blocked(False)
