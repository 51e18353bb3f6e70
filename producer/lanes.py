"""A keyed queue's lane on the producer's I/O thread: what it knows of the queue on the current
connection, and why the queue's events wait instead of going out. Only its own methods change
it, so each rule about a lane's state lives here."""

from __future__ import annotations

import enum
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from keyq.broker.backoff import Backoff
from keyq.producer.outgoing import Outgoing, events_in

# Before re-sending to a queue that returned events again right after its last recovery (a
# quorum queue electing a leader keeps returning them): no tight loop of returns.
RECOVERY_FIRST_S = 0.05
RECOVERY_MAX_S = 1.0


class WaitReason(enum.Enum):
    """Why a queue's newer events wait in its lane's ``waiting``, in submission order. Each
    reason holds back one queue only, so no queue ever stalls the others."""

    # The broker returned (or refused) an event: everything sent before settles, the queue is
    # declared again and the returned events go again first, so a deletion never reorders a key.
    RECOVERING = enum.auto()
    # No publish lease (see ``broker.retirement``): the events wait for a fresh one.
    UNLEASED = enum.auto()
    # The queue's node is down (a 404 on a cluster): the events wait for it to answer.
    UNREACHABLE = enum.auto()
    # A new key's queue is being declared apart (``keyq.producer.declarers``).
    DECLARING = enum.auto()
    # Auto mode: the key's first events for its own queue wait until its earlier ones have
    # left its bucket (``keyq.producer.route_follow``).
    SWITCHING = enum.auto()


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
    # leased without a gap, so no deleter can have deleted it (``ConfirmLedger``).
    lease_chain: int = 0
    leasing: bool = False  # a lease request is on its way
    incarnation: int = 0  # which incarnation of the queue leases name (see broker.naming)
    recoveries: int = 0  # recoveries in a row without an event published in between
    recovery_delays: Backoff | None = None  # while recoveries follow one another
    reasons: set[WaitReason] = field(default_factory=set)
    declaring: str | None = None  # the name being declared apart, while DECLARING
    returned: list[Outgoing] = field(default_factory=list)
    waiting: deque[Outgoing] = field(default_factory=deque)
    # Events waiting for others of the queue to join their pack (``keyq.producer.packing``):
    # while an earlier message of the queue awaits its confirm, or for the linger.
    gathering: list[Outgoing] = field(default_factory=list)
    gathered_events: int = 0
    gathered_bytes: int = 0
    gathered_at: float = 0.0  # monotonic time the oldest of them began to wait

    @property
    def waits(self) -> bool:
        """Its events wait instead of going out (for any reason)."""
        return bool(self.reasons)

    def waits_for(self, reason: WaitReason) -> bool:
        return reason in self.reasons

    def wait(self, reason: WaitReason) -> None:
        self.reasons.add(reason)

    def release(self, reason: WaitReason) -> None:
        self.reasons.discard(reason)

    def add_waiting(self, message: Outgoing) -> None:
        """``message`` waits, behind whatever was gathering for a pack (those are older)."""
        if self.gathering:
            self.waiting.extend(self.take_gathered())
        self.waiting.append(message)

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

    @property
    def unreachable(self) -> bool:
        return WaitReason.UNREACHABLE in self.reasons

    def reachable(self) -> None:
        """Its node answered a declaration of it: declared, its events may go."""
        self.reasons.discard(WaitReason.UNREACHABLE)
        self.declared = True

    def start_declaring(self, name: str) -> None:
        self.declaring = name
        self.reasons.add(WaitReason.DECLARING)

    def stop_declaring(self) -> None:
        self.declaring = None
        self.reasons.discard(WaitReason.DECLARING)

    def declared_apart(self, name: str, current: str) -> None:
        """The declaration of ``name`` was answered; the lane now names ``current``."""
        self.stop_declaring()
        self.declared = current == name

    def mark_declared(self) -> None:
        self.declared = True

    # ------------------------------------------------------------------- leases
    def start_leasing(self) -> bool:
        """Whether a lease must be asked now (none is on its way)."""
        if self.leasing:
            return False
        self.leasing = True
        return True

    def leased(self, incarnation: int, issued_at: float, lease_s: float) -> None:
        """A lease granted at ``issued_at`` for ``incarnation``; a break in the chain when the
        queue moved on to a new incarnation or the last lease had run out."""
        self.leasing = False
        if incarnation != self.incarnation:
            # Deleted and moved on since (quorum): declared anew under the next name.
            self.incarnation = incarnation
            self.declared = False
            self.registered = False
            self.lease_chain += 1
        elif issued_at >= self.lease_until:
            self.lease_chain += 1  # asked after the last lease ran out: a gap
        self.lease_until = issued_at + lease_s

    def refused_lease(self) -> None:
        """Being retired: its events wait, and it is declared again once the mark is gone."""
        self.leasing = False
        self.lease_until = 0.0
        self.lease_chain += 1
        self.reasons.add(WaitReason.UNLEASED)
        self.declared = False
        self.registered = False

    # ------------------------------------------------------------- send, settle
    def sent(self, message: Outgoing, name: str, now: float) -> None:
        """``message`` goes out now to the incarnation ``name``."""
        message.returned = False
        message.settled = False
        message.sent_at = now
        message.sent_to = name
        message.lease_chain = self.lease_chain
        self.inflight += 1

    def settled(self, message: Outgoing, published: bool) -> bool:
        """One of its messages settled; True when it is the queue's first publish (register
        the queue)."""
        self.inflight -= 1
        if not published:
            self.reasons.add(WaitReason.RECOVERING)
            self.returned.append(message)
            return False
        self.recoveries = 0
        self.recovery_delays = None
        first, self.registered = not self.registered, True
        return first

    def next_recovery_delay(self, rng: random.Random) -> float:
        """The wait before this recovery: none for the first in a row, then growing."""
        self.recoveries += 1
        if self.recoveries == 1:
            return 0.0
        if self.recovery_delays is None:
            self.recovery_delays = Backoff(RECOVERY_FIRST_S, RECOVERY_MAX_S, rng=rng)
        return self.recovery_delays.next()

    @property
    def quiet(self) -> bool:
        """Nothing of it is in flight or on its way: its lane can be forgotten."""
        return not (
            self.inflight
            or WaitReason.RECOVERING in self.reasons
            or self.returned
            or self.waiting
            or self.gathering
            or self.leasing
            or WaitReason.DECLARING in self.reasons
        )

    def take_released(self) -> deque[Outgoing]:
        """Its waiting events, to send now, unless some reason still holds them back."""
        if self.waits:
            return deque()
        waiting, self.waiting = self.waiting, deque()
        return waiting

    def take_back(self, pending: list[Outgoing]) -> None:
        """Events sent but never settled (their channel closed) wait again, in order."""
        self.inflight -= len(pending)
        waiting = [*pending, *self.take_gathered(), *self.waiting]
        self.waiting = deque(sorted(waiting, key=lambda message: message.number))

    def begin_recovery(self) -> tuple[list[Outgoing], deque[Outgoing]]:
        """Its returned events in submission order, then the waiting ones, to send again to a
        queue declared anew."""
        returned = sorted(self.returned, key=lambda message: message.number)
        waiting = deque(
            sorted([*self.take_gathered(), *self.waiting], key=lambda message: message.number)
        )
        self.returned = []
        self.waiting = deque()
        self.reasons.discard(WaitReason.RECOVERING)
        self.declared = False
        self.registered = False
        return returned, waiting

    def unsettled(self) -> list[Outgoing]:
        """What a lost connection leaves of it, to send again: returned, gathering, waiting."""
        return [*self.returned, *self.gathering, *self.waiting]


class Lanes(dict[str, QueueLane]):
    """The lanes of the current connection, by base queue name, and the queues whose node is
    down (kept across reconnects: a new lane of such a queue waits from the start)."""

    def __init__(self) -> None:
        super().__init__()
        self.unreachable: dict[str, str] = {}  # base name -> the incarnation that was down

    def of(self, message: Outgoing) -> QueueLane:
        lane = self.get(message.queue)
        if lane is None:
            lane = self[message.queue] = QueueLane(key=message.key)
            if message.queue in self.unreachable:
                lane.wait(WaitReason.UNREACHABLE)
        return lane

    def forget_quiet(self) -> None:
        """Bound memory with many keys: drop lanes with nothing in flight."""
        for queue in [queue for queue, lane in self.items() if lane.quiet]:
            del self[queue]


def waiting_counts(lanes: Iterable[QueueLane], reason: WaitReason) -> tuple[int, int]:
    """Events and queues waiting for ``reason`` (a deleted queue's returned events count)."""
    events = queues = 0
    for lane in lanes:
        if reason in lane.reasons:
            queues += 1
            events += events_in(lane.waiting)
            if reason is WaitReason.RECOVERING:
                events += events_in(lane.returned)
    return events, queues
