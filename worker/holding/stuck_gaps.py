"""Reopening a consumer whose sequence gap stays open.

An event that waits for an earlier seq of its producer (``keyq.worker.batch.sequencing``) is
normally joined by the missing one within moments: the producer re-sends whatever was not
confirmed. When it is not, the missing event may be in the queue, but counted by the broker as
delivered to this very consumer without ever reaching it: RabbitMQ 3.10's quorum queues were
seen keeping messages checked out to a live consumer across leader changes (the cluster soak),
and no gap timeout brings those back, since the broker will not send them again on that
consumer. Closing the consumer does: its channel's unacked messages return to the queue, in
order. So a queue whose gap has stayed open for ``reopen_after_s``, with nothing arriving for
``QUIET_S``, is reopened: its channel closed and a new consumer opened at once, the waiting
events keeping their waiting time (``DeliveryBuffer.drop(keep_waits=True)``). A queue that
keeps receiving (a busy bucket is never quiet) is reopened once its gap has waited
``BUSY_FACTOR`` times as long, still well within the gap timeout: otherwise its withheld
message would only come back after the gap was given up, to be dead-lettered as late. Again
at most every ``reopen_after_s`` while the gap stays open, until it fills or is given up.
"""

from __future__ import annotations

import time

from keyq.worker.amqp.deliveries import DeliveryBuffer
from keyq.worker.holding.abandoned_gaps import QUIET_S

# How long a gap waits before its queue's consumer is reopened (at most: half the gap
# timeout when that is shorter). The queue must also have been quiet for ``QUIET_S``, the
# same quiet as before a gone producer's gap is given up.
REOPEN_AFTER_S = 10.0
# How much longer the gap of a queue that is never quiet waits before its reopening: a
# producer's re-send, arriving among the others, has had every chance by then.
BUSY_FACTOR = 1.5


class StuckGaps:
    """Which queues with a long-open gap to reopen now, and when each was last reopened."""

    def __init__(self, buffer: DeliveryBuffer, gap_timeout_s: float) -> None:
        self._buffer = buffer
        self.reopen_after_s = min(REOPEN_AFTER_S, gap_timeout_s / 2)
        self._reopened: dict[str, float] = {}
        self.reopens = 0

    def due(self, now: float | None = None) -> list[str]:
        """Queues whose oldest waiting event has waited ``reopen_after_s`` (quiet for
        ``QUIET_S``) or ``BUSY_FACTOR`` times that (still receiving), and not reopened within
        ``reopen_after_s``."""
        now = time.monotonic() if now is None else now
        deferred = self._buffer.deferred_items()
        for queue in [queue for queue in self._reopened if queue not in deferred]:
            del self._reopened[queue]  # its gap filled or was given up
        due = []
        for queue, items in deferred.items():
            waits = [item.deferred_since for item in items if item.deferred_since is not None]
            wait_s = self.reopen_after_s * (1.0 if self.quiet(queue, now) else BUSY_FACTOR)
            if not waits or now - min(waits) < wait_s:
                continue
            reopened = self._reopened.get(queue)
            if reopened is not None and now - reopened < self.reopen_after_s:
                continue
            due.append(queue)
        return due

    def quiet(self, queue: str, now: float | None = None) -> bool:
        """Whether nothing has arrived on ``queue`` for ``QUIET_S``."""
        last = self._buffer.last_arrival(queue)
        now = time.monotonic() if now is None else now
        return last is None or now - last >= QUIET_S

    def note_reopened(self, queue: str, now: float | None = None) -> None:
        self._reopened[queue] = time.monotonic() if now is None else now
        self.reopens += 1

    def reopened_at(self, queue: str) -> float | None:
        """When ``queue``'s consumer was last reopened for a gap, if it still has one."""
        return self._reopened.get(queue)
