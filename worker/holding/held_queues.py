"""The one owner of a held queue's life cycle: its holding, its consumer, its buffered
deliveries and its fenced lock, ended in one order whichever thread ends it.

Threads: the claim loop claims queues and stops those whose lock it finds lost; the batch
loop applies each batch's outcome (reopening queues, stopping those a refused commit found
lost), hands queues back at a batch boundary, and hands everything back at stop. Both settle
the consumers the broker took away: the AMQP I/O thread only queues those
(``ConsumerLink.gone``), it never waits on Redis.
"""

from __future__ import annotations

import logging
import queue as queue_module
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import redis.exceptions

from keyq.broker.connections import FAILING_OVER
from keyq.broker.errors import KeyqError
from keyq.broker.locks import FencedLocks, Lease
from keyq.broker.log_context import about_queues
from keyq.broker.registry import QueueRegistry
from keyq.worker.amqp.consume_rounds import Consumed, ConsumeOutcome
from keyq.worker.amqp.deliveries import Delivery, DeliveryBuffer
from keyq.worker.amqp.link import ConsumerCalls
from keyq.worker.amqp.queue_channels import ConsumerGone
from keyq.worker.batch.outcome import BatchOutcome
from keyq.worker.holding.held_index import Held, Holdings

log = logging.getLogger("keyq.worker.held")

# (kind, queues, reason): kind is "assigned" or "revoked"; the batch loop runs the user's
# callbacks for it.
QueueEvents = queue_module.SimpleQueue[tuple[str, list[str], str]]
MAX_PREFETCH = 65535  # the most unacked messages an AMQP consumer's prefetch can allow
_SERVICE_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.RedisError,
    OSError,
    *FAILING_OVER,
)


class HandBackObserver(Protocol):
    """Told of each hand-back (``keyq.worker.amqp.starvation`` subscribes)."""

    def handed_back(self, reasons: Mapping[str, str], starved: set[str]) -> None:
        """Queues just handed back (queue -> reason), their consumers closed and their locks
        still ours; ``starved``: those that delivered nothing while held."""


class LeasedQueues(Protocol):
    """Queues consumed under a held queue's lease (the aside queues being drained,
    ``keyq.worker.holding.aside_drains``): they end with that lease."""

    def lease_for(self, queue: str, epoch: int) -> Lease | None: ...

    def end(self, leases: Collection[Lease]) -> None:
        """Close the consumers under ``leases`` and drop what of them is buffered."""

    def gone(self, event: ConsumerGone) -> bool:
        """Forget a consumer the broker took away; False if it is not one of these."""

    def detach(self, queue: str) -> None:
        """Stop consuming ``queue``."""


@dataclass(frozen=True)
class Claimed:
    """A claim's outcome: ``held`` is set when the queue is consumed and held now."""

    lease: Lease
    consumed: Consumed
    held: Held | None


