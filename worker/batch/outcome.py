"""What processing a batch came to, for the worker to act on, derived from the dispositions
its attempts gave (``keyq.worker.batch.admission``) and what they settled; what it settled also
decides what goes back to the buffer when it stops early."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from keyq.broker.locks import Lease
from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.batch.admission import LATER, Admission, Disposition


@dataclass(frozen=True)
class BatchOutcome:
    """The result of ``BatchProcessor.process``; ``HeldQueues`` acts on it."""

    # Not settled: to put back (the worker keeps those whose queue is still held).
    unsettled: list[Delivery] = field(default_factory=list)
    # Deferred behind an earlier seq of their key: kept for a later batch.
    deferred: list[Delivery] = field(default_factory=list)
    # Leases a refused commit found lost: their queues stop now.
    lost: list[Lease] = field(default_factory=list)
    # A service failed mid-batch (the reason): the worker backs off, then retries.
    interrupted: str | None = None
    # Aside queues whose key may not apply their deliveries now: handed back.
    handed_back: frozenset[str] = frozenset()
    # Beyond their key's rate limit, or their key moving: to put back, for a batch in
    # ``retry_later_in`` s.
    later: list[Delivery] = field(default_factory=list)
    retry_later_in: float = 0.0


@dataclass
class BatchProgress:
    """What one ``process`` call has done so far, across its attempts."""

    # (queue, epoch, tag, part): one event (a pack's events are settled one by one)
    settled: set[tuple[str, int, int, int]] = field(default_factory=set)
    leases: dict[str, Lease] = field(default_factory=dict)  # every lease an attempt used
    # The last disposition each delivery was given (a later attempt decides again).
    decided: dict[int, tuple[Delivery, Disposition]] = field(default_factory=dict)
    retry_later_in: float = 0.0

    def admitted(self, admission: Admission) -> None:
        for delivery, how in zip(admission.deliveries, admission.dispositions, strict=True):
            self.decided[id(delivery)] = (delivery, how)
        if admission.retry_later_in:
            self.retry_later_in = admission.retry_later_in

    def settle(self, deliveries: Iterable[Delivery]) -> None:
        self.settled.update(_identity(d) for d in deliveries)

    def outcome(self) -> BatchOutcome:
        """What a batch that ran to its end came to."""
        found: dict[Disposition, list[Delivery]] = {}
        for delivery, how in self.decided.values():
            found.setdefault(how, []).append(delivery)
        return BatchOutcome(
            deferred=found.get(Disposition.DEFER, []),
            handed_back=frozenset(d.queue for d in found.get(Disposition.HAND_BACK, [])),
            later=self.unsettled([d for how in LATER for d in found.get(how, [])]),
            retry_later_in=self.retry_later_in,
        )

    def unsettled(
        self, deliveries: Sequence[Delivery], exclude: frozenset[str] = frozenset()
    ) -> list[Delivery]:
        """``deliveries`` not settled yet, leaving out the queues in ``exclude``."""
        return [
            d for d in deliveries if d.queue not in exclude and _identity(d) not in self.settled
        ]

    def lost(self, queues: frozenset[str]) -> list[Lease]:
        """The leases used for ``queues``, which a refused commit found lost."""
        # An aside queue's deliveries are committed under the lease of their key's queue.
        return list(
            {
                lease
                for queue, lease in self.leases.items()
                if queue in queues or lease.queue in queues
            }
        )


def _identity(delivery: Delivery) -> tuple[str, int, int, int]:
    return delivery.queue, delivery.channel_epoch, delivery.delivery_tag, delivery.part
