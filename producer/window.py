"""The confirm window: what application threads and the producer's I/O thread share.

Application threads hand events over through ``outbox`` and wait on ``cond`` for room among
the unconfirmed events; the I/O thread settles them and wakes the waiters. Everything here is
guarded by ``cond`` (the I/O thread reads ``stalled`` and ``blocked`` without it: it is their
only writer). The window never calls into the I/O thread: ``submit`` and ``drain_again`` say
when it must be woken, and the caller wakes it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from keyq.broker.errors import KeyqError, ProducerClosed, PublishTimeout
from keyq.producer.outgoing import Outgoing

if TYPE_CHECKING:
    from keyq.producer.confirmation import Confirmation

# Unconfirmed events a queue that RabbitMQ keeps refusing may hold: past that, publishing to
# it waits (and times out), so one broken queue cannot fill the window every key shares.
REFUSING_QUEUE_ROOM = 100


class ConfirmWindow:
    """Unconfirmed events, overall and by queue, under a limit every key shares."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.outbox: deque[Outgoing] = deque()
        self.unsettled = 0
        self.by_queue: dict[str, int] = {}
        self.refusing: set[str] = set()  # queues refused over and over, until one confirm
        self.stalled: set[str] = set()  # queues whose confirm was overdue, until one confirm
        self.wake_scheduled = False
        self.blocked = False
        self.disconnected_since: float | None = None  # monotonic, while reconnecting
        self.failure: KeyqError | None = None
        # Called (from any thread, ``cond`` held) when waiters may go on: events settled,
        # publishers unblocked, the producer failed. An asyncio producer's wake-up.
        self.listeners: list[Callable[[], None]] = []

    # ----------------------------------------------------------- application threads
    def submit(self, message: Outgoing, deadline: float) -> bool:
        """Queue an event for the I/O thread, waiting while the window is full or the
        broker blocks publishers; True when the I/O thread must be woken to drain ``outbox``.
        Call with ``cond`` held."""
        while True:
            if self.failure is not None:
                raise ProducerClosed(f"producer failed: {self.failure}") from self.failure
            if self.has_room(message.queue):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PublishTimeout(f"publish timed out: {self.wait_reason(message.queue)}")
            self.cond.wait(remaining)
        message.accepted_at = time.monotonic()  # where its publish-to-confirm time starts
        self.unsettled += 1
        self.by_queue[message.queue] = self.by_queue.get(message.queue, 0) + 1
        self.outbox.append(message)
        if self.wake_scheduled:
            return False
        self.wake_scheduled = True
        return True

    def has_room(self, queue: str) -> bool:
        """Whether an event for ``queue`` may be submitted now. Call with ``cond`` held."""
        return self.unsettled < self.size and not self.blocked and not self._crowded(queue)

    def _crowded(self, queue: str) -> bool:
        troubled = queue in self.refusing or queue in self.stalled
        return troubled and self.by_queue.get(queue, 0) >= REFUSING_QUEUE_ROOM

    def wait_reason(self, queue: str) -> str:
        """Why an event for ``queue`` has to wait. Call with ``cond`` held."""
        waiting_here = self.by_queue.get(queue, 0)
        if self.blocked:
            return "RabbitMQ is blocking publishers (flow control)"
        if self._crowded(queue) and queue in self.refusing:
            return (
                f"RabbitMQ keeps refusing events for {queue}: {waiting_here} of its "
                f"events await confirmation (other keys are not held up)"
            )
        if self._crowded(queue):
            return (
                f"RabbitMQ stopped confirming events for {queue}: {waiting_here} of "
                f"its events await confirmation (other keys are not held up)"
            )
        why = f"{self.unsettled} events await confirmation (window {self.size})"
        since = self.disconnected_since
        if since is not None:
            why += f"; RabbitMQ unreachable for {time.monotonic() - since:.0f} s, reconnecting"
        return why

    def settled(self) -> bool:
        """Whether every submitted event is confirmed; raises if the producer failed first.
        Exact with ``cond`` held; without it, a glance to be repeated on the next change."""
        if self.unsettled and self.failure is not None:
            raise ProducerClosed(
                f"producer failed with {self.unsettled} events unconfirmed: {self.failure}"
            ) from self.failure
        return not self.unsettled

    def failure_for(self, message_id: str) -> ProducerClosed | None:
        """The error for an event never to be published, if the producer failed."""
        failure = self.failure
        if failure is None:
            return None
        error = ProducerClosed(
            f"producer failed before event {message_id} was confirmed: {failure}"
        )
        error.__cause__ = failure
        return error

    def wait_confirmed(self, confirmation: Confirmation, timeout: float | None) -> None:
        """Block until ``confirmation``'s event is published (or raise why not)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not confirmation.published:
                error = self.failure_for(confirmation.message_id)
                if error is not None:
                    raise error
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise PublishTimeout(
                        f"event {confirmation.message_id} not confirmed within {timeout} s: "
                        f"{self.wait_reason('')}"
                    )
                self.cond.wait(remaining if remaining is not None else 1.0)

    def wait_settled(self, deadline: float | None) -> None:
        """Block until every submitted event is confirmed (or raise why not)."""
        with self.cond:
            while self.unsettled:
                if self.failure is not None:
                    raise ProducerClosed(
                        f"producer failed with {self.unsettled} events unconfirmed: {self.failure}"
                    ) from self.failure
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise PublishTimeout(f"flush timed out: {self.unsettled} events unconfirmed")
                self.cond.wait(remaining if remaining is not None else 1.0)

    def unsettled_by_queue(self) -> dict[str, int]:
        with self.cond:
            return dict(self.by_queue)

    # ----------------------------------------------------------------- I/O thread
    def fail(self, failure: KeyqError) -> None:
        """The first failure stands; every waiter wakes to raise it."""
        with self.cond:
            if self.failure is None:
                self.failure = failure
            self._wake_waiters()

    def set_blocked(self, blocked: bool) -> None:
        with self.cond:
            self.blocked = blocked
            if not blocked:
                self._wake_waiters()

    def _wake_waiters(self) -> None:
        """Threads waiting on ``cond`` and listeners (call with ``cond`` held)."""
        self.cond.notify_all()
        for listener in self.listeners:
            listener()

    def draining(self) -> None:
        """The I/O thread drains ``outbox`` now: the next submit wakes it again."""
        with self.cond:
            self.wake_scheduled = False

    def drain_again(self) -> bool:
        """``outbox`` was left non-empty: True when a later turn of the loop must drain it."""
        with self.cond:
            if self.wake_scheduled:
                return False
            self.wake_scheduled = True
            return True

    def settle(self, published: list[str]) -> set[str]:
        """Count one event of each entry of ``published`` (queue names) as confirmed; those
        queues refuse no more and are stalled no more. Returns the stalled ones heard again."""
        with self.cond:
            heard_again = set(published) & self.stalled
            self.unsettled -= len(published)
            for queue in published:
                left = self.by_queue[queue] - 1
                if left:
                    self.by_queue[queue] = left
                else:
                    del self.by_queue[queue]
                self.refusing.discard(queue)
            self.stalled -= heard_again
            self._wake_waiters()
        return heard_again

    def moved(self, queue: str, to: str, events: int) -> None:
        """``events`` unconfirmed ones of ``queue`` go to ``to`` instead (a lost route)."""
        if not events:
            return
        with self.cond:
            left = self.by_queue.get(queue, 0) - events
            if left > 0:
                self.by_queue[queue] = left
            else:
                self.by_queue.pop(queue, None)
            self.by_queue[to] = self.by_queue.get(to, 0) + events

    def mark_stalled(self, queues: set[str]) -> None:
        """Publishing to these waits once each holds its room, until one confirms."""
        with self.cond:
            self.stalled |= queues

    def mark_refusing(self, queue: str) -> None:
        """Publishing to ``queue`` waits once it holds its room, until it confirms."""
        with self.cond:
            self.refusing.add(queue)
