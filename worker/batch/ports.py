"""What a batch needs of the rest of the worker, as small interfaces: each is implemented by
the part of the worker that owns it, and the batch path depends on nothing else."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

import pika

from keyq.broker.locks import Lease
from keyq.worker.amqp.dead_letters import DeadLetter
from keyq.worker.amqp.deliveries import Delivery

# (queue, consumer epoch, events), each event a (delivery tag, part of its pack)
Acks = Sequence[tuple[str, int, Sequence[tuple[int, int]]]]


class Acker(Protocol):
    """Settles deliveries with the broker once their batch is committed."""

    def ack(self, acks: Acks) -> int:
        """Ack the messages settled whole; how many consumers were still there to ack."""


class DeadLetterSink(Protocol):
    """The stream's dead-letter queue, the aside queues a stopped key's events wait in, and a
    promoted key's own queue: each takes confirmed copies before the originals are acked."""

    def dead_letter(
        self, letters: Sequence[DeadLetter]
    ) -> list[tuple[bytes, pika.BasicProperties]]:
        """Publish ``letters`` confirmed; the copies as published (body, properties)."""

    def set_aside(self, queue: str, key: str, deliveries: Sequence[Delivery]) -> None:
        """Copy ``key``'s ``deliveries`` to its aside ``queue``, confirmed."""

    def declare(self, queues: Sequence[str]) -> None:
        """Declare promoted keys' own ``queues``."""

    def forward(self, copies: Sequence[tuple[str, str, Sequence[Delivery]]]) -> None:
        """Copy each ``(queue, key, deliveries)`` of promoted keys to their own queues,
        confirmed."""


class KeyDirectory(Protocol):
    """The key each queue was declared for (None: a bucket, or a queue nobody registered)."""

    def keys_of(self, queues: Collection[str]) -> Mapping[str, str | None]: ...


class LeaseLookup(Protocol):
    """The worker's held queues, as a batch sees them."""

    def lease_for(self, queue: str, epoch: int) -> Lease | None:
        """The lease a delivery of consumer ``epoch`` may be committed under, if any."""


class QueueDepths(Protocol):
    """Ready messages per queue, for the aside drains and the gap checks."""

    def message_counts(self, queues: Sequence[str]) -> dict[str, int]: ...
