"""The producer's bookkeeping records, kept by its I/O thread."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pika


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


@dataclass(slots=True, eq=False)
class QueueState:
    """What the I/O thread knows about one keyed queue on the current connection.

    ``recovering`` is set when the broker returned an event because the queue was deleted:
    newer events for the queue wait in ``parked`` until everything sent before has settled,
    the queue is declared again and the returned events are re-sent in their original order,
    so a deletion never reorders a key. ``held`` parks events the same way until the queue
    has a fresh publish lease (see ``broker.retirement``), ``unreachable`` while the queue's
    node is down (on a cluster), so one such queue never stalls the others, and ``declaring``
    until a new key's queue exists (see ``keyq.producer.declarers``).
    """

    key: str | None
    declared: bool = False
    registered: bool = False
    inflight: int = 0
    recovering: bool = False
    lease_until: float = 0.0  # monotonic time until which events may be sent
    leasing: bool = False  # a lease request is on its way
    held: bool = False  # events wait in ``parked`` for a lease
    unreachable: bool = False  # its node is down (404): events wait in ``parked`` for it
    declaring: str | None = None  # the queue being declared apart: events wait for it
    incarnation: int = 0  # which incarnation of the queue leases name (see broker.naming)
    recoveries: int = 0  # recoveries in a row without an event published in between
    returned: list[Outgoing] = field(default_factory=list)
    parked: deque[Outgoing] = field(default_factory=deque)

    @property
    def waiting(self) -> bool:
        """Its events park instead of going out (any of the reasons above)."""
        return bool(self.recovering or self.held or self.unreachable or self.declaring)

    @property
    def quiet(self) -> bool:
        return not (
            self.inflight
            or self.recovering
            or self.returned
            or self.parked
            or self.leasing
            or self.declaring
        )


@dataclass(slots=True, eq=False)
class AsideChannel:
    """A channel of its own for one silent queue (see ``PublisherLink``): its events go there
    one at a time, with their own delivery tags, until one is confirmed."""

    channel: Any = None  # set once open
    ready: bool = False  # confirm mode is on
    next_tag: int = 1
    inflight: deque[Outgoing] = field(default_factory=deque)
