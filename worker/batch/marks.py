"""Exactly-once by (producer, per-key sequence): a high-water mark per key and producer.

A producer numbers each key's events 1, 2, 3…; the worker applies them in that order
(``keyq.worker.batch.sequencing`` holds back an event until the ones before it arrived). So an event
whose seq is at or below its producer's mark for that key has been applied already (a
redelivery after a crash, or a re-send) and is skipped, unless it falls in a gap the worker
gave up waiting for: such a late event is dead-lettered, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

# Producers remembered per key; older ones (restarted long ago) are forgotten first.
MAX_PRODUCERS_PER_KEY = 256
# Given-up gaps remembered per producer and key, so that their events, if they ever come,
# are dead-lettered as late instead of being taken for duplicates.
MAX_GAPS_PER_PRODUCER = 8
# Redriven dead letters remembered per key, so that a redrive run twice applies each once.
MAX_REDRIVEN_PER_KEY = 4096


@dataclass
class KeyMarks:
    """Per producer, the highest seq applied to one key, in the order producers were seen."""

    seqs: dict[str, int] = field(default_factory=dict)
    applied: int = 0
    # Per producer, ranges [first, last] of seqs skipped after waiting too long for them.
    gaps: dict[str, list[list[int]]] = field(default_factory=dict)
    # The ids of the redriven dead letters applied to this key, oldest first.
    redriven: list[str] = field(default_factory=list)

    def seen(self, producer: str, seq: int) -> bool:
        return seq <= self.seqs.get(producer, 0)

    def mark_of(self, producer: str) -> int:
        return self.seqs.get(producer, 0)

    def advance(self, producer: str, seq: int) -> None:
        self.seqs.pop(producer, None)  # re-insert: most recently seen last
        self.seqs[producer] = seq
        while len(self.seqs) > MAX_PRODUCERS_PER_KEY:
            forgotten = next(iter(self.seqs))
            del self.seqs[forgotten]
            self.gaps.pop(forgotten, None)

    def skip(self, producer: str, first: int, last: int) -> None:
        """Give up on seqs ``first..last``: the mark moves past them, and they are remembered
        as skipped (not applied), so a late arrival is recognised."""
        ranges = self.gaps.setdefault(producer, [])
        ranges.append([first, last])
        del ranges[:-MAX_GAPS_PER_PRODUCER]
        self.advance(producer, last)

    def skipped(self, producer: str, seq: int) -> bool:
        """Whether ``seq`` is one the worker gave up waiting for (never applied)."""
        return any(first <= seq <= last for first, last in self.gaps.get(producer, ()))

    def was_redriven(self, redrive_id: str) -> bool:
        return redrive_id in self.redriven

    def redrive(self, redrive_id: str, producer: str | None, seq: int | None) -> None:
        """Note a redriven dead letter as applied. Its seq moves its producer's mark only
        when it is the very next one (a poison event parked before its commit): any other
        seq was counted already, or belongs to a gap the mark must not jump."""
        self.redriven.append(redrive_id)
        del self.redriven[:-MAX_REDRIVEN_PER_KEY]
        if producer is not None and seq is not None and seq == self.mark_of(producer) + 1:
            self.advance(producer, seq)

    def copy(self) -> KeyMarks:
        return KeyMarks(
            seqs=dict(self.seqs),
            applied=self.applied,
            gaps={producer: [list(r) for r in ranges] for producer, ranges in self.gaps.items()},
            redriven=list(self.redriven),
        )

    def to_json(self) -> str:
        data: dict[str, object] = {"p": self.seqs, "n": self.applied}
        if self.gaps:
            data["g"] = self.gaps
        if self.redriven:
            data["r"] = self.redriven
        return orjson.dumps(data).decode()

    @classmethod
    def from_json(cls, raw: str | bytes | None) -> KeyMarks:
        if raw is None:
            return cls()
        data = orjson.loads(raw)
        gaps = {str(p): [[int(a), int(b)] for a, b in r] for p, r in data.get("g", {}).items()}
        return cls(
            seqs=dict(data.get("p", {})),
            applied=int(data.get("n", 0)),
            gaps=gaps,
            redriven=[str(r) for r in data.get("r", [])],
        )
