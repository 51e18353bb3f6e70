"""Exactly-once by (producer, per-key sequence): a high-water mark per key and producer.

A producer numbers each key's events 1, 2, 3… and re-sends only what it had not seen
confirmed, in order; the broker keeps each key's order. So an event whose seq is at or below
its producer's mark for that key has been applied already (a redelivery after a crash, or a
re-send), and is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import orjson

# Producers remembered per key; older ones (restarted long ago) are forgotten first.
MAX_PRODUCERS_PER_KEY = 32


@dataclass
class KeyMarks:
    """Per producer, the highest seq applied to one key, in the order producers were seen."""

    seqs: dict[str, int] = field(default_factory=dict)
    applied: int = 0

    def seen(self, producer: str, seq: int) -> bool:
        return seq <= self.seqs.get(producer, 0)

    def advance(self, producer: str, seq: int) -> None:
        self.seqs.pop(producer, None)  # re-insert: most recently seen last
        self.seqs[producer] = seq
        while len(self.seqs) > MAX_PRODUCERS_PER_KEY:
            del self.seqs[next(iter(self.seqs))]

    def to_json(self) -> str:
        return orjson.dumps({"p": self.seqs, "n": self.applied}).decode()

    @classmethod
    def from_json(cls, raw: str | bytes | None) -> KeyMarks:
        if raw is None:
            return cls()
        data = orjson.loads(raw)
        return cls(seqs=dict(data.get("p", {})), applied=int(data.get("n", 0)))


@dataclass(slots=True)
class Identified:
    """What dedup needs of an event: its key and, if it has one, its identity."""

    key: str
    producer: str | None
    seq: int | None
    counts: bool = True  # False for events dead-lettered rather than applied


def split_fresh(
    events: Iterable[Identified], marks: Mapping[str, KeyMarks]
) -> tuple[list[bool], dict[str, KeyMarks]]:
    """Which events are fresh (in order), and the marks after applying the fresh ones.

    Events without an identity are always fresh. ``marks`` is not modified.
    """
    updated: dict[str, KeyMarks] = {}
    fresh: list[bool] = []
    for event in events:
        current = updated.get(event.key)
        if current is None:
            base = marks.get(event.key) or KeyMarks()
            current = KeyMarks(seqs=dict(base.seqs), applied=base.applied)
            updated[event.key] = current
        if event.producer is not None and event.seq is not None:
            if current.seen(event.producer, event.seq):
                fresh.append(False)
                continue
            current.advance(event.producer, event.seq)
        if event.counts:
            current.applied += 1
        fresh.append(True)
    return fresh, updated
