"""Which delivery tags of one consumer may be acked with ``multiple``, and which one by one.

A channel numbers its deliveries 1, 2, 3…, and ``basic.ack(n, multiple=True)`` settles
every tag up to ``n`` *that the broker counts as delivered*, seen by us or not. A message the
broker counts as handed to this consumer but that never reached us (a quorum queue can keep
a message checked out to a consumer across a leader change without sending it) would be
settled by such an ack, and so removed without ever being applied. So ``multiple`` covers
only a run of consecutive tags that were all delivered here and are all settled; a missing
tag stops it, and everything past it is acked one by one. The missing message stays unacked
on this consumer, and comes back when the consumer is closed (``keyq.worker.stuck_gaps``).
"""

from __future__ import annotations

from collections.abc import Iterable


class AckLedger:
    """The unacked tags of one consumer and the tag up to which everything is acked."""

    __slots__ = ("_acked_above", "_floor", "_outstanding")

    def __init__(self) -> None:
        self._outstanding: dict[int, None] = {}  # delivered here, not acked; arrival order
        self._acked_above: set[int] = set()  # acked one by one, above the floor
        self._floor = 0  # every tag <= floor was delivered here and is acked

    def delivered(self, tag: int) -> None:
        self._outstanding[tag] = None

    def __len__(self) -> int:
        return len(self._outstanding)

    def settle(self, tags: Iterable[int]) -> tuple[int, list[int]]:
        """Record ``tags`` as acked; returns ``(upto, singles)``: ack ``upto`` with
        ``multiple`` (0: none), then each of ``singles`` alone. Tags not outstanding are
        ignored (never ack twice)."""
        settling = {tag for tag in tags if tag in self._outstanding}
        for tag in settling:
            del self._outstanding[tag]
        # Walk the run of consecutive tags above the floor that are all acked once these
        # are. The multiple ack goes to the last of them being settled now: RabbitMQ refuses
        # a multiple ack whose own tag is no longer unacked.
        upto, covered = self._floor, 0
        while upto + 1 in settling or upto + 1 in self._acked_above:
            upto += 1
            if upto in settling:
                covered = upto
            else:
                self._acked_above.discard(upto)
        self._floor = upto
        singles = sorted(tag for tag in settling if tag > upto)
        self._acked_above.update(singles)
        return covered, singles
