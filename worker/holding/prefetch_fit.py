"""A consumer's prefetch fitted to the size of its queue's messages.

``KEYQ_PREFETCH`` counts events, but the broker counts a consumer's prefetch in messages, and a
message may be a pack of up to ``KEYQ_PACK_MAX_EVENTS`` events. Consumers start with room for
``prefetch / pack_max_events`` messages, right for a producer that publishes flat out (full
packs). Paced producers send small messages, often one event each: such a queue's consumer
then holds a twentieth of the events it may, and a batch takes that many from the queue however
many wait, so a busy bucket falls behind. After each batch, a queue whose consumer was full
(the batch's messages and those that arrived while it ran fill its room) is reopened with
room for ``prefetch`` events at the size its messages had; one with far more room than that
(its packs grew again) is reopened smaller, so a worker's memory stays bounded by events, not
messages. A reopening hands the queue's unacked deliveries back to be sent again, so a queue
grows at most once per ``GROW_COOL_DOWN_S`` and shrinks at most once per ``COOL_DOWN_S``: a
bucket a hot key has just left (its packs forwarded, its bucket-mates' single events left)
grows twice within seconds, while one whose sizes swing is not reopened back and forth.

A queue backed up beyond its room drains at most its room a batch, however idle the worker: a
hot key behind a burst would take ``backlog / prefetch`` batch cycles while its batches ran
nearly empty. So a queue whose consumer was full after a batch that had room to spare is
widened to hold up to a whole batch (``KEYQ_BATCH_MAX_EVENTS``), and narrowed back to
``prefetch`` once it is no longer full. What widened queues may hold beyond ``prefetch`` is
one budget for the whole worker (``KEYQ_PREFETCH_WIDEN_EVENTS``, counted at the size each
queue's messages had), so its memory stays bounded however many queues back up at once. An
auto-mode bucket is not widened: a key that backs its bucket up is promoted to a queue of its
own by the events it gives one batch (``KEYQ_AUTO_PROMOTE_BACKLOG``, at most a prefetch), and
a wider bucket would promote cheap keys that are merely behind after a failover, whose
forwarding costs about what applying them does.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.holding.held_queues import MAX_PREFETCH

log = logging.getLogger("keyq.worker")

COOL_DOWN_S = 5.0
GROW_COOL_DOWN_S = 1.0
WEIGHT = 0.3  # of the latest batch in the running size of a queue's messages


@dataclass
class _Seen:
    events_per_message: float  # a running average
    latest: float  # in the latest batch
    full: bool  # after the latest batch, its messages and those buffered filled the room

    @property
    def size(self) -> float:
        """The message size a queue is fitted to: the smaller of the latest batch's and the
        running one. The latest is what a queue whose packs have just gone (a hot key promoted
        out of its bucket) delivers now, while one odd batch of big messages does not make a
        busy queue narrow."""
        return min(self.latest, self.events_per_message)


class PrefetchFit:
    """Which held queues to reopen with another prefetch, and with what."""

    def __init__(
        self,
        prefetch_events: int,
        base_messages: int,
        batch_events: int,
        widen_events: int = 0,
        widens: Callable[[str], bool] | None = None,
    ) -> None:
        self._events = prefetch_events
        self._base = base_messages
        self._batch = batch_events
        self._budget = widen_events  # what widened queues may hold beyond prefetch, in all
        self._widens = widens  # which queues may be widened; None: all of them
        # queue -> the events it may hold, beyond prefetch, until it is narrowed or let go
        self._wide: dict[str, int] = {}
        self._seen: dict[str, _Seen] = {}
        self._last_change: dict[str, float] = {}
        self.refits = 0

    def observe(
        self,
        batch: Sequence[Delivery],
        room_of: Callable[[str], int | None],
        buffered: Callable[[str], int],
        put_back: Collection[Delivery] = (),
    ) -> None:
        """Note each queue's message size in ``batch``, and whether its consumer was full:
        the batch's messages and those ``buffered`` since (ready ones: what the batch deferred
        is among its messages) fill its room. A batch of a backed-up queue takes only what had
        arrived when it began, often half the room (the rest comes while it runs), so the batch
        alone seldom shows a consumer held to its room. Deliveries the batch ``put_back`` in the
        buffer (over their key's rate, or unsettled) count once, as buffered, and their queues
        are not widened: room was not what held them."""
        back = {id(delivery) for delivery in put_back}
        held_back = {delivery.queue for delivery in put_back}
        room_to_spare = len(batch) < self._batch
        messages: dict[str, set[tuple[int, int]]] = {}
        events: dict[str, int] = {}
        for delivery in batch:
            if id(delivery) in back:
                continue
            messages.setdefault(delivery.queue, set()).add(delivery.message)
            events[delivery.queue] = events.get(delivery.queue, 0) + 1
        for queue, taken in messages.items():
            latest = size = events[queue] / len(taken)
            before = self._seen.get(queue)
            if before is not None:
                size = WEIGHT * latest + (1 - WEIGHT) * before.events_per_message
            room = room_of(queue)
            full = room is not None and len(taken) + buffered(queue) >= room
            self._seen[queue] = _Seen(size, latest, full)
            if not full and queue in self._wide and not self._reopened_wider(queue, room, size):
                del self._wide[queue]  # caught up before its consumer was reopened wider
            elif full and room_to_spare and queue not in held_back and self._may_widen(queue):
                self._widen(queue)

    def _may_widen(self, queue: str) -> bool:
        return queue not in self._wide and (self._widens is None or self._widens(queue))

    def _widen(self, queue: str) -> None:
        """Room for up to a batch of events, as far as the worker's widening budget goes."""
        spare = self._budget - sum(events - self._events for events in self._wide.values())
        events = min(self._batch, self._events + spare)
        if events >= 2 * self._events:  # less would not be worth reopening its consumer
            self._wide[queue] = events

    def _reopened_wider(self, queue: str, room: int | None, size: float) -> bool:
        """Whether ``queue``'s consumer has (about) the room it was widened to; read from the
        room itself, so a reopening that failed leaves nothing to undo."""
        return room is not None and 2 * room > _messages_for(self._wide[queue], size)

    def want(self, queue: str) -> int | None:
        """The room for ``prefetch`` events (more if widened and still full) at the size
        ``queue``'s messages have."""
        seen = self._seen.get(queue)
        if seen is None:
            return None
        events = self._wide.get(queue, self._events) if seen.full else self._events
        return min(MAX_PREFETCH, max(self._base, _messages_for(events, seen.size)))

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
                self._wide.pop(queue, None)
                continue
            want = self.want(queue)
            if want is None:
                continue
            since = now - self._last_change.get(queue, -COOL_DOWN_S)
            grow = self._seen[queue].full and want >= 2 * room and since >= GROW_COOL_DOWN_S
            # a gap's widening stays
            shrink = room >= 2 * want and not deferred(queue) and since >= COOL_DOWN_S
            if grow or shrink:
                changes[queue] = want
                self._last_change[queue] = now
            if shrink and not self._seen[queue].full:
                self._wide.pop(queue, None)  # its share of the budget is free again
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
                self._seen[queue].size,
                prefetch,
                room_of(queue),
            )
            if reopen(queue, prefetch):
                self.refits += 1


def _messages_for(events: int, size: float) -> int:
    """The messages that hold ``events`` events at ``size`` events a message."""
    return math.ceil(events / max(size, 1.0))
