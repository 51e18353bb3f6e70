"""What ``Producer.publish`` hands back: a receipt for an accepted event, and why
``Producer.offer`` took none."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from keyq.broker.errors import ProducerClosed
from keyq.producer.confirmation import Confirmation


@dataclass(frozen=True, slots=True)
class Receipt:
    """Where an accepted event is going and how it is identified downstream.

    ``queue`` is the queue the event was addressed to when accepted, by its base name: on a
    key-mode quorum stream, a queue the janitor deleted comes back as ``<queue>~1``,
    ``<queue>~2``… (``broker.naming``). On an auto stream, an event addressed to its key's
    own queue goes to the key's bucket instead when the switch to that queue is put off (the
    bucket's holder forwards it, in order) or the key was demoted meanwhile."""

    queue: str
    key: str
    seq: int
    message_id: str
    confirmation: Confirmation | None = field(default=None, repr=False, compare=False)

    def wait(self, timeout: float | None = None) -> None:
        """Block until this event is published (confirmed, not returned), without waiting
        for any other event. Raises ``PublishTimeout`` after ``timeout`` seconds, and
        ``ProducerClosed`` (from the cause) if the producer failed or was closed first: the
        error a ``flush`` would raise."""
        if self.confirmation is None:
            raise ProducerClosed("this receipt belongs to no producer")
        self.confirmation.wait(timeout)

    @property
    def published(self) -> bool:
        """Whether RabbitMQ has confirmed this event (and not returned it)."""
        return self.confirmation is not None and self.confirmation.published


class Offer(enum.Enum):
    """Why ``Producer.offer`` did not take an event."""

    NO_ROOM = "no room"  # the window is full, or publishers are blocked: wait for a change
    BUSY = "busy"  # the I/O thread holds the window this moment: look again shortly
