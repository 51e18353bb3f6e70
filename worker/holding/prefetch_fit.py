"""A consumer's prefetch fitted to the size of its queue's messages.

``KEYQ_PREFETCH`` counts events, but the broker counts a consumer's prefetch in messages, and a
message may be a pack of up to ``KEYQ_PACK_MAX_EVENTS`` events. Consumers start with room for
``prefetch / pack_max_events`` messages, right for a producer that publishes flat out (full
packs). Paced producers send small messages, often one event each: such a queue's consumer
then holds a twentieth of the events it may, and a batch takes that many from the queue however
many wait, so a busy bucket falls behind. After each batch, a queue whose batch took at least
half its consumer's prefetch (a backed-up queue's batches take about half: the rest arrives
while a batch runs) is reopened with room for ``prefetch`` events at the size of that batch's
messages, at most once per ``GROW_COOL_DOWN_S``: a queue that backs up is behind by
every batch it waits, and a grow at least doubles the room, so a queue grows a few times at
most. One with far more room than its messages' running size asks for (its packs grew again)
is reopened smaller, at most once per ``COOL_DOWN_S``, so a worker's memory stays bounded by
events, not messages; a reopening hands the queue's unacked deliveries back to be sent again.

A queue whose batches pass most of their events on rather than apply them (a promoted key's
events forwarded by its bucket's holder, a held-back key's set aside) is fitted to ``WIDE``
times ``prefetch`` events: passing an event on costs no Spark job, so its batches are as long
as their applied events make them, and a bucket backed up by a key just promoted is through
its forwards in a quarter of the batches. Once its batches apply most of what they take again,
it is narrowed back.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.holding.held_queues import MAX_PREFETCH

log = logging.getLogger("keyq.worker")

COOL_DOWN_S = 5.0
GROW_COOL_DOWN_S = 1.0
WEIGHT = 0.3  # of the latest batch in the running size of a queue's messages
WIDE = 4


@dataclass
class _Seen:
    events_per_message: float  # running
    latest: float  # events per message in the latest batch
    # The latest batch took at least half the messages the consumer may hold: a consumer whose
    # queue is backed up holds its whole room, but its batch takes only what arrived since its
    # last ack, about half of it (the rest comes while the batch runs).
    busy: bool
    passing: bool  # the latest batch applied fewer than half the events it took from it


class PrefetchFit:
    """Which held queues to reopen with another prefetch, and with what."""

    def __init__(self, prefetch_events: int, base_messages: int) -> None:
        self._events = prefetch_events
        self._base = base_messages
        self._seen: dict[str, _Seen] = {}
        self._last_change: dict[str, float] = {}
        self.refits = 0

    def observe(
        self,
        batch: Sequence[Delivery],
        room_of: Callable[[str], int | None],
        applied: Mapping[str, int] | None = None,
    ) -> None:
        """Note each queue's message size in ``batch``, whether it took half its room, and,
        given how many events of each queue it ``applied`` (when it committed), whether it
        passed most of them on."""
        messages: dict[str, set[tuple[int, int]]] = {}
        events: dict[str, int] = {}
        for delivery in batch:
            messages.setdefault(delivery.queue, set()).add(delivery.message)
            events[delivery.queue] = events.get(delivery.queue, 0) + 1
        for queue, taken in messages.items():
            latest = size = events[queue] / len(taken)
            before = self._seen.get(queue)
            if before is not None:
                size = WEIGHT * size + (1 - WEIGHT) * before.events_per_message
            room = room_of(queue)
            busy = room is not None and 2 * len(taken) >= room
            passing = applied is not None and 2 * applied.get(queue, 0) < events[queue]
            self._seen[queue] = _Seen(size, latest, busy, passing)

    def want(self, queue: str) -> int | None:
        """The room for ``prefetch`` events at the running size of the queue's messages."""
        seen = self._seen.get(queue)
        return None if seen is None else self._fitted(seen.events_per_message)

    def _fitted(self, events_per_message: float, *, wide: bool = False) -> int:
        events = self._events * (WIDE if wide else 1)
        return min(MAX_PREFETCH, max(self._base, math.ceil(events / max(events_per_message, 1.0))))

    def due(
        self, room_of: Callable[[str], int | None], deferred: Callable[[str], int], now: float
    ) -> dict[str, int]:
        """Queue -> the prefetch to reopen it with, now."""
        changes: dict[str, int] = {}
        for queue in list(self._seen):
            room = room_of(queue)
            if room is None:  # no longer held
                del self._seen[queue]
                self._last_change.pop(queue, None)
                continue
            seen = self._seen[queue]
            since = now - self._last_change.get(queue, -COOL_DOWN_S)
            grow = self._fitted(seen.latest, wide=seen.passing)
            running = self._fitted(seen.events_per_message)
            if seen.busy and grow >= 2 * room and since >= GROW_COOL_DOWN_S:
                changes[queue] = grow
            # Narrowed only when both sizes say so, and not while a gap waits (its widening).
            elif room >= 2 * max(grow, running) and since >= COOL_DOWN_S and not deferred(queue):
                changes[queue] = max(grow, running)
            else:
                continue
            self._last_change[queue] = now
        return changes

    def refit(
        self,
        room_of: Callable[[str], int | None],
        deferred: Callable[[str], int],
        reopen: Callable[[str, int], bool],
    ) -> None:
        """Between batches: reopen the queues whose prefetch no longer fits."""
        for queue, prefetch in self.due(room_of, deferred, time.monotonic()).items():
            seen = self._seen[queue]
            log.info(
                "queue %s: its messages hold %.1f events (%.1f in the latest batch); reopening it "
                "with a prefetch of %d messages (was %s)",
                queue,
                seen.events_per_message,
                seen.latest,
                prefetch,
                room_of(queue),
            )
            if reopen(queue, prefetch):
                self.refits += 1
