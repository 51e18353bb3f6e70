"""What processing a batch came to, for the worker to act on; and what it has settled so
far, which decides what goes back to the buffer when it stops early."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from keyq.broker.locks import Lease
from keyq.worker.deliveries import Delivery


@dataclass(frozen=True)
class BatchOutcome:
    """The result of ``BatchProcessor.process``; the worker parks, stops and puts back."""

    # Not settled: to put back (the worker keeps those whose queue is still held).
    unsettled: list[Delivery]
    # Wait for an earlier seq of their key: to park.
    waiting: list[Delivery]
    # Leases a refused commit found lost: their queues stop now.
    lost: list[Lease]
    # A service failed mid-batch (the reason): the worker backs off, then retries.
    interrupted: str | None = None
    # Side queues whose key may not apply their deliveries now: their consumers close.
    held_back: frozenset[str] = frozenset()
    # Beyond their key's rate limit: to put back, for a batch in ``retry_limited_in`` s.
    limited: list[Delivery] = field(default_factory=list)
    retry_limited_in: float = 0.0


@dataclass
class BatchProgress:
    """What one ``process`` call has done so far, across its attempts."""

    # (queue, epoch, tag, part): one event (a pack's events are settled one by one)
    settled: set[tuple[str, int, int, int]] = field(default_factory=set)
    leases: dict[str, Lease] = field(default_factory=dict)  # every lease an attempt used
    waiting: list[Delivery] = field(default_factory=list)  # set aside: to park
    # A side queue's deliveries whose key may not apply them now: their consumer is closed.
    held: list[Delivery] = field(default_factory=list)
    limited: list[Delivery] = field(default_factory=list)  # beyond their key's rate limit
    retry_limited_in: float = 0.0

    def settle(self, deliveries: Iterable[Delivery]) -> None:
        self.settled.update(_identity(d) for d in deliveries)

    def unsettled(
        self, deliveries: Sequence[Delivery], exclude: frozenset[str] = frozenset()
    ) -> list[Delivery]:
        """``deliveries`` not settled yet, leaving out the queues in ``exclude``."""
        return [
            d for d in deliveries if d.queue not in exclude and _identity(d) not in self.settled
        ]

    def lost(self, queues: frozenset[str]) -> list[Lease]:
        """The leases used for ``queues``, which a refused commit found lost."""
        # A side queue's deliveries are committed under the lease of their key's queue.
        return list(
            {
                lease
                for queue, lease in self.leases.items()
                if queue in queues or lease.queue in queues
            }
        )


def _identity(delivery: Delivery) -> tuple[str, int, int, int]:
    return delivery.queue, delivery.channel_epoch, delivery.delivery_tag, delivery.part
