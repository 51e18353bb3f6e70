"""The producer's connection to RabbitMQ and its publishing channel, on the I/O thread: opened,
lost and opened again (until ``reconnect_timeout``), or failed for good.

Only this thread touches pika objects; the loop runs in ``run``, the I/O thread's target.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

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
from keyq.producer.declarers import Declarers

if TYPE_CHECKING:
    from keyq.producer.link import PublisherLink

log = logging.getLogger("keyq.producer")

# Waits before connecting again: from 0.1 s, doubling up to 2 s, with jitter so that the
# producers of many processes that lost the broker together do not come back in lockstep.
RECONNECT_FIRST_S = 0.1
RECONNECT_MAX_S = 2.0


class Connector:
    """Owns the connection, its publishing channel and its declaring channels."""

    def __init__(self, link: PublisherLink) -> None:
        self._link = link
        self.connection: pika.SelectConnection | None = None
        self.channel: Any = None
        self.declarers: Declarers | None = None
        self.stopping = False
        self.lost_at: float | None = None  # when the connection was lost, until it is back
        self._delays = Backoff(RECONNECT_FIRST_S, RECONNECT_MAX_S)
        self.ready = threading.Event()  # connected once, or failed
        self.reconnects = 0  # connections opened again after one was lost or closed

    def run(self) -> None:
        link = self._link
        try:
            self._connect()
            link.watch.start()
            while True:
                try:
                    link.ioloop.start()
                    break
                except ValueError as exc:
                    if "getpeername" not in str(exc):
                        raise
                    # pika's connector raises out of the loop when the broker resets the
                    # socket between connect() and its first check: a failed attempt.
                    self.connection = None
                    self._on_open_error(None, ConnectionResetError(str(exc)))
        except Exception as exc:  # any bug here must fail the producer, loudly
            log.exception("producer I/O thread failed")
            reason = scrub(describe_exception(exc), link.settings.amqp_url)
            link.window.fail(PublishError(f"producer I/O thread failed: {reason}"))
            self.ready.set()
            with contextlib.suppress(Exception):
                if self.connection is not None and not self.connection.is_closed:
                    self.connection.close()
        finally:
            link.ioloop.close()

    def _connect(self) -> None:
        link = self._link
        params = amqp_parameters(link.settings, f"producer-{link.stream}")
        self.connection = pika.SelectConnection(
            params,
            on_open_callback=self._on_open,
            on_open_error_callback=self._on_open_error,
            on_close_callback=self._on_closed,
            custom_ioloop=link.ioloop,
        )

    def _on_open(self, connection: pika.SelectConnection) -> None:
        connection.add_on_connection_blocked_callback(self._on_blocked)
        connection.add_on_connection_unblocked_callback(self._on_unblocked)
        connection.channel(on_open_callback=self._on_channel_open)
        self.declarers = Declarers(connection, self._on_channel_closed)

    def _on_channel_open(self, channel: Any) -> None:
        sender = self._link.sender
        self.channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(sender.on_return)
        channel.confirm_delivery(ack_nack_callback=sender.on_confirm, callback=self._on_confirm_ok)

    def _on_confirm_ok(self, _frame: Any) -> None:
        link = self._link
        link.probes.probe_all()
        self._delays.reset()
        if self.lost_at is not None:
            self.reconnects += 1
            link.meter.reconnected()
            log.info(
                "reconnected to RabbitMQ; re-sending %d unconfirmed events", len(link.sender.resend)
            )
        self.lost_at = None
        link.window.disconnected_since = None
        link.sender.resend_collected()
        self.ready.set()
        link.sender.drain()

    def _on_open_error(self, connection: Any, error: BaseException) -> None:
        if connection is not None and connection is not self.connection:
            return  # a timer of an abandoned attempt: its failure was handled already
        settings = self._link.settings
        failure = amqp_failure(error, settings.amqp_url, handshake_s=handshake_timeout(settings))
        if not self.ready.is_set():
            self.fail(failure)
            return
        # Reconnecting: even a refusal of credentials that worked a moment ago is retried
        # (a broker starting or stopping can drop a handshake half-way) until
        # reconnect_timeout, then the producer fails with it.
        self._schedule_reconnect(failure)

    def _on_closed(self, connection: Any, reason: BaseException) -> None:
        if connection is not self.connection:
            return  # an abandoned attempt
        link = self._link
        self.channel = None
        self.declarers = None
        if self.stopping or link.window.failure is not None:
            link.ioloop.stop()
            return
        text = scrub(describe_exception(reason), link.settings.amqp_url)
        log.warning("connection to RabbitMQ lost (%s); reconnecting", text)
        link.sender.collect_unsettled()
        # A block was this connection's: the next one is told again if an alarm still holds,
        # and until then publishing goes on into the window.
        link.window.set_blocked(False)
        self._schedule_reconnect(BrokerUnavailable(f"connection to RabbitMQ lost: {text}"))

    def _on_channel_closed(self, _channel: Any, reason: BaseException) -> None:
        connection = self.connection
        if self.stopping or connection is None or not connection.is_open:
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
            # and it is declared again aside until its node is back; the others go on.
            self._link.probes.mark_unreachable(queue, text)
        # Start over on a fresh connection, re-sending what is unconfirmed.
        log.warning("channel closed by RabbitMQ (%s %s); reconnecting", code, text)
        connection.close()

    def _schedule_reconnect(self, failure: KeyqError) -> None:
        link = self._link
        now = time.monotonic()
        if self.lost_at is None:
            self.lost_at = now
            link.window.disconnected_since = now
        limit = link.settings.reconnect_timeout
        if now - self.lost_at > limit:
            self.fail(BrokerUnavailable(f"RabbitMQ unreachable for over {limit:.0f} s: {failure}"))
            link.ioloop.stop()
            return
        link.ioloop.call_later(self._delays.next(), self._connect)

    def fail(self, failure: KeyqError) -> None:
        self._link.window.fail(failure)
        self.ready.set()
        if self.connection is None or self.connection.is_closed:
            self._link.ioloop.stop()

    def shutdown(self) -> None:
        self.stopping = True
        connection = self.connection
        if connection is not None and not (connection.is_closed or connection.is_closing):
            connection.close()
        else:
            self._link.ioloop.stop()

    def _on_blocked(self, _connection: Any, _frame: Any) -> None:
        log.warning("RabbitMQ is blocking publishers (resource alarm); publish will wait")
        self._link.window.set_blocked(True)

    def _on_unblocked(self, _connection: Any, _frame: Any) -> None:
        log.info("RabbitMQ unblocked publishers")
        self._link.window.set_blocked(False)

    def restart(self, connection: pika.SelectConnection) -> None:
        """Close ``connection`` to start over on a fresh one; dropped if it does not close."""
        connection.close()
        self._link.ioloop.call_later(
            self._link.settings.connect_timeout, lambda: self._drop_if_still_closing(connection)
        )

    def _drop_if_still_closing(self, connection: pika.SelectConnection) -> None:
        """RabbitMQ stops reading a connection whose channel is held by flow control (a queue
        that does not answer), so it never answers the close either: drop the socket, as
        pika itself does on a missed heartbeat (``_terminate_stream``, a pika internal; pika
        is pinned below 1.5, and the test of silent queues exercises it)."""
        current = self.connection
        if current is None or current is not connection or not current.is_closing:
            return
        log.warning("RabbitMQ did not answer the close; dropping the connection")
        current._terminate_stream(
            pika.exceptions.StreamLostError("RabbitMQ did not answer the close")
        )
