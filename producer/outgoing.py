"""An event on its way through the producer, as its I/O thread keeps it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pika

if TYPE_CHECKING:
    from keyq.producer.confirmation import Confirmation


@dataclass(slots=True, eq=False)
class Outgoing:
    """One message on its way: an event accepted by ``publish``, or a pack of several events
    of one queue (``events``); settled when the broker confirms it."""

    number: int  # producer-wide submission order (a pack's: its first event's)
    queue: str
    key: str
    body: bytes
    properties: pika.BasicProperties
    tag: int = 0  # delivery tag on the current channel
    accepted_at: float = 0.0  # monotonic time ``publish`` handed it to the window
    sent_at: float = 0.0  # monotonic time of the latest send
    sent_to: str = ""  # the queue's incarnation it was last sent to (``queue`` is the base)
    lease_chain: int = 0  # its lane's ``lease_chain`` when it was last sent
    returned: bool = False
    settled: bool = False
    confirmation: Confirmation | None = None  # told once the event is published
    events: list[Outgoing] | None = None  # a pack's events, in order (``keyq.producer.packing``)
    record: bytes | None = None  # an event's encoding inside a pack, made once

    @property
    def members(self) -> list[Outgoing]:
        """The events this message carries: its own, or a pack's."""
        return self.events if self.events is not None else [self]

    @property
    def count(self) -> int:
        """How many events this message carries (what the confirm window counts)."""
        return len(self.events) if self.events is not None else 1


def events_in(messages: Iterable[Outgoing]) -> int:
    """How many events ``messages`` carry (a pack counts each of its events)."""
    return sum(message.count for message in messages)
