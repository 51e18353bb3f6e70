"""Per-key order from sequence numbers, not from the order the broker delivers in.

Every SDK event carries ``(producer, seq)``, seq = 1, 2, 3… per key and producer. The broker
keeps a queue's order in the common case, but not always: a quorum queue can hand a
consumer's returned messages back after newer ones, and a producer re-sends an event the
broker returned (its queue being re-elected or deleted) behind newer events of the same key
that were routed meanwhile. Applying in delivery order would then apply the newer event and
skip the older one as "already seen" (its seq is below the mark): a loss.

So the worker sequences each batch against the committed marks before anything runs:

- ``seq <= mark``: already applied (a redelivery or a re-send), skipped; or, if the seq lies
  in a gap given up earlier, *late*: dead-lettered with that reason, never dropped silently;
- ``seq == mark + 1``: applied, and so is every waiting event it makes contiguous;
- ``seq > mark + 1``: it *waits*, unacked, until the missing ones arrive. A gap that stays
  open past ``gap_timeout_s`` (measured from when its first waiting event was set aside) is
  given up: reported, remembered in the marks, and the waiting events are applied.

Events without an identity (other clients) are applied as they come. Order between two
producers of one key stays the order the broker delivered them in.

A redriven dead letter (``redrive_id``) is told apart by that id, not by its seq, which the
mark may have passed: it is applied unless the key's marks list the id as applied already.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from keyq.worker.batch.marks import KeyMarks


@dataclass(slots=True)
class Identified:
    """What sequencing needs of one delivered item."""

    key: str
    producer: str | None
    seq: int | None
    counts: bool = True  # False for items dead-lettered rather than applied
    deferred_since: float | None = None  # when it was first set aside to wait, if ever
    redrive_id: str | None = None  # the dead letter it was put back from, if redriven


@dataclass(frozen=True, slots=True)
class Gap:
    """Seqs ``first..last`` of one producer on one key, not (yet) delivered."""

    key: str
    producer: str
    first: int
    last: int
    since: float  # when the first event behind it was set aside

    @property
    def size(self) -> int:
        return self.last - self.first + 1


@dataclass
class Plan:
    """What to do with a batch's items (indices into the input)."""

    apply: list[int] = field(default_factory=list)  # in the order to apply them
    duplicates: list[int] = field(default_factory=list)
    late: list[int] = field(default_factory=list)  # inside a given-up gap: dead-letter
    deferred: list[int] = field(default_factory=list)  # behind an open gap: keep, unacked
    marks: dict[str, KeyMarks] = field(default_factory=dict)  # after ``apply``
    open_gaps: list[Gap] = field(default_factory=list)
    skipped_gaps: list[Gap] = field(default_factory=list)  # given up in this plan


def plan_batch(
    items: Sequence[Identified],
    marks: Mapping[str, KeyMarks],
    *,
    now: float,
    gap_timeout_s: float,
) -> Plan:
    """Sequence ``items`` (in delivery order) against the committed ``marks``, which are
    not modified."""
    sequencer = _Sequencer(items, marks)
    for index, item in enumerate(items):
        sequencer.take(index, item)
    sequencer.close_gaps(now, gap_timeout_s)
    return sequencer.plan


class _Sequencer:
    """One plan in the making: the marks as they move, and the items deferred per (key,
    producer), seq -> index."""

    def __init__(self, items: Sequence[Identified], marks: Mapping[str, KeyMarks]) -> None:
        self._items = items
        self._committed = marks
        self._pending: dict[tuple[str, str], dict[int, int]] = {}
        self.plan = Plan()

    def take(self, index: int, item: Identified) -> None:
        if item.redrive_id is not None:
            self._take_redriven(index, item, item.redrive_id)
            return
        if item.producer is None or item.seq is None:
            self._apply(index)
            return
        key_marks = self._current(item.key)
        mark = key_marks.mark_of(item.producer)
        slot = (item.key, item.producer)
        if item.seq <= mark:
            if key_marks.skipped(item.producer, item.seq):
                self.plan.late.append(index)
            else:
                self.plan.duplicates.append(index)
        elif item.seq == mark + 1:
            self._apply(index)
            self._release(item.key, item.producer)
        elif item.seq in self._pending.get(slot, {}):
            self.plan.duplicates.append(index)  # a second copy of one already deferred
        else:
            self._pending.setdefault(slot, {})[item.seq] = index

    def close_gaps(self, now: float, gap_timeout_s: float) -> None:
        """What is still deferred: its gap stays open, or, past the timeout, is given up
        and what followed it applies."""
        plan = self.plan
        for (key, producer), deferred in self._pending.items():
            while deferred:
                first = self._current(key).mark_of(producer) + 1
                since = min(_since(self._items[i], now) for i in deferred.values())
                gap = Gap(key, producer, first, min(deferred) - 1, since)
                if now - since < gap_timeout_s:
                    plan.open_gaps.append(gap)
                    plan.deferred.extend(sorted(deferred.values()))
                    break
                self._current(key).skip(producer, gap.first, gap.last)
                plan.skipped_gaps.append(gap)
                self._release(key, producer)
        plan.deferred.sort()

    def _take_redriven(self, index: int, item: Identified, redrive_id: str) -> None:
        """A redriven event goes by its id, not its seq (the marks may have passed it)."""
        key_marks = self._current(item.key)
        if key_marks.was_redriven(redrive_id):
            self.plan.duplicates.append(index)
            return
        if item.counts:  # dead-lettered again, it may be redriven again
            key_marks.redrive(redrive_id, item.producer, item.seq)
            key_marks.applied += 1
        self.plan.apply.append(index)
        if item.producer is not None:
            self._release(item.key, item.producer)

    def _current(self, key: str) -> KeyMarks:
        found = self.plan.marks.get(key)
        if found is None:
            found = (self._committed.get(key) or KeyMarks()).copy()
            self.plan.marks[key] = found
        return found

    def _apply(self, index: int) -> None:
        item = self._items[index]
        key_marks = self._current(item.key)
        if item.producer is not None and item.seq is not None:
            key_marks.advance(item.producer, item.seq)
        if item.counts:
            key_marks.applied += 1
        self.plan.apply.append(index)

    def _release(self, key: str, producer: str) -> None:
        """Apply the deferred events that the mark has made contiguous."""
        deferred = self._pending.get((key, producer))
        key_marks = self._current(key)
        while deferred:
            following = deferred.pop(key_marks.mark_of(producer) + 1, None)
            if following is None:
                return
            self._apply(following)


def _since(item: Identified, now: float) -> float:
    return now if item.deferred_since is None else item.deferred_since
