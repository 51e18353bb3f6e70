"""A consumer's prefetch fitted to the size of its queue's messages.

``KEYQ_PREFETCH`` counts events, but the broker counts a consumer's prefetch in messages, and a
message may be a pack of up to ``KEYQ_PACK_MAX_EVENTS`` events. Consumers start with room for
``prefetch / pack_max_events`` messages, right for a producer that publishes flat out (full
packs). Paced producers send small messages, often one event each: such a queue's consumer
then holds a twentieth of the events it may, and a batch takes that many from the queue however
many wait, so a busy bucket falls behind. After each batch, a queue whose batch took its
consumer's whole prefetch is reopened with room for ``prefetch`` events at the size its
messages had; one with far more room than that (its packs grew again) is reopened smaller, so
a worker's memory stays bounded by events, not messages. At most once per ``COOL_DOWN_S`` per
queue, since a reopening hands the queue's unacked deliveries back to be sent again.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.holding.held_queues import MAX_PREFETCH

log = logging.getLogger("keyq.worker")

COOL_DOWN_S = 5.0
WEIGHT = 0.3  # of the latest batch in the running size of a queue's messages


@dataclass
class _Seen:
    events_per_message: float
    took_all: bool  # the latest batch took as many messages as the consumer may hold


class PrefetchFit:
    """Which held queues to reopen with another prefetch, and with what."""

    def __init__(self, prefetch_events: int, base_messages: int) -> None:
        self._events = prefetch_events
        self._base = base_messages
        self._seen: dict[str, _Seen] = {}
        self._last_change: dict[str, float] = {}
        self.refits = 0

    def observe(self, batch: Sequence[Delivery], room_of: Callable[[str], int | None]) -> None:
        """Note each queue's message size in ``batch``, and whether it took the whole room."""
        messages: dict[str, set[tuple[int, int]]] = {}
        events: dict[str, int] = {}
        for delivery in batch:
            messages.setdefault(delivery.queue, set()).add(delivery.message)
            events[delivery.queue] = events.get(delivery.queue, 0) + 1
        for queue, taken in messages.items():
            size = events[queue] / len(taken)
            before = self._seen.get(queue)
            if before is not None:
                size = WEIGHT * size + (1 - WEIGHT) * before.events_per_message
            room = room_of(queue)
            self._seen[queue] = _Seen(size, room is not None and len(taken) >= room)

    def want(self, queue: str) -> int | None:
        seen = self._seen.get(queue)
        if seen is None:
            return None
        fitted = math.ceil(self._events / max(seen.events_per_message, 1.0))
        return min(MAX_PREFETCH, max(self._base, fitted))

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
            want = self.want(queue)
            if want is None or now - self._last_change.get(queue, -COOL_DOWN_S) < COOL_DOWN_S:
                continue
            grow = self._seen[queue].took_all and want >= 2 * room
            shrink = room >= 2 * want and not deferred(queue)  # a gap's widening stays
            if grow or shrink:
                changes[queue] = want
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
            log.info(
                "queue %s: its messages hold %.1f events; reopening it with a prefetch of %d "
                "messages (was %s)",
                queue,
                self._seen[queue].events_per_message,
                prefetch,
                room_of(queue),
            )
            if reopen(queue, prefetch):
                self.refits += 1
