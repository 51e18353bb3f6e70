"""A worker's batch counters and where its batches spend their time, for the heartbeat,
the metrics and the batch loop's pacing; ``BatchListener``s hear of each committed batch."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

STAGES = ("decode", "spark", "commit", "ack", "touch")


class BatchListener(Protocol):
    """Told of every committed batch, on the batch loop's thread (so quick, and never
    raising: the metrics' histograms)."""

    def batch_committed(
        self, seconds: float, committed_at_ms: int, published_at_ms: Sequence[int | None]
    ) -> None:
        """A batch of ``seconds`` committed at ``committed_at_ms`` (wall clock); the
        publish times of the events it applied (None where an event does not say)."""


@dataclass
class BatchStats:
    batches: int = 0
    events: int = 0  # applied, exactly once
    skipped: int = 0  # already applied (redeliveries, re-sends)
    dead_lettered: int = 0
    late: int = 0  # arrived after their gap was given up: dead-lettered
    gaps_skipped: int = 0  # sequence gaps given up after waiting gap_timeout
    commits_refused: int = 0
    commits_unreplicated: int = 0  # not confirmed by the replicas in time: run again
    pipeline_failures: int = 0
    spark_seconds: float = 0.0
    last_spark_seconds: float = 0.0
    last_batch_events: int = 0
    last_applied: dict[str, int] = field(default_factory=dict)  # queue -> events applied
    batch_seconds: list[float] = field(default_factory=list)
    # Where batches spend their time, summed: decoding and ordering, the Spark job, the
    # fenced commit (with dead letters and sink output), the acks, the registry touch.
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    # Shared with the worker, which may add listeners before or while a session serves.
    listeners: list[BatchListener] = field(default_factory=list)

    def note_committed(
        self,
        *,
        events: int,
        skipped: int,
        dead_lettered: int,
        late: int,
        spark_seconds: float,
        clock: StageClock,
        published_at_ms: Sequence[int | None] = (),
        applied_from: Mapping[str, int] | None = None,
    ) -> None:
        """Count a committed run; ``clock`` has timed each of ``STAGES``,
        ``published_at_ms`` are the publish times of the events it applied, and
        ``applied_from`` how many of them came from each queue."""
        self.batches += 1
        self.events += events
        self.skipped += skipped
        self.dead_lettered += dead_lettered
        self.late += late
        self.spark_seconds += spark_seconds
        self.last_spark_seconds = spark_seconds
        self.last_batch_events = events
        self.last_applied = dict(applied_from or {})
        self.batch_seconds.append(clock.total())
        del self.batch_seconds[:-1000]
        for stage, seconds in zip(STAGES, clock.laps(), strict=True):
            self.stage_seconds[stage] += seconds
        committed_at_ms = clock.wall_ms_after(STAGES.index("commit"))
        for listener in self.listeners:
            listener.batch_committed(clock.total(), committed_at_ms, published_at_ms)


class StageClock:
    """Times the stages of a run: started when made, one ``lap`` as each stage ends."""

    def __init__(self) -> None:
        self._marks = [time.monotonic()]
        self._wall_start = time.time()

    def lap(self) -> None:
        self._marks.append(time.monotonic())

    def laps(self) -> Sequence[float]:
        return [ended - begun for begun, ended in itertools.pairwise(self._marks)]

    def wall_ms_after(self, stage: int) -> int:
        """The wall-clock time (ms since the epoch) at which stage number ``stage`` ended."""
        ended = self._marks[min(stage + 1, len(self._marks) - 1)]
        return int((self._wall_start + ended - self._marks[0]) * 1000)

    def total(self) -> float:
        return self._marks[-1] - self._marks[0]
