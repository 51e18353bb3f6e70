"""The producer SDK: publish keyed events that land, durably and in order, in their key's queue.

An event counts as published only when RabbitMQ confirmed it and did not return it. Nothing is
waited for one by one: events stream out under a window of unconfirmed events, and ``flush``
waits for all of them.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import pika
import redis
from prometheus_client import CollectorRegistry

from keyq.broker.clock import now_ms
from keyq.broker.connections import redis_errors
from keyq.broker.envelope import (
    HEADER_DEDUPE_ID,
    HEADER_KEY,
    HEADER_PRODUCER,
    HEADER_PUBLISHED_AT,
    HEADER_SEQ,
    HEADER_STREAM,
    check_user_headers,
    header_bytes,
)
from keyq.broker.errors import KeyqError, MessageTooLarge, ProducerClosed
from keyq.broker.naming import Mode, check_stream_name, dead_letter_queue_name, encode_key
from keyq.broker.registry import QueueRegistry
from keyq.broker.retirement import RetirementFence
from keyq.broker.routes import RouteBook
from keyq.broker.settings import Settings
from keyq.broker.streams import StreamConfig, ensure_stream_config, requested_config
from keyq.broker.tracing import inject_trace_context
from keyq.producer.confirmation import Confirmation
from keyq.producer.encoding import PreparedEvent, check_dedupe_id, encode_event
from keyq.producer.link import PublisherLink
from keyq.producer.metrics import meter_for
from keyq.producer.outgoing import Outgoing
from keyq.producer.receipt import Offer, Receipt
from keyq.producer.registrar import Registrar
from keyq.producer.route_follow import RouteFollower
from keyq.producer.startup import instance_id, open_redis_presence, resolve_settings

# Room kept for AMQP properties and keyq's headers when checking the size limit.
HEADER_ALLOWANCE = 512


class Producer:
    """Publishes keyed events to one stream.

    Thread-safe: several threads may publish at once; each key's events keep the order in
    which ``publish`` accepted them.

    ``producer_id`` names the producer in message ids, headers and dead letters; each
    instance appends a unique suffix (``producer.producer_id`` is the full id), so that a
    restarted producer using the same name is never taken for a duplicate of the old one.

    ``metrics`` turns on Prometheus metrics (``keyq_producer_*``, labelled ``stream``, see
    docs/operations.md): ``True`` records into prometheus_client's default registry (what
    its ``start_http_server`` serves), a ``CollectorRegistry`` into that one. Off by
    default, so that a library never registers metrics an application did not ask for.
    """

    def __init__(
        self,
        stream: str,
        *,
        mode: str | Mode | None = None,
        buckets: int | None = None,
        amqp_url: str | None = None,
        redis_url: str | None = None,
        settings: Settings | None = None,
        confirm_window: int | None = None,
        publish_timeout: float | None = None,
        max_message_bytes: int | None = None,
        producer_id: str | None = None,
        queue_type: str | None = None,
        metrics: bool | CollectorRegistry = False,
    ) -> None:
        self.stream = check_stream_name(stream)
        self.settings = resolve_settings(
            settings,
            amqp_url=amqp_url,
            redis_url=redis_url,
            confirm_window=confirm_window,
            publish_timeout=publish_timeout,
            max_message_bytes=max_message_bytes,
            queue_type=queue_type,
        )
        self.producer_id = instance_id(producer_id)
        requested_config(self.stream, mode, buckets)  # bad arguments fail before any I/O
        meter = meter_for(metrics, self.stream)

        self._redis, self._presence, chosen_type = open_redis_presence(
            self.settings, self.stream, self.producer_id
        )
        self._seqs: dict[str, int] = {}
        self._numbers = itertools.count(1)
        self._closed = False
        self._close_lock = threading.Lock()
        self._registrar = Registrar(
            QueueRegistry(self._redis, self.stream),
            RetirementFence(self._redis, self.stream),
            self.settings.redis_url,
            (self._presence, self.producer_id, self.settings.producer_ttl_ms),
        )
        self._link = PublisherLink(
            self.settings,
            self.stream,
            (dead_letter_queue_name(self.stream), chosen_type),
            on_new_queues=self._registrar.add_new,
            request_lease=self._registrar.request_lease,
            meter=meter,
        )
        self._registrar.start(self._link.leases.apply)
        try:
            self.config: StreamConfig = self._connect(mode, buckets, chosen_type)
        except BaseException:
            self._shut_down()
            raise
        self._routes = self._follow_routes()

    def _connect(self, mode: str | Mode | None, buckets: int | None, kind: str) -> StreamConfig:
        """Connect to RabbitMQ; only a producer that reached both services fixes the
        stream's mode."""
        self._link.start()
        with redis_errors(self.settings.redis_url):
            return ensure_stream_config(self._redis, self.stream, mode, buckets, kind)

    def _follow_routes(self) -> RouteFollower | None:
        """Auto mode: where promoted keys' events go (``keyq.producer.route_follow``)."""
        if self.config.mode is not Mode.AUTO:
            return None
        routes = RouteFollower(RouteBook(self._redis, self.stream), self.config, self.producer_id)
        self._link.follow(routes)
        self._registrar.follow(routes)
        return routes

    def _shut_down(self, abandoned: int = 0) -> None:
        """Stop both threads and leave Redis: what was not confirmed will never be sent, so
        workers may give up the gaps it left (if Redis is unreachable now, the presence
        expires)."""
        self._link.stop()
        if abandoned:  # receipts still waiting learn that their events never will be
            self._link.window.fail(ProducerClosed(f"closed with {abandoned} unconfirmed"))
        self._registrar.stop()
        with contextlib.suppress(redis.exceptions.RedisError):
            self._presence.withdraw(self.producer_id)
        self._redis.close()

    # ------------------------------------------------------------------- publishing
    def publish(
        self,
        key: str,
        event: Mapping[str, Any] | bytes,
        *,
        headers: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        content_type: str | None = None,
        dedupe_id: str | None = None,
    ) -> Receipt:
        """Accept one event for ``key``; it is published once confirmed (see ``flush``).

        ``content_type`` labels a bytes event (Avro, Protobuf…; default
        ``application/octet-stream``). ``dedupe_id`` is the application's id for the event:
        the worker applies an event whose id was applied to the key already (from any
        producer, within the stream's dedupe window) only once.

        Waits while the window of unconfirmed events is full or the broker blocks
        publishers, and raises ``PublishTimeout`` after ``timeout`` (default: the
        ``publish_timeout`` setting). Bad input raises before anything is sent.
        """
        prepared = self.prepare(key, event, headers, content_type=content_type, dedupe_id=dedupe_id)
        wait = self.settings.publish_timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self._link.window.cond:
            return self._accept(prepared, deadline)

    def prepare(
        self,
        key: str,
        event: Mapping[str, Any] | bytes,
        headers: Mapping[str, Any] | None,
        *,
        content_type: str | None = None,
        dedupe_id: str | None = None,
    ) -> PreparedEvent:
        """Check and encode an event (raising at once on bad input); no I/O, no waiting."""
        if self._closed:
            raise ProducerClosed("producer is closed")
        key_bytes = encode_key(key)
        body, content_type = encode_event(event, content_type)
        user_headers = check_user_headers(headers)
        inject_trace_context(user_headers)  # with keyq[otel]: the caller's span, W3C
        if dedupe_id is not None:
            user_headers[HEADER_DEDUPE_ID] = check_dedupe_id(dedupe_id)
        size = len(body) + len(key_bytes) + HEADER_ALLOWANCE
        if user_headers:
            size += header_bytes(user_headers)
        if size > self.settings.max_message_bytes:
            raise MessageTooLarge(
                f"message of about {size} bytes exceeds max_message_bytes "
                f"({self.settings.max_message_bytes})"
            )
        queue = self.config.queue_for(key)  # auto mode: settled in ``_accept``
        return PreparedEvent(queue, key, body, content_type, user_headers)

    def offer(self, prepared: PreparedEvent) -> Receipt | Offer:
        """Accept a prepared event if the window has room for it now; never waits, not even
        for the window's lock (for an event loop: a lock held by the I/O thread while the
        OS or the GIL has it wait would stall the loop too). Raises ``ProducerClosed`` once
        the producer failed."""
        cond = self._link.window.cond
        if not cond.acquire(blocking=False):
            return Offer.BUSY
        try:
            if self._link.window.failure is None and not self._link.window.has_room(prepared.queue):
                return Offer.NO_ROOM
            return self._accept(prepared, time.monotonic())
        finally:
            cond.release()

    def wait_reason(self, queue: str) -> str:
        """Why an event for ``queue`` would wait now."""
        with self._link.window.cond:
            return self._link.window.wait_reason(queue)

    def listen(self, callback: Callable[[], None]) -> None:
        """Have ``callback`` called, from any thread and with the window's lock held (so it
        must not block), whenever a waiter may go on: events confirmed, publishers
        unblocked, the producer failed."""
        with self._link.window.cond:
            self._link.window.listeners.append(callback)

    def settled(self) -> bool:
        """Whether every accepted event is confirmed; raises ``ProducerClosed`` if the
        producer failed with events unconfirmed. Never waits: it reads without the lock, and
        a caller looks again when the window next changes (``listen``)."""
        return self._link.window.settled()

    @property
    def failed(self) -> bool:
        """Whether the producer failed for good (``flush`` and ``publish`` raise why)."""
        return self._link.window.failure is not None

    def wait_registered(self, deadline: float | None) -> None:
        """Block until every confirmed queue is registered in Redis (the second half of
        ``flush``); ``deadline`` is ``time.monotonic()``'s."""
        self._registrar.wait_idle(deadline)

    def _accept(self, prepared: PreparedEvent, deadline: float) -> Receipt:
        """Number the event and hand it to the I/O thread (waiting for room until
        ``deadline``). Call with ``cond`` held."""
        if self._closed:
            raise ProducerClosed("producer is closed")
        key = prepared.key
        published_at = now_ms()
        last = self._seqs.get(key, 0)
        seq = last + 1
        queue = prepared.queue if self._routes is None else self._routes.queue_for(key, last)
        number = next(self._numbers)
        message_id = f"{self.producer_id}:{number}"
        user_headers = dict(prepared.headers)
        user_headers[HEADER_STREAM] = self.stream
        user_headers[HEADER_KEY] = key
        user_headers[HEADER_PRODUCER] = self.producer_id
        user_headers[HEADER_SEQ] = seq
        user_headers[HEADER_PUBLISHED_AT] = published_at
        properties = pika.BasicProperties(
            delivery_mode=pika.DeliveryMode.Persistent,
            content_type=prepared.content_type,
            message_id=message_id,
            timestamp=published_at // 1000,
            headers=user_headers,
        )
        confirmation = Confirmation(self._link.window, message_id)
        message = Outgoing(number, queue, key, prepared.body, properties)
        message.confirmation = confirmation
        self._link.submit(message, deadline)
        self._seqs[key] = seq
        return Receipt(queue, key, seq, message_id, confirmation)

    def flush(self, timeout: float | None = None) -> None:
        """Return once every accepted event is confirmed and its queue registered.

        Raises ``PublishTimeout`` if that takes longer than ``timeout`` seconds, and
        ``ProducerClosed`` if the producer failed for good (e.g. the broker stayed away
        longer than ``reconnect_timeout``).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._link.window.wait_settled(deadline)
        self._registrar.wait_idle(deadline)

    @property
    def stats(self) -> dict[str, int]:
        """Counters: events returned or refused by the broker and sent again, events re-sent
        after a lost connection, events sent again because their confirm came after the
        queue's publish lease ran out (the queue may have been deleted meanwhile), reconnects
        because a confirm was overdue (``confirm_timeout``), stalled queues' own channels
        reset because their confirm was overdue, reconnects of any cause,
        events not yet confirmed, events sent to their key's bucket because its own queue
        lost its route (auto mode), and the packs sent and the events inside them
        (``docs/pack-format.md``)."""
        return self._link.stats()

    @property
    def unconfirmed(self) -> int:
        """Events accepted but not yet confirmed by the broker."""
        return self._link.window.unsettled

    @property
    def unconfirmed_by_queue(self) -> dict[str, int]:
        """The unconfirmed events of each queue that has some: which keys a flush that
        timed out is waiting for (a key's events are confirmed in order, so a queue's
        unconfirmed events are the last ones of its keys)."""
        return self._link.window.unsettled_by_queue()

    # ---------------------------------------------------------------------- closing
    def close(self, timeout: float | None = None) -> None:
        """Flush (up to ``timeout``, default ``publish_timeout``), then disconnect.

        Raises if events remained unconfirmed, so a caller never mistakes an abandoned
        event for a published one.
        """
        with self._close_lock:
            if self._closed:
                return
            wait = self.settings.publish_timeout if timeout is None else timeout
            try:
                if self._link.window.failure is None:
                    self.flush(wait)
            finally:
                with self._link.window.cond:
                    self._closed = True
                abandoned = self._link.window.unsettled
                failure = self._link.window.failure
                self._shut_down(abandoned)
            if failure is not None and abandoned:
                raise ProducerClosed(
                    f"{abandoned} events were never confirmed: {failure}"
                ) from failure

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(KeyqError):  # the original exception is the one to see
            self.close()

    def __repr__(self) -> str:
        return (
            f"Producer(stream={self.stream!r}, mode={self.config.mode.value!r}, "
            f"id={self.producer_id!r})"
        )
