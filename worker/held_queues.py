"""The one owner of a held queue's life cycle: its holding, its consumer, its buffered
deliveries and its fenced lock, ended in one order whichever thread ends it.

Threads: the claim loop claims queues, stops those whose lock it finds lost, and settles the
losses the I/O thread reports; the batch loop reopens queues, hands them back at a batch
boundary, stops those a refused commit found lost, and hands everything back at stop; the
AMQP I/O thread reports consumers the broker took away. That thread never waits on Redis: a
loss it reports is fenced in memory at once, and its lock is released by the claim loop.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import queue as queue_module
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import redis.exceptions

from keyq.broker.connections import FAILING_OVER
from keyq.broker.errors import KeyqError
from keyq.broker.locks import FencedLocks, Lease
from keyq.broker.log_context import about_queues
from keyq.broker.registry import QueueRegistry
from keyq.worker.consumer import Consumed, ConsumeOutcome, ConsumerLink
from keyq.worker.deliveries import Delivery, DeliveryBuffer
from keyq.worker.holdings import Held, Holdings
from keyq.worker.starvation import StarvationWatch, ready_after_close

log = logging.getLogger("keyq.worker.held")

# Report(kind, queues, reason): kind is "assigned" or "revoked"; the batch loop runs the
# user's callbacks for it.
Report = Callable[[str, list[str], str], None]
_SERVICE_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.RedisError,
    OSError,
    *FAILING_OVER,
)


class LockFate(enum.Enum):
    """What becomes of a queue's lock when its holding ends."""

    RELEASE = "release"  # ours: let it go now, so that a peer can claim the queue at once
    LOST = "lost"  # not ours any more: leave it, and register the queue again
    DEFERRED = (
        "deferred"  # ours, but this thread must not wait on Redis: the claim loop releases it
    )


@dataclass(frozen=True)
class Claimed:
    """A claim's outcome: ``held`` is set when the queue is consumed and held now."""

    lease: Lease
    consumed: Consumed
    held: Held | None


