"""What a worker reports about itself: one typed record, written with each heartbeat and read
by ``keyq status`` and the worker's metrics.

The worker and its readers agree on one dataclass rather than on dict keys, so a field added
or renamed is seen by the type checker everywhere it is used. ``parse`` reads what any worker
wrote into Redis, including one of another version: a field it did not write takes its
default, and a record that is not a report at all is None.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass(frozen=True)
class GapReport:
    """A sequence gap the worker waits on: seqs ``first``..``last`` of ``producer`` on ``key``."""

    key: str
    producer: str
    first: int
    last: int
    waited_s: float


@dataclass(frozen=True)
class WorkerReport:
    """A worker's counters (cumulative since it started) and what it waits on now."""

    worker: str
    stream: str
    ready: bool = False
    started_ms: int = 0
    held: int = 0
    batches: int = 0
    events: int = 0  # applied, exactly once
    skipped: int = 0  # already applied (redeliveries, re-sends)
    dead_lettered: int = 0
    commits_refused: int = 0
    commits_unreplicated: int = 0
    pipeline_failures: int = 0
    spark_seconds: float = 0.0
    last_spark_seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    claims: int = 0
    lost: int = 0
    released: int = 0
    peers_reaped: int = 0
    reconnects: int = 0
    starved_moves: int = 0  # connections moved off a node that starved a queue
    late: int = 0
    promoted: int = 0  # auto mode: keys this worker promoted to queues of their own
    forwarded: int = 0  # auto mode: events forwarded from their bucket to their key's queue
    moves_closed: int = 0  # auto mode: moves closed as the holder of the key's bucket
    gaps_skipped: int = 0
    gap_reopens: int = 0
    waiting: int = 0  # events held back until an earlier seq arrives
    gaps_open: int = 0
    oldest_gap_s: float = 0.0
    gaps: tuple[GapReport, ...] = ()  # the oldest open gaps, at most five
    # When the oldest event it holds and has not applied was published (ms since the epoch):
    # the janitor's lag age takes it into account for the queues workers consume.
    oldest_event_ms: int | None = None
    # Where the worker runs: added to the heartbeat by Membership, so read back, not reported.
    host: str | None = None
    pid: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready values (what ``Worker.stats()`` returns).

        A host or pid the report does not know is left out rather than None: the heartbeat
        stores this dict over the host and pid Membership writes, and a None would erase them.
        """
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["gaps"] = [dataclasses.asdict(gap) for gap in self.gaps]
        values["stage_seconds"] = dict(self.stage_seconds)
        for where in ("host", "pid"):
            if values[where] is None:
                del values[where]
        return values

    def to_json(self) -> str:
        return orjson.dumps(self.to_dict()).decode()

    @classmethod
    def parse(
        cls,
        raw: str | bytes | None,
        *,
        worker: str | None = None,
        stream: str | None = None,
    ) -> WorkerReport | None:
        """The report in ``raw``, or None if it is missing, not JSON, or not a report.

        ``worker`` and ``stream`` stand in for an identity the record does not carry: a
        reader of a stream's members knows both, and a heartbeat written by hand (a test's,
        a stand-in's) may name neither. A record that names them keeps its own.
        """
        if raw is None:
            return None
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(data, dict):
            return None
        named_worker, named_stream = data.get("worker"), data.get("stream")
        worker = named_worker if isinstance(named_worker, str) else worker
        stream = named_stream if isinstance(named_stream, str) else stream
        if worker is None or stream is None:
            return None
        values: dict[str, Any] = {"worker": worker, "stream": stream}
        for spec in dataclasses.fields(cls):
            if spec.name in values or spec.name not in data:
                continue
            value = _typed(spec.name, data[spec.name])
            if value is not None:
                values[spec.name] = value
        return cls(**values)


_INTS = frozenset(
    f.name for f in dataclasses.fields(WorkerReport) if f.type in ("int", "int | None")
)
_FLOATS = frozenset(f.name for f in dataclasses.fields(WorkerReport) if f.type == "float")


def _typed(name: str, value: object) -> object | None:
    """``value`` if it has the type field ``name`` holds, else None (the default is kept)."""
    if name in _INTS:
        return _int(value)
    if name in _FLOATS:
        return _float(value)
    if name == "ready":
        return value if isinstance(value, bool) else None
    if name == "host":
        return value if isinstance(value, str) else None
    if name == "stage_seconds":
        if not isinstance(value, dict):
            return None
        stages = ((str(stage), _float(seconds)) for stage, seconds in value.items())
        return {stage: seconds for stage, seconds in stages if seconds is not None}
    if name == "gaps":
        return tuple(gap for gap in map(_gap, value if isinstance(value, list) else []) if gap)
    return None


def _int(value: object) -> int | None:
    """An int that JSON wrote as one (a bool is not a count)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: object) -> float | None:
    """A number as a float: a writer may well have written 2.0 as 2."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _gap(value: object) -> GapReport | None:
    if not isinstance(value, dict):
        return None
    key, producer = value.get("key"), value.get("producer")
    first, last, waited = _int(value.get("first")), _int(value.get("last")), value.get("waited_s")
    if not isinstance(key, str) or first is None:
        return None
    return GapReport(
        key=key,
        producer=producer if isinstance(producer, str) else "",
        first=first,
        last=first if last is None else last,
        waited_s=_float(waited) or 0.0,
    )
