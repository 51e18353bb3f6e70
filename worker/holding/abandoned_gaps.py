"""Giving up a sequence gap at once when its producer is gone and its queue is drained.

While a producer runs, a gap in its seqs fills: it re-sends every event the broker refused
until it is confirmed. Once it is gone (``keyq.broker.producer_presence``: killed between
taking a seq and its confirm, or closed with events unconfirmed), a missing event is either
in the queue already or never coming, so waiting out ``sequence_gap_timeout_ms`` would only
hold back the events behind the gap. "Nothing more in the queue" is judged three ways, since
each alone can mislead: the broker counts no ready message (a quorum queue's count can lag
right after a leader change), nothing has arrived on the queue for ``QUIET_S``, and its
consumer has room for more (so the broker had nothing more to send). The producer must also
have been seen gone for ``confirm_gone_s`` (half its ttl by default): a Redis that restarted
without its data forgets a running producer until its next renewal. A message the broker
counts as delivered to this consumer but never sent is not ready either, so the queue's
consumer must also have been reopened since the gap opened (``keyq.worker.holding.stuck_gaps``): the
first time everything else holds, it is reopened instead, and the gap is given up only once
the queue is quiet again after that. The gap is then given up through the usual path:
reported, remembered in the marks, a late arrival dead-lettered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from keyq.worker.amqp.deliveries import Delivery, DeliveryBuffer
from keyq.worker.batch.decoding import producer_of

log = logging.getLogger("keyq.worker")

# How long a queue must have been quiet, and a delivery deferred, before its gap can be given
# up early, or its consumer reopened (``keyq.worker.holding.stuck_gaps``): longer than a
# broker takes to hand a consumer with room what its queue holds, or to redeliver.
QUIET_S = 2.0
CHECK_EVERY_S = 1.0


class AbandonedGaps:
    """Finds deferred deliveries whose producer is gone and whose queue holds nothing more."""

    def __init__(
        self,
        buffer: DeliveryBuffer,
        alive: Callable[[Iterable[str]], set[str]],
        ready_count: Callable[[str], int],
        room_of: Callable[[str], int | None],
        confirm_gone_s: float,
        *,
        reopened_at: Callable[[str], float | None],
        reopen: Callable[[str], None],
    ) -> None:
        """``alive(ids)``: those producers still running (``ProducerPresence.alive``);
        ``ready_count(queue)`` asks the broker for the queue's ready messages;
        ``room_of(queue)`` is the AMQP prefetch (messages) of the queue's consumer, None if
        not held;
        ``confirm_gone_s``: how long a producer must be seen gone before it counts;
        ``reopened_at(queue)``: when its consumer was last reopened for a gap, if ever;
        ``reopen(queue)``: reopen its consumer now."""
        self._buffer = buffer
        self._alive = alive
        self._ready_count = ready_count
        self._room_of = room_of
        self._confirm_gone_s = confirm_gone_s
        self._reopened_at = reopened_at
        self._reopen = reopen
        self._gone_since: dict[str, float] = {}  # producer -> first seen gone
        self._next_check = 0.0

    def check(self, now: float | None = None) -> int:
        """At most every ``CHECK_EVERY_S``: make due the deferred deliveries of gone
        producers on drained queues; how many."""
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return 0
        self._next_check = now + CHECK_EVERY_S
        snapshot = self._buffer.deferred_items()
        candidates = self._candidates(snapshot, now)
        if not candidates:
            return 0
        asked = set().union(*candidates.values())
        alive = self._alive(asked)
        self._gone_since = {
            producer: self._gone_since.get(producer, now) for producer in asked - alive
        }
        expired = 0
        for queue, producers in sorted(candidates.items()):
            gone = {
                producer
                for producer in producers
                if producer in self._gone_since
                and now - self._gone_since[producer] >= self._confirm_gone_s
            }
            if not gone:
                continue
            room = self._room_of(queue)
            if room is None or self._buffer.messages(queue) >= room:
                continue  # the broker may hold more that it could not send us
            if self._ready_count(queue) != 0:
                continue
            theirs = _from_any_of(gone)
            reopened = self._reopened_at(queue)
            waits = [
                delivery.deferred_since
                for delivery in snapshot[queue]
                if delivery.deferred_since is not None and theirs(delivery)
            ]
            if waits and (reopened is None or reopened < min(waits)):
                self._reopen(queue)  # anything it holds unsent comes back; checked again after
                continue
            count = self._buffer.expire_deferred(queue, theirs, now)
            if count:
                log.info(
                    "queue %s: producer %s is gone and the queue holds nothing more: giving up "
                    "the sequence gap behind %d waiting events now",
                    queue,
                    ", ".join(sorted(gone)),
                    count,
                )
                expired += count
        return expired

    def _candidates(self, snapshot: dict[str, list[Delivery]], now: float) -> dict[str, set[str]]:
        """Per quiet queue, the producers of its deliveries deferred for ``QUIET_S``."""
        candidates: dict[str, set[str]] = {}
        for queue, deferred in snapshot.items():
            last = self._buffer.last_arrival(queue)
            if last is not None and now - last < QUIET_S:
                continue
            producers = {
                producer
                for delivery in deferred
                if delivery.deferred_since is not None
                and now - delivery.deferred_since >= QUIET_S
                and (producer := producer_of(delivery)) is not None
            }
            if producers:
                candidates[queue] = producers
        return candidates


def _from_any_of(producers: set[str]) -> Callable[[Delivery], bool]:
    return lambda delivery: producer_of(delivery) in producers
