"""A keyed queue's lane on the producer's I/O thread: what it knows of the queue on the current
connection, and why the queue's events wait (park) instead of going out."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from keyq.producer.outgoing import Outgoing, events_in


class ParkReason(enum.Enum):
    """Why a queue's newer events wait in its lane's ``parked``, in submission order. Each
    reason holds one queue only, so no queue ever stalls the others."""

    # The broker returned (or refused) an event: everything sent before settles, the queue is
    # declared again and the returned events go again first, so a deletion never reorders a key.
    RECOVERING = enum.auto()
    # No publish lease (see ``broker.retirement``): the events wait for a fresh one.
    HELD = enum.auto()
    # The queue's node is down (a 404 on a cluster): the events wait for it to answer.
    UNREACHABLE = enum.auto()
    # A new key's queue is being declared apart (``keyq.producer.declarers``).
    DECLARING = enum.auto()


@dataclass(slots=True, eq=False)
class QueueLane:
    """One keyed queue as the I/O thread knows it on the current connection."""

    key: str | None
    declared: bool = False
    registered: bool = False
    inflight: int = 0
    lease_until: float = 0.0  # monotonic time until which events may be sent
    # Counts the breaks in the queue's leases: a lease refused (a retirement mark), one asked
    # only after the last ran out, or a new incarnation. Between two breaks the queue was
    # leased without a gap, so no deleter can have deleted it (``Sender._settle``).
    lease_chain: int = 0
    leasing: bool = False  # a lease request is on its way
    incarnation: int = 0  # which incarnation of the queue leases name (see broker.naming)
    recoveries: int = 0  # recoveries in a row without an event published in between
    reasons: set[ParkReason] = field(default_factory=set)
    declaring: str | None = None  # the name being declared apart, while DECLARING
    returned: list[Outgoing] = field(default_factory=list)
    parked: deque[Outgoing] = field(default_factory=deque)
    # Events waiting for others of the queue to join their pack (``keyq.producer.packing``):
    # while an earlier message of the queue awaits its confirm, or for the linger.
    gathering: list[Outgoing] = field(default_factory=list)
    gathered_events: int = 0
    gathered_bytes: int = 0
    gathered_at: float = 0.0  # monotonic time the oldest of them began to wait

    @property
    def waiting(self) -> bool:
        """Its events park instead of going out (for any reason)."""
        return bool(self.reasons)

    def hold(self, message: Outgoing) -> None:
        """Park ``message``, behind whatever was gathering for a pack (those are older)."""
        if self.gathering:
            self.parked.extend(self.take_gathered())
        self.parked.append(message)

    def gather(self, message: Outgoing, size: int, now: float) -> None:
        if not self.gathering:
            self.gathered_at = now
        self.gathering.append(message)
        self.gathered_events += message.count
        self.gathered_bytes += size

    def take_gathered(self) -> list[Outgoing]:
        gathered, self.gathering = self.gathering, []
        self.gathered_events = self.gathered_bytes = 0
        return gathered

    def parked_for(self, reason: ParkReason) -> bool:
        return reason in self.reasons

    def park(self, reason: ParkReason) -> None:
        self.reasons.add(reason)

    def unpark(self, reason: ParkReason) -> None:
        self.reasons.discard(reason)

    @property
    def unreachable(self) -> bool:
        return ParkReason.UNREACHABLE in self.reasons

    @unreachable.setter
    def unreachable(self, down: bool) -> None:
        if down:
            self.reasons.add(ParkReason.UNREACHABLE)
        else:
            self.reasons.discard(ParkReason.UNREACHABLE)

    def start_declaring(self, name: str) -> None:
        self.declaring = name
        self.reasons.add(ParkReason.DECLARING)

    def stop_declaring(self) -> None:
        self.declaring = None
        self.reasons.discard(ParkReason.DECLARING)

    @property
    def quiet(self) -> bool:
        """Nothing of it is in flight or on its way: its lane can be forgotten."""
        return not (
            self.inflight
            or ParkReason.RECOVERING in self.reasons
            or self.returned
            or self.parked
            or self.gathering
            or self.leasing
            or ParkReason.DECLARING in self.reasons
        )

    def take_releasable(self) -> deque[Outgoing]:
        """Its parked events, to send now, unless some reason still holds them."""
        if self.waiting:
            return deque()
        parked, self.parked = self.parked, deque()
        return parked

    def take_back(self, pending: list[Outgoing]) -> None:
        """Events sent but never settled (their channel closed) wait again, in order."""
        self.inflight -= len(pending)
        waiting = [*pending, *self.take_gathered(), *self.parked]
        self.parked = deque(sorted(waiting, key=lambda message: message.number))

    def begin_recovery(self) -> tuple[list[Outgoing], deque[Outgoing]]:
        """Its returned events in submission order, then the parked ones, to send again to a
        queue declared anew."""
        returned = sorted(self.returned, key=lambda message: message.number)
        waiting = [*self.take_gathered(), *self.parked]
        parked = deque(sorted(waiting, key=lambda message: message.number))
        self.returned = []
        self.parked = deque()
        self.reasons.discard(ParkReason.RECOVERING)
        self.declared = False
        self.registered = False
        return returned, parked


def parked_counts(lanes: Iterable[QueueLane], reason: ParkReason) -> tuple[int, int]:
    """Events and queues waiting for ``reason`` (a deleted queue's returned events count)."""
    events = queues = 0
    for lane in lanes:
        if reason in lane.reasons:
            queues += 1
            events += events_in(lane.parked)
            if reason is ParkReason.RECOVERING:
                events += events_in(lane.returned)
    return events, queues


def forget_quiet(lanes: dict[str, QueueLane]) -> None:
    """Bound memory with many keys: drop lanes with nothing in flight."""
    for queue in [queue for queue, lane in lanes.items() if lane.quiet]:
        del lanes[queue]
