"""Messages delivered to a worker and not yet settled, per queue, in arrival order.

The AMQP thread appends; the batch loop takes from the front of each queue. Events that must
wait for an earlier seq (``keyq.worker.batch.sequencing``) are *deferred* beside the queue's FIFO:
they do not count as ready, so they never crowd out the events they wait for, and they join
the next batch taken from their queue, or a batch of their own once their gap is due.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from keyq.broker.envelope import HEADER_KEY, HEADER_PRODUCER, HEADER_SEQ, published_at_ms
from keyq.worker.amqp.batch_shares import batch_shares


@dataclass(slots=True)
class Delivery:
    """One message as the broker handed it to us on a queue's channel."""

    queue: str
    channel_epoch: int  # which consumer incarnation delivered it; acks go to that one only
    delivery_tag: int
    redelivered: bool
    headers: dict[str, Any]
    content_type: str | None
    message_id: str | None
    body: bytes
    # A message may be a pack of several events (``keyq.broker.packs``): each is a delivery
    # of its own, sharing the message's queue, epoch and tag; ``part`` is its index in the
    # pack, ``parts`` how many the pack holds. The message is acked once all are settled.
    part: int = 0
    parts: int = 1
    # Set on a message labelled as a pack that could not be read: why. It stays one
    # delivery, the whole message, and is dead-lettered with that reason.
    malformed: str | None = None
    received_at: float = field(default_factory=time.monotonic)
    deferred_since: float | None = None  # first deferred (behind an earlier seq) at

    @property
    def message(self) -> tuple[int, int]:
        """The AMQP message it came in: (consumer epoch, delivery tag)."""
        return self.channel_epoch, self.delivery_tag


def oldest_published_ms(deliveries: Iterable[Delivery]) -> int | None:
    """The earliest ``x-keyq-published-at`` among ``deliveries``, if any carries one."""
    stamps = [
        stamp for delivery in deliveries if (stamp := published_at_ms(delivery.headers)) is not None
    ]
    return min(stamps, default=None)


def _delivery_order(delivery: Delivery) -> tuple[int, int, int]:
    return delivery.channel_epoch, delivery.delivery_tag, delivery.part


