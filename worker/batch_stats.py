"""A worker's batch counters and where its batches spend their time, for the heartbeat,
the metrics and the batch loop's pacing."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

STAGES = ("decode", "spark", "commit", "ack", "touch")


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
    batch_seconds: list[float] = field(default_factory=list)
    # Where batches spend their time, summed: decoding and ordering, the Spark job, the
    # fenced commit (with dead letters and sink output), the acks, the registry touch.
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))

    def note_committed(
        self,
        *,
        events: int,
        skipped: int,
        dead_lettered: int,
        late: int,
        spark_seconds: float,
        clock: StageClock,
    ) -> None:
        """Count a committed run; ``clock`` has timed each of ``STAGES``."""
        self.batches += 1
        self.events += events
        self.skipped += skipped
        self.dead_lettered += dead_lettered
        self.late += late
        self.spark_seconds += spark_seconds
        self.last_spark_seconds = spark_seconds
        self.last_batch_events = events
        self.batch_seconds.append(clock.total())
        del self.batch_seconds[:-1000]
        for stage, seconds in zip(STAGES, clock.laps(), strict=True):
            self.stage_seconds[stage] += seconds


class StageClock:
    """Times the stages of a run: started when made, one ``lap`` as each stage ends."""

    def __init__(self) -> None:
        self._marks = [time.monotonic()]

    def lap(self) -> None:
        self._marks.append(time.monotonic())

    def laps(self) -> Sequence[float]:
        return [ended - begun for begun, ended in itertools.pairwise(self._marks)]

    def total(self) -> float:
        return self._marks[-1] - self._marks[0]
