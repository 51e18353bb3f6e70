"""Which delivery tags of one consumer may be acked with ``multiple``, and which one by one.

A channel numbers its deliveries 1, 2, 3…, and ``basic.ack(n, multiple=True)`` settles
every tag up to ``n`` *that the broker counts as delivered*, seen by us or not. A message the
broker counts as handed to this consumer but that never reached us (a quorum queue can keep
a message checked out to a consumer across a leader change without sending it) would be
settled by such an ack, and so removed without ever being applied. So ``multiple`` covers
only a run of consecutive tags that were all delivered here and are all settled; a missing
tag stops it, and everything past it is acked one by one. The missing message stays unacked
on this consumer, and comes back when the consumer is closed (``keyq.worker.holding.stuck_gaps``).

A message may be a pack of several events (``keyq.broker.packs``), each settled on its own
(committed, dead-lettered, set aside, skipped as a duplicate): its tag counts as settled only
once every one of its parts is, and a part settled twice counts once.
"""

from __future__ import annotations

from collections.abc import Iterable


class AckLedger:
    """The unacked tags of one consumer, the parts of each not settled yet, and the tag up
    to which everything is acked."""

    __slots__ = ("_acked_above", "_floor", "_outstanding")

    def __init__(self) -> None:
        # Delivered here, not acked, in arrival order: the parts of each not settled yet.
        self._outstanding: dict[int, set[int]] = {}
        self._acked_above: set[int] = set()  # acked one by one, above the floor
        self._floor = 0  # every tag <= floor was delivered here and is acked

    def delivered(self, tag: int, parts: int = 1) -> None:
        """Tag ``tag`` reached us, a message of ``parts`` events (numbered from 0)."""
        self._outstanding[tag] = set(range(max(1, parts)))

    def __len__(self) -> int:
        return len(self._outstanding)

    def settle(self, events: Iterable[tuple[int, int]]) -> tuple[int, list[int]]:
        """Record ``events`` (tag, part) as settled; returns ``(upto, singles)`` for the
        tags now settled whole: ack ``upto`` with ``multiple`` (0: none), then each of
        ``singles`` alone. A tag with a part still unsettled is not acked yet; events not
        outstanding, or settled already, are ignored (never ack twice)."""
        settling: set[int] = set()
        for tag, part in events:
            left = self._outstanding.get(tag)
            if left is None:
                continue
            left.discard(part)
            if not left:
                del self._outstanding[tag]
                settling.add(tag)
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
