"""One thread that owns an AMQP connection, reconnects it, and runs other threads' calls.

pika connections are not thread-safe, so every channel operation runs on this thread
(``add_callback_threadsafe``) while the caller waits on a future. What the connection holds
(channels, consumers) belongs to its user, who is told through three hooks, all run here:
``on_open`` once connected, ``on_tick`` every quarter second, ``on_close`` when it goes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import pika
import pika.exceptions

from keyq.broker.backoff import Backoff
from keyq.broker.connections import amqp_failure, describe_exception, open_blocking_connection
from keyq.broker.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    ConfigurationError,
    KeyqError,
)
from keyq.broker.settings import Settings

log = logging.getLogger("keyq.worker.amqp")

T = TypeVar("T")
_CHANNEL_CHECK_S = 0.25

# Forgets what the connection held, closing its channels on the connection passed when it is
# still open (None when it is not), and returns the report to make once the calls waiting on
# the connection have failed; the report is made only when the connection was lost.
OnClose = Callable[[pika.BlockingConnection | None], Callable[[], None]]


class AmqpThread:
    """The I/O thread and its connection; reconnects by itself until stopped.

    ``max_loop_gap_s`` is the longest time (monotonic seconds) seen between two iterations of
    the loop that pumps the connection: everything the loop ran in between (deliveries, calls
    from other threads, the hooks and the callbacks they make) held every other operation
    back that long. A test reads it to show how long the thread was stalled; it measures,
    never changes, what the thread does. ``reset_loop_gap`` starts a new measurement (a gap
    under way when it is called still counts once it ends). The reports of a lost
    connection's queues count as a gap too: the thread reconnects only once they are done.
    Time spent reconnecting is not a gap: the measurement starts over with each connection.
    """

    def __init__(
        self,
        *,
        settings: Settings,
        name: str,
        on_open: Callable[[], None],
        on_tick: Callable[[], None],
        on_close: OnClose,
        on_disconnected: Callable[[str], None],
    ) -> None:
        self._settings = settings
        self._name = name
        self._on_open = on_open
        self._on_tick = on_tick
        self._on_close = on_close
        self._on_disconnected = on_disconnected
        self.connection: pika.BlockingConnection | None = None
        self._pending: set[Future[Any]] = set()
        self._pending_lock = threading.Lock()
        self._connected = threading.Event()
        self._stopping = threading.Event()
        self._fatal: KeyqError | None = None
        self._thread = threading.Thread(target=self._run, name="keyq-amqp", daemon=True)
        self.reconnects = 0
        self._lost_at: float | None = None  # when the connection last went away
        # Set by ``move``: that connection is dropped and made again (to the next node).
        self._move: tuple[str, pika.BlockingConnection] | None = None
        self.max_loop_gap_s = 0.0

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
    def failure(self) -> KeyqError | None:
        """Why the thread gave up for good (bad credentials), if it did."""
        return self._fatal

    def reset_loop_gap(self) -> None:
        """Start measuring ``max_loop_gap_s`` afresh."""
        self.max_loop_gap_s = 0.0

    def move(self, reason: str) -> None:
        """Drop the connection and connect again, to the next node of the URL list (as
        after a lost connection: every consumer ends as on a loss, its channel closed
        first). Asked while no connection is open, or once it has gone, it does nothing:
        the next connection is a new one already."""
        connection = self.connection
        if connection is not None:
            self._move = (reason, connection)

    @property
    def node(self) -> str | None:
        """host:port of the node the connection is open to, if it is."""
        connection = self.connection
        params = getattr(getattr(connection, "_impl", None), "params", None)
        host, port = getattr(params, "host", None), getattr(params, "port", None)
        return f"{host}:{port}" if host is not None else None

    def stop(self) -> None:
        self._stopping.set()
        connection = self.connection
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
        backoff = Backoff(0.1, 5.0)
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
                delay = backoff.next()
                log.warning("RabbitMQ refused a reconnect, retrying in %.1fs: %s", delay, exc)
                self._stopping.wait(delay)
                continue
            except KeyqError as exc:  # unreachable: a daemon waits for its broker
                delay = backoff.next()
                log.warning("RabbitMQ unavailable, retrying in %.1fs: %s", delay, exc)
                self._stopping.wait(delay)
                continue
            backoff.reset()
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
            self.connection = connection
            self._on_open()
        except (pika.exceptions.AMQPError, OSError) as exc:
            self.connection = None
            with contextlib.suppress(Exception):  # a half-open connection: drop it
                connection.close()
            raise amqp_failure(exc, self._settings.amqp_url) from None
        self._connected.set()

    def _serve(self) -> str | None:
        """Pump the connection until it fails (returns why) or we stop (returns None)."""
        assert self.connection is not None
        next_check = time.monotonic() + _CHANNEL_CHECK_S
        last_iteration: float | None = None
        while not self._stopping.is_set():
            now = time.monotonic()
            if last_iteration is not None:
                self._note_gap(now - last_iteration)
            last_iteration = now
            if not self.connection.is_open:  # lost inside a call made on this thread
                return "connection to RabbitMQ lost"
            move, self._move = self._move, None
            if move is not None and move[1] is self.connection:
                return move[0]
            try:
                self.connection.process_data_events(time_limit=0.05)
            except (pika.exceptions.AMQPError, OSError) as exc:
                return str(amqp_failure(exc, self._settings.amqp_url))
            except ValueError as exc:
                # pika's timers raise ValueError once a lost connection closed its loop
                # ("Timeout closed before call"): a lost connection like any other.
                if self.connection.is_open:
                    raise
                return f"connection to RabbitMQ lost: {describe_exception(exc)}"
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + _CHANNEL_CHECK_S
                self._on_tick()
        return None

    def _teardown(self, reason: str | None) -> None:
        self._connected.clear()
        connection, self.connection = self.connection, None
        still_open = connection if connection is not None and connection.is_open else None
        report = self._on_close(still_open)
        if still_open is not None:
            with contextlib.suppress(Exception):  # closing a broken connection
                still_open.close()
        with self._pending_lock:
            pending, self._pending = self._pending, set()
        for future in pending:
            if not future.done():
                future.set_exception(BrokerUnavailable(reason or "the worker is stopping"))
        if reason is not None:
            began = time.monotonic()
            report()
            self._note_gap(time.monotonic() - began)

    def _note_gap(self, seconds: float) -> None:
        self.max_loop_gap_s = max(self.max_loop_gap_s, seconds)

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

        connection = self.connection
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
