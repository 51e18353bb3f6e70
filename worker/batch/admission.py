"""Admission: each delivery of an attempt gets exactly one disposition, from what was read
for the attempt (its key's status and marks, the dedupe ids applied, the stream's policy)
and nothing else. Pure, so it is tested without a broker.

The stages run in order, each deciding what the ones before let through: what holds the
key back (``keyq.worker.batch.key_gate``), the key's rate, the key's order by sequence number
(``keyq.worker.batch.plan``), then the dedupe ids. What the effects do, and what the batch
comes to, follow from the dispositions alone; a new feature is a new disposition."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from keyq.broker.key_control import KeyStatus, ParkedKey
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.stream_policy import StreamPolicy
from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.batch.decoding import Decoder, Event, Undecodable
from keyq.worker.batch.dedupe_ids import AppliedIds, Deduped, take_out_repeats
from keyq.worker.batch.key_gate import GateSorting, Routing, sort_by_key_status
from keyq.worker.batch.marks import KeyMarks
from keyq.worker.batch.plan import RunPlan, plan_run
from keyq.worker.batch.rate_limits import KeyRateLimiter, within_rates


class Disposition(enum.Enum):
    """What becomes of one delivery in this attempt."""

    APPLY = "apply"  # applied by the commit, then acked
    DUPLICATE = "duplicate"  # applied before (marks or dedupe id): acked, nothing else
    DEAD_LETTER = "dead-letter"  # copied to the dead-letter queue, then acked
    SET_ASIDE = "set aside"  # its key is stopped: copied to the key's aside queue, then acked
    HAND_BACK = "hand back"  # an aside queue's, its key may not apply it now: the queue goes back
    RATE_LIMITED = "rate-limited"  # beyond its key's rate: back to the buffer, unacked
    DEFER = "defer"  # behind an open sequence gap: kept, unacked, for a later batch
    FORWARD = "forward"  # its key has a queue of its own: copied there, confirmed, then acked
    MOVING = "moving"  # its key's move is not closed: back to the buffer, unacked


# Acked once the attempt's commit stands.
SETTLED = frozenset(
    {
        Disposition.APPLY,
        Disposition.DUPLICATE,
        Disposition.DEAD_LETTER,
        Disposition.SET_ASIDE,
        Disposition.FORWARD,
    }
)
# Back to the buffer, unacked, for a later batch.
LATER = frozenset({Disposition.RATE_LIMITED, Disposition.MOVING})
MOVING_RETRY_S = 0.05


@dataclass(frozen=True)
class Reads:
    """What admission needs, read once for the attempt's keys."""

    policy: StreamPolicy
    statuses: dict[str, KeyStatus]
    marks: Mapping[str, KeyMarks]
    dedupe: AppliedIds
    now_ms: int  # wall clock, for when a key was parked
    now_s: float  # monotonic, for the sequence gaps' timeout


@dataclass(frozen=True)
class Admission:
    """An attempt's deliveries, each with its disposition, and what the effects need."""

    deliveries: list[Delivery]
    dispositions: list[Disposition]  # one per delivery, in the same order
    run: RunPlan  # the events to apply, the letters, the marks after, the gaps
    deduped: Deduped  # the dedupe ids to remember with the commit
    aside: dict[str, list[Delivery]] = field(default_factory=dict)  # key -> to set aside
    parking: dict[str, ParkedKey] = field(default_factory=dict)  # keys to park, at what
    forward: dict[str, list[Delivery]] = field(default_factory=dict)  # key -> to its own queue
    retry_later_in: float = 0.0  # when the rate-limited or moving may go, in seconds

    def of(self, *wanted: Disposition) -> list[Delivery]:
        """The deliveries with one of the ``wanted`` dispositions, in delivery order."""
        return [
            d for d, how in zip(self.deliveries, self.dispositions, strict=True) if how in wanted
        ]

    @property
    def settling(self) -> list[Delivery]:
        return self.of(*SETTLED)

    @property
    def events(self) -> list[Event]:
        """The events to apply, in the order to apply them."""
        return self.deduped.events


def admit(
    deliveries: Sequence[Delivery],
    decoded: Decoder,
    reads: Reads,
    *,
    keys: StreamKeys,
    is_aside_queue: Callable[[str], bool],
    limiter: KeyRateLimiter | None,
    gap_timeout_s: float,
    dead: str | None = None,
    routing: Routing | None = None,
) -> Admission:
    """Give each of ``deliveries`` (in delivery order) its disposition; with ``dead``, every
    event that would apply is dead-lettered with that reason instead."""
    park = reads.policy.poison_policy == "park"
    gate = sort_by_key_status(
        deliveries,
        decoded,
        reads.statuses,
        is_aside_queue=is_aside_queue,
        park_at_poison=park,
        now_ms=reads.now_ms,
        routing=routing,
    )
    through, limited, retry_in = gate.through, list[Delivery](), 0.0
    if limiter is not None:
        through, limited = within_rates(gate.through, gate.through_keys, limiter)
        limited_keys = {key for d in limited if (key := decoded(d).key) is not None}
        retry_in = min((limiter.due_in(key) for key in limited_keys), default=0.05)
    run = plan_run(
        through,
        decoded,
        reads.marks,
        now=reads.now_s,
        gap_timeout_s=gap_timeout_s,
        dead=dead,
    )
    deduped = take_out_repeats(run.events, reads.dedupe, keys)
    how = _dispositions(gate, limited, run, deduped)
    waits = ([retry_in] if limited else []) + ([MOVING_RETRY_S] if gate.moving else [])
    parking = dict(gate.parking)
    if park and dead is not None:
        parking.update(_parked_at_letters(run.letters, dead, reads.now_ms, parking))
    return Admission(
        deliveries=list(deliveries),
        # What is left applied before: a redelivery, a re-send, a repeated dedupe id.
        dispositions=[how.get(id(d), Disposition.DUPLICATE) for d in deliveries],
        run=run,
        deduped=deduped,
        aside=gate.aside,
        parking=parking,
        forward=gate.forward,
        retry_later_in=min(waits, default=0.0),
    )


def _dispositions(
    gate: GateSorting, limited: list[Delivery], run: RunPlan, deduped: Deduped
) -> dict[int, Disposition]:
    """Each sorted delivery's disposition, by its identity; the rest are duplicates."""
    how: dict[int, Disposition] = {}
    for disposition, found in (
        (Disposition.SET_ASIDE, gate.set_aside),
        (Disposition.HAND_BACK, gate.hand_back),
        (Disposition.RATE_LIMITED, limited),
        (Disposition.FORWARD, [d for copies in gate.forward.values() for d in copies]),
        (Disposition.MOVING, gate.moving),
        (Disposition.DUPLICATE, gate.stale),
        (Disposition.DEFER, run.deferred),
        (Disposition.DEAD_LETTER, [letter.delivery for letter in run.letters]),
        (Disposition.APPLY, [event.delivery for event in deduped.events]),
    ):
        how.update((id(delivery), disposition) for delivery in found)
    return how


def _parked_at_letters(
    letters: Sequence[Undecodable], reason: str, now_ms: int, parked: Mapping[str, ParkedKey]
) -> dict[str, ParkedKey]:
    """Under ``park``, a key whose event is dead-lettered after its pipeline kept failing
    stops at it, as at an undecodable one."""
    found: dict[str, ParkedKey] = {}
    for letter in letters:
        if letter.key is not None and letter.key not in parked and letter.key not in found:
            found[letter.key] = ParkedKey(
                at_ms=now_ms, reason=reason, producer=letter.producer, seq=letter.seq
            )
    return found
