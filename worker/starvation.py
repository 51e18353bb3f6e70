"""Queues the broker holds back from this worker's connection: held, messages ready, nothing
delivered.

RabbitMQ hands a quorum queue's deliveries to a consumer through the queue's replica on the
consumer's node, when that node has one: the leader leaves the sending to it. When that
replica is down while its node runs (it did not come back after a restart, say), a consumer
connected there is sent nothing, ever: its messages count as delivered to it, unacked, and
stay so until its channel closes, while a consumer on another node would get them at once. A
worker would hold such a queue, see it idle, hand it back and claim it again, forever, on the
same node.

The signature, in key mode, is a holding handed back idle with nothing delivered, after which
the queue has messages ready (closing gave them back); in bucket mode, whose queues are held
for good, a queue quiet for the idle time whose consumer has nothing unacked while messages
wait ready. Twice for one queue through one connection, within ``WINDOW_S``, and the worker
moves its connection to another node. Only quorum queues are watched: a classic queue has
one process, which sends its deliveries itself.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence

# Starved holdings of one queue that move the connection. One can be a race: a delivery
# that arrived while the hand-back closed the channel, a peer's consumer still active on the
# queue for a moment (single active consumer: a paused zombie until its connection times
# out). Two, an idle period apart, through the same connection, are not.
STARVED_TIMES = 2
# Strikes older than this are forgotten: two rare races months apart are not a pattern.
WINDOW_S = 120.0


class StarvationWatch:
    """Counts, per queue, starved holdings seen through one connection; bookkeeping only,
    safe from any thread."""

    def __init__(self, times: int = STARVED_TIMES, window_s: float = WINDOW_S) -> None:
        self._times = times
        self._window_s = window_s
        self._lock = threading.Lock()
        self._strikes: dict[str, list[float]] = {}
        self._connection = 0

    def delivered(self, queue: str) -> None:
        """A holding of ``queue`` received something: the broker delivers it here."""
        with self._lock:
            self._strikes.pop(queue, None)

    def starved(self, queue: str, now: float, connection: int) -> bool:
        """A holding of ``queue`` was starved at ``now`` (monotonic s), through connection
        number ``connection`` (strikes through an earlier one are forgotten). True once it
        has been ``times`` within the window; its strikes then start over."""
        with self._lock:
            if connection != self._connection:
                self._connection = connection
                self._strikes.clear()
            strikes = [t for t in self._strikes.get(queue, []) if now - t < self._window_s]
            strikes.append(now)
            if len(strikes) >= self._times:
                self._strikes.pop(queue, None)
                return True
            self._strikes[queue] = strikes
            return False

    def forget(self) -> None:
        """The connection moved: what was seen through the old one no longer counts."""
        with self._lock:
            self._strikes.clear()


# How long the broker is given to take back a closed consumer's messages (its channel's end
# reaches the quorum queue's leader as a command of its log) before the queues are looked
# into, once per hand-back: a starved queue missed now is seen at its next hand-back.
SETTLE_S = 0.1
# Queues looked into per hand-back, picked at random: a silent holding is rare, a hand-back
# of hundreds is not.
MOST_LOOKED_INTO = 20


def ready_after_close(
    ready_of: Callable[[Sequence[str]], dict[str, int]],
    queues: Sequence[str],
    pause: Callable[[float], None],
) -> dict[str, int]:
    """The messages ready in (at most ``MOST_LOOKED_INTO`` of) ``queues``, consumers just
    closed, once the broker had ``SETTLE_S`` to take back what it counted as delivered to
    them; ``ready_of`` looks into several queues in one call."""
    picked = list(queues)
    if len(picked) > MOST_LOOKED_INTO:
        picked = random.sample(picked, MOST_LOOKED_INTO)
    pause(SETTLE_S)
    return ready_of(picked)
