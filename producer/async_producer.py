"""The asyncio producer: the threaded producer's window, I/O thread and guarantees, awaited.

Nothing here blocks the event loop. Connecting and closing wait for RabbitMQ and Redis, so they
run in a worker thread. Publishing takes the confirm window's lock only as long as the I/O
thread ever holds it; when the window has no room (or RabbitMQ blocks publishers) a publish
awaits a future that the I/O thread's wake-ups resolve (``keyq.producer.loop_bridge``).
Publishes that wait queue up in the order they were called, so a key's events keep the order
of the ``publish`` calls, as with the threaded producer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from prometheus_client import CollectorRegistry

from keyq.broker.errors import KeyqError, ProducerClosed, PublishTimeout
from keyq.broker.naming import Mode
from keyq.broker.settings import Settings
from keyq.broker.streams import StreamConfig
from keyq.producer.encoding import PreparedEvent
from keyq.producer.loop_bridge import LoopWaker, resolve, resolve_from_thread
from keyq.producer.producer import Producer
from keyq.producer.receipt import Offer, Receipt

# A publish that found the window's lock held looks again this much later (without holding
# up the loop meanwhile).
BUSY_RETRY_S = 0.0005


class AsyncReceipt:
    """An accepted event: where it goes, and awaitable until RabbitMQ confirmed it.

    ``await receipt`` or ``await receipt.wait(timeout)`` returns once the event is published
    (confirmed and not returned), and raises what ``flush`` would: ``ProducerClosed`` if the
    producer failed or was closed first, ``PublishTimeout`` after ``timeout``.
    """

    __slots__ = ("_done", "_producer", "receipt")

    def __init__(self, receipt: Receipt, producer: AsyncProducer) -> None:
        self.receipt = receipt  # the threaded producer's, with ``wait`` for other threads
        self._producer = producer
        self._done: asyncio.Future[None] | None = None  # made when first awaited

    @property
    def queue(self) -> str:
        return self.receipt.queue

    @property
    def key(self) -> str:
        return self.receipt.key

    @property
    def seq(self) -> int:
        return self.receipt.seq

    @property
    def message_id(self) -> str:
        return self.receipt.message_id

    @property
    def published(self) -> bool:
        return self.receipt.published

    async def wait(self, timeout: float | None = None) -> None:
        """Return once this event is published; never blocks the loop."""
        await self._producer.wait_confirmed(self, timeout)

    def __await__(self) -> Any:
        return self.wait().__await__()

    def done_future(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """One future per receipt, resolved by the I/O thread when the event is published
        (however many tasks await it)."""
        if self._done is None:
            done: asyncio.Future[None] = loop.create_future()
            self._done = done
            confirmation = self.receipt.confirmation
            if confirmation is not None:
                confirmation.on_published(lambda: resolve_from_thread(loop, done))
        return self._done

    def __repr__(self) -> str:
        return (
            f"AsyncReceipt(queue={self.queue!r}, key={self.key!r}, seq={self.seq}, "
            f"message_id={self.message_id!r}, published={self.published})"
        )


class _Turn:
    """A publish waiting for room; ``future`` is resolved when it may try again."""

    __slots__ = ("future",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.future: asyncio.Future[None] = loop.create_future()


class AsyncProducer:
    """Publishes keyed events to one stream from asyncio code.

    ``async with AsyncProducer("orders", mode="key") as producer`` connects (in a worker
    thread) and closes; ``await AsyncProducer.connect(...)`` and ``await producer.close()``
    do the same by hand. The options are the threaded ``Producer``'s (``metrics=True`` too:
    the same families, recorded by the same I/O thread). Use it from the event loop that
    started it.
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
        self._connect = functools.partial(
            Producer,
            stream,
            mode=mode,
            buckets=buckets,
            amqp_url=amqp_url,
            redis_url=redis_url,
            settings=settings,
            confirm_window=confirm_window,
            publish_timeout=publish_timeout,
            max_message_bytes=max_message_bytes,
            producer_id=producer_id,
            queue_type=queue_type,
            metrics=metrics,
        )
        self.stream = stream
        self._core: Producer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._turns: deque[_Turn] = deque()  # publishes waiting for room, in call order
        self._watchers: set[asyncio.Future[None]] = set()  # flushes: woken on any change
        self._receipts: set[AsyncReceipt] = set()  # awaited receipts: woken on failure
        self._closing = False

    # ---------------------------------------------------------------- starting
    @classmethod
    async def connect(cls, stream: str, **options: Any) -> AsyncProducer:
        """A started producer (``AsyncProducer(stream, **options)``, then ``start``)."""
        return await cls(stream, **options).start()

    async def start(self) -> AsyncProducer:
        """Connect to RabbitMQ and Redis in a worker thread; raises what the threaded
        producer's constructor raises."""
        if self._closing:
            raise ProducerClosed("producer is closed")
        if self._core is not None:
            return self
        loop = asyncio.get_running_loop()
        pending = loop.run_in_executor(None, self._connect)
        try:
            core = await asyncio.shield(pending)
        except asyncio.CancelledError:
            pending.add_done_callback(_close_abandoned)
            raise
        self._loop = loop
        self._core = core
        core.listen(LoopWaker(loop, self._on_change).poke)
        return self

    async def __aenter__(self) -> AsyncProducer:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self.close()
            return
        with contextlib.suppress(KeyqError):  # the original exception is the one to see
            await self.close()

    # ---------------------------------------------------------------- publishing
    async def publish(
        self,
        key: str,
        event: Mapping[str, Any] | bytes,
        *,
        headers: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        content_type: str | None = None,
        dedupe_id: str | None = None,
    ) -> AsyncReceipt:
        """Accept one event for ``key``: returns at once while the window has room, else
        awaits room (or RabbitMQ unblocking publishers) up to ``timeout`` (default:
        ``publish_timeout``), then raises ``PublishTimeout``. Bad input raises at once.
        ``content_type`` and ``dedupe_id`` are the threaded ``publish``'s."""
        core = self._running()
        prepared = core.prepare(key, event, headers, content_type=content_type, dedupe_id=dedupe_id)
        if not self._turns:
            receipt = core.offer(prepared)
            if isinstance(receipt, Receipt):
                return AsyncReceipt(receipt, self)
        return await self._publish_in_turn(core, prepared, timeout)

    async def _publish_in_turn(
        self, core: Producer, prepared: PreparedEvent, timeout: float | None
    ) -> AsyncReceipt:
        loop = self._bound_loop()
        wait = core.settings.publish_timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        turn = _Turn(loop)
        self._turns.append(turn)
        try:
            while True:
                offer: Receipt | Offer = Offer.NO_ROOM
                if self._turns[0] is turn:
                    self._running()
                    offer = core.offer(prepared)
                    if isinstance(offer, Receipt):
                        return AsyncReceipt(offer, self)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PublishTimeout(f"publish timed out: {core.wait_reason(prepared.queue)}")
                if offer is Offer.BUSY:
                    remaining = min(remaining, BUSY_RETRY_S)
                await asyncio.wait((turn.future,), timeout=remaining)
                if turn.future.done():
                    turn.future = loop.create_future()
        finally:
            first = self._turns[0] is turn
            self._turns.remove(turn)
            if first and self._turns:
                resolve(self._turns[0].future)  # the next in line tries at once

    async def flush(self, timeout: float | None = None) -> None:
        """Return once every accepted event is confirmed and its queue registered; raises
        ``PublishTimeout`` after ``timeout`` and ``ProducerClosed`` if the producer failed."""
        core = self._started()
        loop = self._bound_loop()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not core.settled():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise PublishTimeout(f"flush timed out: {core.unconfirmed} events unconfirmed")
            change: asyncio.Future[None] = loop.create_future()
            self._watchers.add(change)
            try:
                await asyncio.wait((change,), timeout=remaining)
            finally:
                self._watchers.discard(change)
        await asyncio.to_thread(core.wait_registered, deadline)

    async def wait_confirmed(self, receipt: AsyncReceipt, timeout: float | None) -> None:
        """Await one event's confirm (``AsyncReceipt.wait``)."""
        confirmation = receipt.receipt.confirmation
        if confirmation is None:
            raise ProducerClosed("this receipt belongs to no producer")
        loop = self._bound_loop()
        deadline = None if timeout is None else time.monotonic() + timeout
        done = receipt.done_future(loop)
        self._receipts.add(receipt)
        try:
            while not confirmation.published:
                error = confirmation.failure()
                if error is not None:
                    raise error
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise PublishTimeout(
                        f"event {receipt.message_id} not confirmed within {timeout} s: "
                        f"{self._started().wait_reason('')}"
                    )
                await asyncio.wait((done,), timeout=remaining)
                if done.done() and not confirmation.published:
                    done = receipt._done = loop.create_future()  # woken by a failure
        finally:
            self._receipts.discard(receipt)

    def _on_change(self) -> None:
        """On the loop, after the I/O thread settled events, publishers were unblocked or
        the producer failed: the first waiting publish tries again, flushes look again."""
        if self._turns:
            resolve(self._turns[0].future)
        for change in self._watchers:
            resolve(change)
        core = self._core
        if self._receipts and core is not None and core.failed:
            for receipt in self._receipts:
                if receipt._done is not None:
                    resolve(receipt._done)

    # ------------------------------------------------------------------- closing
    async def close(self, timeout: float | None = None) -> None:
        """Flush (up to ``timeout``, default ``publish_timeout``), then disconnect in a
        worker thread. Raises if events remained unconfirmed, as the threaded one does."""
        if self._closing:
            return
        self._closing = True
        core = self._core
        if core is None:
            return
        if self._turns:
            resolve(self._turns[0].future)  # waiting publishes raise ProducerClosed
        wait = core.settings.publish_timeout if timeout is None else timeout
        error: KeyqError | None = None
        try:
            if not core.failed:
                await self.flush(wait)
        except KeyqError as exc:
            error = exc
        finally:
            closing = asyncio.ensure_future(asyncio.to_thread(core.close, 0.0))
        try:
            await asyncio.shield(closing)
        except KeyqError:
            if error is None:
                raise
        if error is not None:
            raise error

    # ----------------------------------------------------------------- looking in
    @property
    def producer_id(self) -> str:
        return self._started().producer_id

    @property
    def config(self) -> StreamConfig:
        return self._started().config

    @property
    def settings(self) -> Settings:
        settings: Settings = self._started().settings
        return settings

    @property
    def stats(self) -> dict[str, int]:
        """The threaded producer's counters (``Producer.stats``)."""
        return self._started().stats

    @property
    def unconfirmed(self) -> int:
        return self._started().unconfirmed

    @property
    def unconfirmed_by_queue(self) -> dict[str, int]:
        return self._started().unconfirmed_by_queue

    def _started(self) -> Producer:
        if self._core is None:
            raise ProducerClosed("producer not started: use `async with` or `await start()`")
        return self._core

    def _running(self) -> Producer:
        if self._closing:
            raise ProducerClosed("producer is closed")
        return self._started()

    def _bound_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            raise ProducerClosed("producer used outside the event loop that started it")
        return loop

    def __repr__(self) -> str:
        state = "closed" if self._closing else "open" if self._core is not None else "new"
        return f"AsyncProducer(stream={self.stream!r}, {state})"


def _close_abandoned(pending: asyncio.Future[Producer]) -> None:
    """A start cancelled while connecting: close what it opened, off the loop."""
    if pending.cancelled() or pending.exception() is not None:
        return
    core = pending.result()
    threading.Thread(target=_quiet_close, args=(core,), daemon=True).start()


def _quiet_close(core: Producer) -> None:
    with contextlib.suppress(KeyqError):
        core.close(0.0)