class HeldQueues:
    """Holds queues for one worker; every verb is safe from any of the worker's threads."""

    def __init__(
        self,
        *,
        link: ConsumerLink,
        buffer: DeliveryBuffer,
        locks: FencedLocks,
        registry: QueueRegistry,
        report: Report,
        prefetch: int,
    ) -> None:
        """``prefetch``: the AMQP prefetch (messages) a consumer opens with
        (``ConsumerLink.prefetch``)."""
        self._link = link
        self._prefetch = prefetch
        self._buffer = buffer
        self._locks = locks
        self._registry = registry
        self._report = report
        self._holdings = Holdings()
        # Queues a key's events wait in aside, consumed under the lease of the key's queue
        # while this worker drains them (``keyq.worker.aside_drains``).
        self._sides = Holdings()
        # Losses the I/O thread reported, whose locks the claim loop releases.
        self._gone: queue_module.SimpleQueue[tuple[Lease, str]] = queue_module.SimpleQueue()
        # Side consumers of a holding the I/O thread ended: closed by the claim loop.
        self._sides_to_close: queue_module.SimpleQueue[tuple[str, int]] = queue_module.SimpleQueue()
        self._counts_lock = threading.Lock()
        self._starvation = StarvationWatch()
        self.lost = 0  # holdings ended without handing the queue back
        self.released = 0  # queues handed back while running (idle, rebalance)
        self.starved_moves = 0  # connections moved to another node (keyq.worker.starvation)

    # ---- what is held ----------------------------------------------------------------------

    def get(self, queue: str) -> Held | None:
        return self._holdings.get(queue)

    def lease_for(self, queue: str, epoch: int) -> Lease | None:
        """The lease a delivery of consumer ``epoch`` may be committed under, if any (a side
        queue's is that of the queue it is attached to)."""
        return self._holdings.lease_for(queue, epoch) or self._sides.lease_for(queue, epoch)

    def room_of(self, queue: str) -> int | None:
        """The AMQP prefetch (messages, a pack of events counting once) of ``queue``'s
        current consumer; None if it is not held."""
        held = self._holdings.get(queue)
        if held is None:
            return None
        return held.prefetch if held.prefetch is not None else self._prefetch

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
            Held(queue=lease.queue, lease=lease, epoch=self._link.new_epoch()) for lease in leases
        ]
        for held in claims:
            self._holdings.add(held)
        try:
            results = self._link.consume_many(
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
            self._report("assigned", consuming, "claimed")
        return outcomes

    def reopen(self, queue: str, prefetch: int | None = None) -> bool:
        """Close ``queue``'s consumer, which hands every unacked delivery back in order, and
        consume it again at once under the same lock, with an AMQP prefetch of ``prefetch``
        messages or the one it had. Its waiting events keep their waiting time. False if it
        is not held (any more)."""
        held = self._holdings.get(queue)
        if held is None:
            return False
        if prefetch is None:
            prefetch = held.prefetch
        self._link.close_queue(queue, held.epoch)
        self._buffer.drop(queue, held.epoch, keep_waits=True)
        again = Held(
            queue=queue,
            lease=held.lease,
            epoch=self._link.new_epoch(),
            since=held.since,
            prefetch=prefetch,
        )
        self._holdings.add(again)
        consumed = self._link.consume(queue, again.epoch, prefetch=prefetch)
        if consumed.outcome is ConsumeOutcome.CONSUMING:
            return True
        self._end(again, f"reopening it failed: {consumed.outcome}", LockFate.RELEASE, close=False)
        return False

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
        self._buffer.put_back(still_held)
        self._link.close_queues(sorted(orphaned))

    # ---- side queues, drained under a held queue's lease ----------------------------------

    def attach(self, side: str, to: str) -> ConsumeOutcome | None:
        """Consume ``side`` (a queue a key's events wait in) under the lease of held queue
        ``to``, with an exclusive consumer. Returns how the consume went (CONSUMING: held
        now; MISSING: the queue is gone; else try later: a zombie's consumer is still on
        it), or None if ``to`` is not held or ``side`` is attached already."""
        main = self._holdings.get(to)
        if main is None or side in self._sides:
            return None
        held = Held(queue=side, lease=main.lease, epoch=self._link.new_epoch())
        self._sides.add(held)
        try:
            consumed = self._link.consume(side, held.epoch)
        except KeyqError:
            self.detach(side)
            raise
        if consumed.outcome is ConsumeOutcome.CONSUMING and to in self._holdings:
            return consumed.outcome
        self.detach(side)
        return consumed.outcome

    def detach(self, side: str) -> None:
        """Stop consuming ``side``: close its consumer (its unacked deliveries go back to
        it, in order), then drop what of it is buffered."""
        held = self._sides.remove(side)
        if held is not None:
            self._link.close_queue(side, held.epoch)
            self._buffer.drop(side, held.epoch)

    def sides(self) -> dict[str, str]:
        """Side queue -> the held queue whose lease it is drained under."""
        return {held.queue: held.lease.queue for held in self._sides.all()}

    # ---- ending a holding -------------------------------------------------------------------

    def release(self, requests: dict[str, str], *, busy: Callable[[str], bool]) -> list[str]:
        """Hand queues back at a batch boundary (``requests``: queue -> reason); an idle one
        that ``busy`` says has work again is kept. Returns the queues handed back."""
        ended = [
            held
            for queue, reason in requests.items()
            if (held := self._holdings.get(queue)) is not None
            and not (reason == "idle" and busy(queue))
        ]
        silent: set[str] = set()
        ended = self._fence_all(ended, close=True, silent=silent)
        if not ended:
            return []
        queues = [held.queue for held in ended]
        # The locks are still ours: no peer has consumed what the closes gave back.
        self._watch_starvation([q for q in queues if requests[q] == "idle"], silent)
        try:
            self._locks.release([held.lease for held in ended])
        except _SERVICE_ERRORS as exc:
            # The consumers are closed already: the locks just run out their ttl.
            log.warning("handing back %d queues: locks left to expire: %s", len(ended), exc)
        with self._counts_lock:
            self.released += len(ended)
        log.info("handed back %d queues", len(ended))
        self._report("revoked", queues, "released")
        return queues

    def _silent(self, held: Held) -> bool:
        """Nothing has arrived from ``held``'s queue since the holding began."""
        last = self._buffer.last_arrival(held.queue)
        return last is None or last < held.since

    def _watch_starvation(self, idle: list[str], silent: set[str]) -> None:
        """Quorum queues handed back idle having delivered nothing, that have messages
        ready once closed, were starved (``keyq.worker.starvation``)."""
        if self._link.queue_type != "quorum" or not idle:
            return
        for queue in idle:
            if queue not in silent:
                self._starvation.delivered(queue)
        looked_into = [queue for queue in idle if queue in silent]
        if not looked_into:
            return
        try:
            ready = ready_after_close(self._link.message_counts, looked_into, time.sleep)
        except (KeyqError, TimeoutError) as exc:
            log.debug("looking into queues handed back silent failed: %s", exc)
            return
        for queue, count in ready.items():
            if count and self._strike(queue, count):
                return

    def watch_quiet(self, quiet_after_s: float, next_look: dict[str, float]) -> None:
        """Bucket mode, on the claim loop: a quorum queue held with nothing arriving for
        ``quiet_after_s``, its consumer holding no unacked message, while the broker counts
        messages ready, is starved (a consumer with room is sent ready messages at once;
        ``keyq.worker.starvation``). ``next_look`` (queue -> monotonic time of its next
        look, one idle time after the last) is the caller's, kept between calls."""
        if self._link.queue_type != "quorum":
            return
        now = time.monotonic()
        held_now = self._holdings.all()
        for gone in next_look.keys() - {held.queue for held in held_now}:
            del next_look[gone]
        for held in held_now:
            last = self._buffer.last_arrival(held.queue)
            if last is not None and last >= held.since and now - last < quiet_after_s:
                self._starvation.delivered(held.queue)
                continue
            if now - max(last or held.since, held.since) < quiet_after_s:
                continue
            if next_look.get(held.queue, 0.0) > now or self._buffer.depth(held.queue):
                continue
            next_look[held.queue] = now + quiet_after_s
            ready = self._link.message_count(held.queue)
            if ready and self._link.unacked_of(held.queue) == 0 and self._strike(held.queue, ready):
                next_look.clear()
                return

    def _strike(self, queue: str, ready: int) -> bool:
        """Count a starved holding of ``queue``; the second within the window through the
        same connection moves it to another node (True), unless it has nowhere to go."""
        if not self._starvation.starved(queue, time.monotonic(), self._link.reconnects):
            return False
        node = self._link.node or "its node"
        why = (
            f"queue {queue}: held twice with nothing delivered while {ready} messages were "
            f"ready; RabbitMQ does not deliver it through {node} (a quorum queue sends "
            "through its replica on the consumer's node: that replica may be down)"
        )
        with about_queues([queue]):
            if self._link.single_node:
                log.error("%s. Only one RabbitMQ URL is set: list every node to move to", why)
                return False
            log.warning("%s. Moving this worker's connection to another node", why)
        with self._counts_lock:
            self.starved_moves += 1
        self._starvation.forget()
        self._link.move(f"queue {queue} starved on {node}: moving to another node")
        return True

    def lose(self, lease: Lease, reason: str) -> None:
        """Stop a queue whose lock is no longer ours (found lost by a renewal or a refused
        commit), at once: nothing of it is committed or acked from now on. A newer holding
        of the queue is left alone."""
        held = self._holdings.get(lease.queue)
        if held is not None and held.lease == lease:
            self._end(held, reason, LockFate.LOST, close=True)

    def consumer_gone(self, queue: str, epoch: int, reason: str) -> None:
        """The broker took consumer ``epoch`` of ``queue`` away (its channel or connection
        closed): called on the I/O thread, so its lock is left to the claim loop."""
        side = self._sides.get(queue)
        if side is not None and side.epoch == epoch:
            self._sides.remove(queue, epoch)
            self._buffer.drop(queue, epoch)
            return
        held = self._holdings.get(queue)
        if held is not None and held.epoch == epoch:
            self._end(held, reason, LockFate.DEFERRED, close=False)

    def settle_gone(self) -> int:
        """On the claim loop: close the side consumers of holdings the I/O thread ended,
        release the locks of the consumers the broker took away, in one round trip, and
        report them revoked. A Redis failure leaves them to expire."""
        gone: list[tuple[Lease, str]] = []
        while True:
            try:
                gone.append(self._gone.get_nowait())
            except queue_module.Empty:
                break
        while True:
            try:
                side, epoch = self._sides_to_close.get_nowait()
            except queue_module.Empty:
                break
            self._link.close_queue(side, epoch)
        if not gone:
            return 0
        with contextlib.suppress(*_SERVICE_ERRORS):  # they expire by themselves
            self._locks.release([lease for lease, _reason in gone])
        by_reason: dict[str, list[str]] = {}
        for lease, reason in gone:
            by_reason.setdefault(reason, []).append(lease.queue)
        for reason, queues in by_reason.items():
            self._report("revoked", queues, reason)
        return len(gone)

    def release_all(self) -> list[Held]:
        """At stop: close every consumer, then hand every lock back in one round trip (a
        failure leaves them to expire). Returns what was held."""
        held = self._fence_all(self._holdings.all(), close=True)
        self.settle_gone()
        try:
            self._locks.release([item.lease for item in held])
        except _SERVICE_ERRORS:
            log.warning("could not release locks at shutdown; they expire by themselves")
        if held:
            self._report("revoked", [item.queue for item in held], "shutdown")
        return held

    def _end(self, held: Held, reason: str, fate: LockFate, *, close: bool) -> None:
        """End a holding that was not handed back (lost): fence, close, drop, then the lock."""
        if not self._fence(held, close=close):
            return
        with self._counts_lock:
            self.lost += 1
        if fate is LockFate.DEFERRED:
            self._gone.put((held.lease, reason))
            return
        with about_queues([held.queue]):
            log.warning("lost %s (%s): stopping it", held.queue, reason)
        if fate is LockFate.RELEASE:
            with contextlib.suppress(*_SERVICE_ERRORS):  # it expires by itself
                self._locks.release([held.lease])
        else:
            # A lock is lost with the queue's registration when Redis fails over to a replica
            # that had neither: register it again, or its messages, back in the queue now,
            # would wait for a producer to use the key again before any worker claimed them.
            with contextlib.suppress(*_SERVICE_ERRORS):
                self._registry.register({held.queue: None})
        self._report("revoked", [held.queue], reason)

    def _fence(self, held: Held, *, close: bool) -> bool:
        """``_fence_all`` for one holding: False if it had ended already."""
        return bool(self._fence_all([held], close=close))

    def _fence_all(
        self, helds: Sequence[Held], *, close: bool, silent: set[str] | None = None
    ) -> list[Held]:
        """The order every ending follows; returns the holdings it ended (not those that
        had ended already).

        1. Forget the holding: no batch takes a lease for its deliveries from now on, so
           nothing of it is committed or acked.
        2. Close its consumer's channel (never cancel first: the queue would look unused
           while it still holds our unacked deliveries, and a janitor's delete(if_empty,
           if_unused) would take them). Closing hands them back to the queue, in order.
           The channels of all ``helds`` close together, with one round trip.
        3. Drop its buffered deliveries: after the close none of that consumer can arrive,
           so nothing of it is left behind to be processed.
        Only then may the lock go (the caller's part): a peer that claims the queue finds
        it with every unsettled event back, and no consumer of ours on it.
        """
        ended = [
            held for held in helds if self._holdings.remove(held.queue, held.epoch) is not None
        ]
        leases = {held.lease for held in ended}
        sides = [  # drained under an ended lease: they end with it
            side
            for side in self._sides.all()
            if side.lease in leases and self._sides.remove(side.queue, side.epoch)
        ]
        if close:
            self._link.close_queues([(held.queue, held.epoch) for held in ended + sides])
        else:  # the I/O thread: it must not wait on itself (its own consumer is gone)
            for side in sides:
                self._sides_to_close.put((side.queue, side.epoch))
        if silent is not None:  # judged once nothing more of them can arrive
            silent.update(held.queue for held in ended if self._silent(held))
        for held in ended + sides:
            self._buffer.drop(held.queue, held.epoch)
        return ended
