"""Queues the broker holds back from this worker's connection: held, messages ready, nothing
delivered.

RabbitMQ hands a quorum queue's deliveries to a consumer through the queue's replica on the
consumer's node: the leader leaves the sending to that replica. When that replica is down
while its node runs (it did not come back after a restart, say), a consumer connected there
is sent nothing, ever: its messages count as delivered to it, unacked, and stay so until its
channel closes, while a consumer on another node would get them at once. A worker would hold
such a queue, see it idle, hand it back and claim it again, forever, on the same node.

The signature is a holding that ends idle with nothing delivered after which the queue has
messages ready (key mode: the hand-back gave them back), or a holding silent for the idle
time while messages wait ready (bucket mode, whose queues are held for good). Twice in a row
for one queue and the worker moves its connection to another node. Only quorum queues are
watched: a classic queue has one process, which sends its deliveries itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Starved holdings of one queue in a row that move the connection. One could be a peer's
# consumer still active on the queue for a moment (a paused zombie, until its connection
# times out); two, an idle period apart, are not.
STARVED_TIMES = 2


class StarvationWatch:
    """Counts, per queue, holdings in a row that were starved; pure bookkeeping."""

    def __init__(self, times: int = STARVED_TIMES) -> None:
        self._times = times
        self._counts: dict[str, int] = {}

    def delivered(self, queue: str) -> None:
        """A holding of ``queue`` received something: the broker delivers it here."""
        self._counts.pop(queue, None)

    def starved(self, queue: str) -> bool:
        """A holding of ``queue`` was starved; True once it has been ``times`` in a row
        (the count then starts over)."""
        count = self._counts.get(queue, 0) + 1
        if count >= self._times:
            self._counts.pop(queue, None)
            return True
        self._counts[queue] = count
        return False

    def forget(self) -> None:
        """The connection moved: what was seen through the old one no longer counts."""
        self._counts.clear()


# How long the broker is given to take back a closed consumer's messages (its channel's end
# reaches the quorum queue's leader as a command of its log) before the queue is looked into,
# and how many times it is looked into.
SETTLE_S = 0.1
LOOKS = 3
# Queues looked into per hand-back: a silent holding is rare, a hand-back of hundreds is not.
MOST_LOOKED_INTO = 20


def ready_after_close(
    ready_of: Callable[[str], int], queues: Sequence[str], pause: Callable[[float], None]
) -> dict[str, int]:
    """The messages ready in each of ``queues`` (consumers just closed) once the broker has
    taken back what it counted as delivered to them: looked into ``LOOKS`` times, ``SETTLE_S``
    apart, until it shows some; 0 for a queue that never did."""
    found: dict[str, int] = {}
    todo = list(queues[:MOST_LOOKED_INTO])
    for _look in range(LOOKS):
        if not todo:
            break
        pause(SETTLE_S)
        for queue in todo:
            found[queue] = ready_of(queue)
        todo = [queue for queue in todo if not found[queue]]
    return found
