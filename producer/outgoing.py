"""An event on its way through the producer, as its I/O thread keeps it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pika

if TYPE_CHECKING:
    from keyq.producer.confirmation import Confirmation


@dataclass(slots=True, eq=False)
class Outgoing:
    """One event on its way: accepted by ``publish``, settled when the broker confirms it."""

    number: int  # producer-wide submission order, also the end of the message id
    queue: str
    key: str
    body: bytes
    properties: pika.BasicProperties
    tag: int = 0  # delivery tag on the current channel
    sent_at: float = 0.0  # monotonic time of the latest send
    sent_to: str = ""  # the queue's incarnation it was last sent to (``queue`` is the base)
    returned: bool = False
    settled: bool = False
    confirmation: Confirmation | None = None  # told once the event is published