class DeliveryBuffer:
    """Thread-safe per-queue FIFOs with a wake-up for the batch loop."""

    def __init__(
        self,
        gap_timeout_s: float = 60.0,
        shared_cap: Callable[[str, int], int | None] | None = None,
    ) -> None:
        self._gap_timeout_s = gap_timeout_s
        # A queue's most events in a batch it shares with other queues, which have so many
        # ready (None: no cap).
        self._shared_cap = shared_cap
        self._queues: dict[str, deque[Delivery]] = {}
        self._deferred: dict[str, list[Delivery]] = {}
        self._last_arrival: dict[str, float] = {}
        # (queue, event identity) -> since when a delivery dropped for a consumer's reopening had
        # waited: its redelivery keeps waiting from then, so a gap's timeout is not reset.
        self._waits: dict[tuple[str, tuple[str, ...]], float] = {}
        self._count = 0
        # The count at which a ``take`` filling its batch wants to hear of an arrival: waking
        # it for each delivery made the I/O thread hand the GIL to the batch loop thousands of
        # times a second, for a check that fails until the batch is full.
        self._filling_to = 1
        self._first_arrival: float | None = None
        self._changed = threading.Condition()
        self._woken = False

    def add(self, delivery: Delivery) -> None:
        self.add_all((delivery,))

    def add_all(self, deliveries: Sequence[Delivery]) -> None:
        """Append deliveries (one message's, or a pack's events in order) at once."""
        with self._changed:
            before = self._count
            for delivery in deliveries:
                if self._waits:
                    identity = _identity(delivery)
                    slot = (delivery.queue, identity) if identity else None
                    since = self._waits.pop(slot, None) if slot else None
                    if since is not None:
                        delivery.deferred_since = since
                self._queues.setdefault(delivery.queue, deque()).append(delivery)
                self._last_arrival[delivery.queue] = delivery.received_at
                self._count += 1
                if self._first_arrival is None:
                    self._first_arrival = delivery.received_at
            if before < self._filling_to <= self._count or (before == 0 < self._count):
                self._changed.notify_all()

    def oldest_published_ms(self) -> int | None:
        """When the oldest event buffered here was published (ms since the epoch), as its
        producer said; None if none says. A queue's oldest is at its front, or deferred."""
        with self._changed:
            candidates = [fifo[0] for fifo in self._queues.values() if fifo]
            for deferred in self._deferred.values():
                candidates.extend(deferred)
        return oldest_published_ms(candidates)

    def wake(self) -> None:
        """Make a waiting ``take`` return early (shutdown, releases to apply)."""
        with self._changed:
            self._woken = True
            self._changed.notify_all()

    def __len__(self) -> int:
        with self._changed:
            return self._count

    def depth(self, queue: str) -> int:
        """Unsettled deliveries of ``queue`` here, ready or deferred."""
        with self._changed:
            return len(self._queues.get(queue, ())) + len(self._deferred.get(queue, ()))

    def messages(self, queue: str) -> int:
        """The AMQP messages that unsettled deliveries of ``queue`` here came in, ready or
        deferred: a pack's events count once (what a consumer's prefetch counts)."""
        with self._changed:
            found = {d.message for d in self._queues.get(queue, ())}
            found.update(d.message for d in self._deferred.get(queue, ()))
            return len(found)

    def ready_messages(self, queue: str) -> int:
        """The AMQP messages that ready (not deferred) deliveries of ``queue`` came in."""
        with self._changed:
            return len({d.message for d in self._queues.get(queue, ())})

    def deferred_messages(self, queue: str) -> int:
        """The AMQP messages that deferred deliveries of ``queue`` came in."""
        with self._changed:
            return len({d.message for d in self._deferred.get(queue, ())})

    def deferred(self, queue: str | None = None) -> int:
        """Deliveries waiting for an earlier seq (of ``queue``, or of every queue)."""
        with self._changed:
            if queue is not None:
                return len(self._deferred.get(queue, ()))
            return sum(len(items) for items in self._deferred.values())

    def defer(self, deliveries: Iterable[Delivery], now: float | None = None) -> None:
        """Set aside deliveries that wait for an earlier seq; they come back with the next
        batch of their queue, or on their own once they have waited ``gap_timeout_s``."""
        stamp = time.monotonic() if now is None else now
        with self._changed:
            touched = set()
            for delivery in deliveries:
                if delivery.deferred_since is None:
                    delivery.deferred_since = stamp
                self._deferred.setdefault(delivery.queue, []).append(delivery)
                touched.add(delivery.queue)
            for queue in touched:
                self._deferred[queue].sort(key=_delivery_order)
            self._changed.notify_all()

    def deferred_items(self) -> dict[str, list[Delivery]]:
        """A copy of what is deferred, per queue."""
        with self._changed:
            return {queue: list(items) for queue, items in self._deferred.items() if items}

    def expire_deferred(
        self, queue: str, which: Callable[[Delivery], bool], now: float | None = None
    ) -> int:
        """Make the deferred deliveries of ``queue`` that ``which`` picks due at once, as if
        they had waited ``gap_timeout_s``: their gap is given up at the next take."""
        stamp = (time.monotonic() if now is None else now) - self._gap_timeout_s
        expired = 0
        with self._changed:
            for delivery in self._deferred.get(queue, ()):
                if which(delivery):
                    delivery.deferred_since = min(delivery.deferred_since or stamp, stamp)
                    expired += 1
            if expired:
                self._changed.notify_all()
        return expired

    def last_arrival(self, queue: str) -> float | None:
        with self._changed:
            return self._last_arrival.get(queue)

    def take(self, max_events: int, max_wait_s: float, idle_wait_s: float) -> list[Delivery]:
        """A batch: wait up to ``idle_wait_s`` for a first event, then until ``max_events``
        are buffered or ``max_wait_s`` passed since the oldest arrived; [] if woken or idle."""
        with self._changed:
            deadline = time.monotonic() + idle_wait_s
            while self._count == 0 and not self._woken:
                now = time.monotonic()
                due = self._deferred_due()
                if due is not None and due <= now:
                    break  # a gap has waited long enough: its events go on their own
                wake_at = deadline if due is None else min(deadline, due)
                if wake_at <= now:
                    return []
                self._changed.wait(wake_at - now)
            self._filling_to = max_events
            while self._count < max_events and not self._woken:
                if self._first_arrival is None:  # all dropped while we waited (queue lost)
                    break
                left = self._first_arrival + max_wait_s - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            self._filling_to = 1
            self._woken = False
            return self._take_locked(max_events)

    def _take_locked(self, max_events: int) -> list[Delivery]:
        """A prefix of each queue, shared fairly: busy queues must not starve the others, and
        queues left behind catch up (``batch_shares``).

        Queues are visited least recently served first and the ones served move to the end,
        so with ``Q`` queues and an even half of ``E = ceil(max_events / 2)`` events, a queue
        with ready events is served within ``ceil(Q / E)`` takes (every take when ``Q <= E``)."""
        quotas = batch_shares(self._queues, max_events, self._shared_cap)
        due_before = time.monotonic() - self._gap_timeout_s
        # A gap that is due is given up by the batch that takes its waiting events: all of
        # its queue that is buffered here joins that batch, or an event that would fill the
        # gap, arrived but past the queue's share, would come in the next one, late.
        due = {q for q, items in self._deferred.items() if _due(items, due_before)}
        taken: list[Delivery] = []
        for queue in [*quotas, *(due - quotas.keys())]:
            fifo = self._queues.pop(queue, deque())
            quota = len(fifo) if queue in due else quotas[queue]
            # What waits in this queue rejoins it: the events taken may fill its gap.
            taken.extend(self._deferred.pop(queue, ()))
            taken.extend(fifo.popleft() for _ in range(quota))
            if fifo or queue in quotas:
                self._queues[queue] = fifo  # re-inserted last: served most recently
            self._count -= quota
        self._reset_first_arrival()
        return taken

    def _deferred_due(self) -> float | None:
        """When the longest-deferred delivery's gap is due to be given up."""
        oldest = [
            d.deferred_since
            for items in self._deferred.values()
            for d in items
            if d.deferred_since is not None
        ]
        return min(oldest) + self._gap_timeout_s if oldest else None

    def put_back(self, deliveries: Iterable[Delivery]) -> None:
        """Return unsettled deliveries to the front of their queues, in their order."""
        by_queue: dict[str, list[Delivery]] = {}
        for delivery in deliveries:
            by_queue.setdefault(delivery.queue, []).append(delivery)
        with self._changed:
            for queue, items in by_queue.items():
                fifo = self._queues.setdefault(queue, deque())
                fifo.extendleft(sorted(items, key=_delivery_order, reverse=True))
                self._count += len(items)
            self._reset_first_arrival()

    def drop(
        self, queue: str, channel_epoch: int | None = None, *, keep_waits: bool = False
    ) -> int:
        """Forget a queue's buffered deliveries (the broker requeues them when the channel
        closes); with an epoch, only those of that consumer incarnation or older. With
        ``keep_waits`` (the same worker consumes the queue again at once), the deferred ones'
        redeliveries keep waiting from when they first did."""
        with self._changed:
            deferred = self._deferred.pop(queue, [])
            kept_deferred = (
                []
                if channel_epoch is None
                else [d for d in deferred if d.channel_epoch > channel_epoch]
            )
            if kept_deferred:
                self._deferred[queue] = kept_deferred
            if keep_waits:
                for delivery in deferred:
                    if channel_epoch is not None and delivery.channel_epoch > channel_epoch:
                        continue  # kept
                    identity = _identity(delivery)
                    if identity is not None and delivery.deferred_since is not None:
                        slot = (queue, identity)
                        self._waits[slot] = min(
                            self._waits.get(slot, delivery.deferred_since), delivery.deferred_since
                        )
            elif self._waits:
                for slot in [slot for slot in self._waits if slot[0] == queue]:
                    del self._waits[slot]
            deferred_dropped = len(deferred) - len(kept_deferred)
            fifo = self._queues.get(queue)
            if not fifo:
                self._queues.pop(queue, None)
                self._last_arrival.pop(queue, None)
                self._changed.notify_all()
                return deferred_dropped
            if channel_epoch is None:
                kept: deque[Delivery] = deque()
            else:
                kept = deque(d for d in fifo if d.channel_epoch > channel_epoch)
            dropped = len(fifo) - len(kept)
            if kept:
                self._queues[queue] = kept
            else:
                self._queues.pop(queue, None)
                self._last_arrival.pop(queue, None)
            self._count -= dropped
            self._reset_first_arrival()
            self._changed.notify_all()  # a waiting take must see what is gone
            return dropped + deferred_dropped

    def _reset_first_arrival(self) -> None:
        heads = [fifo[0].received_at for fifo in self._queues.values() if fifo]
        self._first_arrival = min(heads) if heads else None


def _identity(delivery: Delivery) -> tuple[str, ...] | None:
    """What a redelivery of the same event shares: its key, producer and seq (what every
    event that can wait carries), else its message id."""
    headers = delivery.headers
    seq = headers.get(HEADER_SEQ)
    if seq is not None:
        return (str(headers.get(HEADER_KEY)), str(headers.get(HEADER_PRODUCER)), str(seq))
    return None if delivery.message_id is None else (delivery.message_id,)


def _due(items: Iterable[Delivery], before: float) -> bool:
    return any(d.deferred_since is not None and d.deferred_since <= before for d in items)