class HeldQueues:
    """Holds queues for one worker; every verb is safe from the claim and batch loops."""

    def __init__(
        self,
        *,
        consumers: ConsumerCalls,
        gone: queue_module.SimpleQueue[ConsumerGone],
        buffer: DeliveryBuffer,
        locks: FencedLocks,
        registry: QueueRegistry,
        events: QueueEvents,
        aside: LeasedQueues,
        observers: Sequence[HandBackObserver] = (),
    ) -> None:
        self._consumers = consumers
        self._gone = gone
        self._buffer = buffer
        self._locks = locks
        self._registry = registry
        self._events = events
        self._aside = aside
        self._observers = observers
        self._holdings = Holdings()
        self._counts_lock = threading.Lock()
        self.lost = 0  # holdings ended without handing the queue back
        self.released = 0  # queues handed back while running (idle, rebalance)

    # ---- what is held ----------------------------------------------------------------------

    def get(self, queue: str) -> Held | None:
        return self._holdings.get(queue)

    def lease_for(self, queue: str, epoch: int) -> Lease | None:
        """The lease a delivery of consumer ``epoch`` may be committed under, if any (an aside
        queue's is that of the queue it is drained under): the batch's ``LeaseLookup``."""
        return self._holdings.lease_for(queue, epoch) or self._aside.lease_for(queue, epoch)

    def room_of(self, queue: str) -> int | None:
        """The AMQP prefetch (messages, a pack of events counting once) of ``queue``'s
        current consumer; None if it is not held."""
        held = self._holdings.get(queue)
        if held is None:
            return None
        return held.prefetch if held.prefetch is not None else self._consumers.prefetch

    def all(self) -> list[Held]:
        return self._holdings.all()

    def queues(self) -> list[str]:
        return self._holdings.queues()

    def __len__(self) -> int:
        return len(self._holdings)

    def __contains__(self, queue: object) -> bool:
        return queue in self._holdings

    # ---- beginning and renewing a holding --------------------------------------------------

    def claim(self, leases: Sequence[Lease], budget_s: float) -> list[Claimed]:
        """Consume the queues of ``leases`` (locked already). Each is held before its consumer
        opens, since its first deliveries may reach the batch loop before the call returns;
        the locks of those not consumed are released. A connection failure releases every
        lock of the call and raises (no consumer of it outlives that connection)."""
        claims = [
            Held(queue=lease.queue, lease=lease, epoch=self._consumers.new_epoch())
            for lease in leases
        ]
        for held in claims:
            self._holdings.add(held)
        try:
            results = self._consumers.consume_many(
                [(held.queue, held.epoch) for held in claims], budget_s=budget_s
            )
        except KeyqError:
            for held in claims:
                self._holdings.remove(held.queue, held.epoch)
            self._locks.release(list(leases))
            raise
        outcomes: list[Claimed] = []
        not_held: list[Lease] = []
        for held, consumed in zip(claims, results, strict=True):
            if consumed.outcome is ConsumeOutcome.CONSUMING:
                outcomes.append(Claimed(held.lease, consumed, held))
                continue
            self._holdings.remove(held.queue, held.epoch)
            not_held.append(held.lease)
            outcomes.append(Claimed(held.lease, consumed, None))
        self._locks.release(not_held)
        consuming = [c.lease.queue for c in outcomes if c.held is not None]
        if consuming:
            self._events.put(("assigned", consuming, "claimed"))
        return outcomes

    def reopen(
        self,
        queue: str,
        prefetch: int | None = None,
        closed: Callable[[], None] | None = None,
    ) -> bool:
        """Close ``queue``'s consumer, which hands every unacked delivery back in order, and
        consume it again at once under the same lock, with an AMQP prefetch of ``prefetch``
        messages or the one it had; ``closed`` is called in between, the old one's deliveries
        still buffered. Its deferred events keep their waiting time. False if it is not held
        (any more), or the broker cannot consume it now (it is let go)."""
        self.settle_gone()  # a consumer the broker took away is not reopened, but ended
        held = self._holdings.get(queue)
        if held is None:
            return False
        if prefetch is None:
            prefetch = held.prefetch
        self._consumers.close_queue(queue, held.epoch)
        if closed is not None:
            closed()
        self._buffer.drop(queue, held.epoch, keep_waits=True)
        again = Held(
            queue=queue,
            lease=held.lease,
            epoch=self._consumers.new_epoch(),
            since=held.since,
            prefetch=prefetch,
        )
        self._holdings.add(again)
        try:
            consumed = self._consumers.consume(queue, again.epoch, prefetch=prefetch)
        except KeyqError as exc:  # the link is down: nothing consumes it, so it is let go
            self._end(again, f"reopening it failed: {exc}", lock_lost=False)
            return False
        if consumed.outcome is ConsumeOutcome.CONSUMING:
            return True
        self._end(again, f"reopening it failed: {consumed.outcome}", lock_lost=False)
        return False

    # ---- a batch's outcome -----------------------------------------------------------------

    def apply(self, outcome: BatchOutcome) -> None:
        """Act on what a batch came to: defer what waits for an earlier seq, stop consuming
        the aside queues held back, put back what is over its rate and what was not
        settled, and stop the queues whose locks moved on."""
        self._defer(outcome.deferred)
        for queue in outcome.handed_back:
            self._aside.detach(queue)
        # Over their key's rate: back in the buffer, in order, for a later batch.
        self.put_back(outcome.later)
        for lease in outcome.lost:
            self.lose(lease, "commit refused: the lock moved on")
        self.put_back(outcome.unsettled)

    def put_back(self, deliveries: Iterable[Delivery]) -> None:
        """Return a batch's unsettled deliveries to the buffer, those of queues still held
        under the same consumer. The others' consumers are closed if still open, so that the
        broker hands those deliveries out again, in order: never keep a consumer whose
        deliveries were let go."""
        still_held: list[Delivery] = []
        orphaned: set[tuple[str, int]] = set()
        for delivery in deliveries:
            if self.lease_for(delivery.queue, delivery.channel_epoch):
                still_held.append(delivery)
            else:
                orphaned.add((delivery.queue, delivery.channel_epoch))
        if still_held:
            self._buffer.put_back(still_held)
        self._consumers.close_queues(sorted(orphaned))

    def _defer(self, waiting: list[Delivery]) -> None:
        """Keep what waits for an earlier seq. A consumer whose whole prefetch is deferred
        would never be sent the events that fill the gap: it is reopened with room for more
        (closing hands every unacked delivery back, in order). Counted in messages, as the
        broker counts the prefetch: a pack with an event deferred is a message unacked."""
        if not waiting:
            return
        fresh = [d for d in waiting if self.lease_for(d.queue, d.channel_epoch)]
        self._buffer.defer(fresh)
        for queue in {d.queue for d in fresh}:
            room = self.room_of(queue)
            if room is None:
                continue
            deferred = self._buffer.deferred_messages(queue)
            if deferred < room or room >= MAX_PREFETCH:
                continue
            wider = min(MAX_PREFETCH, deferred + self._consumers.prefetch)
            log.info(
                "queue %s: all %d unacked messages wait for an earlier seq; reopening it with "
                "a prefetch of %d messages",
                queue,
                deferred,
                wider,
            )
            self.reopen(queue, wider)

    # ---- ending a holding -------------------------------------------------------------------

    def hand_back(self, requests: dict[str, str], *, busy: Callable[[str], bool]) -> list[str]:
        """Hand queues back at a batch boundary (``requests``: queue -> reason); an idle one
        that ``busy`` says has work again is kept. Returns the queues handed back."""
        asked = [
            held
            for queue, reason in requests.items()
            if (held := self._holdings.get(queue)) is not None
            and not (reason == "idle" and busy(queue))
        ]
        ended, starved = self._fence_all(asked)
        if not ended:
            return []
        # The locks are still ours: no peer has consumed what the closes gave back.
        reasons = {held.queue: requests[held.queue] for held in ended}
        for observer in self._observers:
            observer.handed_back(reasons, starved)
        with self._counts_lock:
            self.released += len(ended)
        log.info("handed back %d queues", len(ended))
        self._let_go(ended, "released")
        return list(reasons)

    def hand_back_all(self) -> list[Held]:
        """At stop: close every consumer, then hand every lock back in one round trip (a
        failure leaves them to expire). Returns what was held."""
        self.settle_gone()
        held, _starved = self._fence_all(self._holdings.all())
        self._let_go(held, "shutdown")
        return held

    def lose(self, lease: Lease, reason: str) -> None:
        """Stop a queue whose lock is no longer ours (found lost by a renewal or a refused
        commit), at once: nothing of it is committed or acked from now on. A newer holding
        of the queue is left alone."""
        held = self._holdings.get(lease.queue)
        if held is not None and held.lease == lease:
            self._end(held, reason, lock_lost=True)

    def settle_gone(self) -> int:
        """End the holdings whose consumers the broker took away (``ConsumerLink.gone``),
        their locks released in a round trip per reason; how many ended. A stale report (an
        older consumer of a queue held anew) is ignored."""
        by_reason: dict[str, list[Held]] = {}
        while True:
            try:
                event = self._gone.get_nowait()
            except queue_module.Empty:
                break
            held = self._holdings.get(event.queue)
            if self._aside.gone(event) or held is None or held.epoch != event.epoch:
                continue
            by_reason.setdefault(event.why, []).append(held)
        count = 0
        for reason, helds in by_reason.items():
            ended, _starved = self._fence_all(helds)
            self._count_lost(len(ended))
            self._let_go(ended, reason)
            count += len(ended)
        return count

    def _end(self, held: Held, reason: str, *, lock_lost: bool) -> None:
        """End a holding that was not handed back (lost): fence, close, drop, then the lock."""
        ended, _starved = self._fence_all([held])
        if not ended:
            return
        self._count_lost(1)
        with about_queues([held.queue]):
            log.warning("lost %s (%s): stopping it", held.queue, reason)
        self._let_go(ended, reason, lock_lost=lock_lost)

    def _count_lost(self, count: int) -> None:
        with self._counts_lock:
            self.lost += count

    def _fence_all(self, helds: Sequence[Held]) -> tuple[list[Held], set[str]]:
        """The order every ending follows; returns the holdings it ended (not those that
        had ended already), and which of them delivered nothing while held.

        1. Forget the holding: no batch takes a lease for its deliveries from now on, so
           nothing of it is committed or acked. The aside queues drained under its lease
           end with it.
        2. Close its consumer's channel (never cancel first: the queue would look unused
           while it still holds our unacked deliveries, and a janitor's delete(if_empty,
           if_unused) would take them). Closing hands them back to the queue, in order.
           The channels of all ``helds`` close together, with one round trip.
        3. Drop its buffered deliveries: after the close none of that consumer can arrive,
           so nothing of it is left behind to be processed.
        Only then may the lock go (``_let_go``): a peer that claims the queue finds it with
        every unsettled event back, and no consumer of ours on it.
        """
        ended = [
            held for held in helds if self._holdings.remove(held.queue, held.epoch) is not None
        ]
        if not ended:
            return [], set()
        self._aside.end({held.lease for held in ended})
        self._consumers.close_queues([(held.queue, held.epoch) for held in ended])
        starved = {held.queue for held in ended if self._starved(held)}  # nothing more can come
        for held in ended:
            self._buffer.drop(held.queue, held.epoch)
        return ended, starved

    def _starved(self, held: Held) -> bool:
        """Nothing has arrived from ``held``'s queue since the holding began."""
        last = self._buffer.last_arrival(held.queue)
        return last is None or last < held.since

    def _let_go(self, ended: list[Held], reason: str, *, lock_lost: bool = False) -> None:
        """The tail of every ending, once fenced: let the locks go, and report the queues
        revoked. A lock still ours is released (a Redis failure leaves it to expire). A lock
        lost is left alone and its queue registered again: a lock is lost with the queue's
        registration when Redis fails over to a replica that had neither, and the messages
        back in the queue would otherwise wait for a producer to use the key again."""
        if not ended:
            return
        queues = [held.queue for held in ended]
        try:
            if lock_lost:
                self._registry.register(dict.fromkeys(queues))
            else:
                self._locks.release([held.lease for held in ended])
        except _SERVICE_ERRORS as exc:
            if not lock_lost:
                log.warning("%d queue(s) %s: locks left to expire: %s", len(ended), reason, exc)
        self._events.put(("revoked", queues, reason))
