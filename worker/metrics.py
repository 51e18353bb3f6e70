"""A worker's Prometheus metrics: the numbers of its ``report()`` as metric families, labelled
with ``stream`` and ``worker``, and a batch-latency histogram.

Each family reads one typed field of ``WorkerReport``, so a field renamed is a type error
here, not a family that silently reads 0.

Serve them with ``MetricsServer(port, collect=lambda: worker_metrics(worker)).start()``.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from keyq.broker.metrics import Histogram, Metric
from keyq.broker.worker_report import WorkerReport

if TYPE_CHECKING:
    from keyq.worker.daemon import Worker

# Batches run a Spark job each: tens of milliseconds when idle, seconds under load.
BATCH_SECONDS_BUCKETS: tuple[float, ...] = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class Figure(NamedTuple):
    """One metric family read from a worker's report: its name, help and how to read it."""

    name: str
    help: str
    read: Callable[[WorkerReport], float]


# All cumulative since the worker started.
COUNTERS: tuple[Figure, ...] = (
    Figure(
        "keyq_worker_events_processed_total",
        "Events applied by this worker's committed batches (exactly once).",
        lambda report: report.events,
    ),
    Figure(
        "keyq_worker_events_skipped_total",
        "Duplicate events skipped: redeliveries and re-sends that were already applied.",
        lambda report: report.skipped,
    ),
    Figure("keyq_worker_batches_total", "Micro-batches committed.", lambda report: report.batches),
    Figure(
        "keyq_worker_spark_seconds_total",
        "Seconds spent running the pipeline's Spark jobs.",
        lambda report: report.spark_seconds,
    ),
    Figure(
        "keyq_worker_claims_total",
        "Queues claimed (a lock taken and a consumer opened).",
        lambda report: report.claims,
    ),
    Figure(
        "keyq_worker_releases_total",
        "Queues handed back while running (idle, or to rebalance).",
        lambda report: report.released,
    ),
    Figure(
        "keyq_worker_queues_lost_total",
        "Queues lost without handing them back: lock lost or moved on, consumer cancelled.",
        lambda report: report.lost,
    ),
    Figure(
        "keyq_worker_dead_lettered_total",
        "Messages sent to the dead-letter queue.",
        lambda report: report.dead_lettered,
    ),
    Figure(
        "keyq_worker_commits_refused_total",
        "Batch commits refused because a queue's lock had moved on.",
        lambda report: report.commits_refused,
    ),
    Figure(
        "keyq_worker_commits_unreplicated_total",
        "Batch commits not confirmed by the required Redis replicas in time (run again).",
        lambda report: report.commits_unreplicated,
    ),
    Figure(
        "keyq_worker_peers_reaped_total",
        "Dead peer workers whose locks and membership this worker released.",
        lambda report: report.peers_reaped,
    ),
    Figure(
        "keyq_worker_pipeline_failures_total",
        "Failed pipeline runs (each retry and each isolation step counts).",
        lambda report: report.pipeline_failures,
    ),
    Figure(
        "keyq_worker_reconnects_total",
        "Reconnections to RabbitMQ.",
        lambda report: report.reconnects,
    ),
    Figure(
        "keyq_worker_sequence_gaps_skipped_total",
        "Sequence gaps given up after waiting sequence_gap_timeout_ms: the events behind "
        "them were applied without the missing ones.",
        lambda report: report.gaps_skipped,
    ),
    Figure(
        "keyq_worker_gap_reopens_total",
        "Consumers reopened because a sequence gap stayed open, so that the broker hands "
        "back anything it counts as delivered to them.",
        lambda report: report.gap_reopens,
    ),
    Figure(
        "keyq_worker_events_late_total",
        "Events that arrived after their gap was given up, dead-lettered as late.",
        lambda report: report.late,
    ),
)

# What the worker holds and waits on now, and when it started.
GAUGES: tuple[Figure, ...] = (
    Figure("keyq_worker_queues_held", "Queues this worker holds now.", lambda report: report.held),
    Figure(
        "keyq_worker_events_waiting",
        "Events held back, unacked, until an earlier seq of their key and producer arrives.",
        lambda report: report.waiting,
    ),
    Figure(
        "keyq_worker_sequence_gaps_open",
        "Sequence gaps this worker waits on now.",
        lambda report: report.gaps_open,
    ),
    Figure(
        "keyq_worker_sequence_gap_oldest_seconds",
        "How long the oldest open sequence gap has been waited on.",
        lambda report: report.oldest_gap_s,
    ),
    Figure(
        "keyq_worker_start_time_seconds",
        "When this worker started, in seconds since the epoch.",
        lambda report: report.started_ms / 1000,
    ),
)

# The report's numbers that are no metric family, each with why: a field added to
# WorkerReport belongs in a table above or here (a unit test holds every field to that).
UNEXPORTED: dict[str, str] = {
    "last_spark_seconds": "the last batch alone: keyq_worker_batch_seconds has every batch",
    "pid": "which process, not a figure: Prometheus knows its target",
}


class BatchLatency:
    """A cumulative histogram of batch durations, fed from the processor's window of the
    last (at most 1000) durations: each call observes the entries appended since the last.

    New entries are told apart by object identity (each duration is a fresh float, and the
    last one seen is kept alive here). Batches that scrolled out of the window between two
    scrapes (over 1000 of them) are not observed.
    """

    def __init__(self, bounds: Sequence[float] = BATCH_SECONDS_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self._lock = threading.Lock()
        self._per_bucket = [0] * (len(self.bounds) + 1)  # the last one is +Inf only
        self._count = 0
        self._sum = 0.0
        self._last_seen: float | None = None

    def update(self, window: Sequence[float]) -> None:
        with self._lock:
            start = 0
            if self._last_seen is not None:
                for index in range(len(window) - 1, -1, -1):
                    if window[index] is self._last_seen:
                        start = index + 1
                        break
            for seconds in window[start:]:
                self._per_bucket[bisect.bisect_left(self.bounds, seconds)] += 1
                self._count += 1
                self._sum += seconds
            if window:
                self._last_seen = window[-1]

    def snapshot(self) -> Histogram:
        with self._lock:
            cumulative, buckets = 0, []
            for bound, count in zip(self.bounds, self._per_bucket, strict=False):
                cumulative += count
                buckets.append((bound, cumulative))
            return Histogram(buckets=buckets, count=self._count, sum=self._sum)


_latencies: weakref.WeakKeyDictionary[Worker, BatchLatency] = weakref.WeakKeyDictionary()
_latencies_lock = threading.Lock()


def batch_durations(worker: Worker) -> list[float]:
    """The worker's recent batch durations in seconds, oldest first (empty before it serves)."""
    return worker.batch_seconds()


def batch_latency(worker: Worker) -> Histogram:
    """The worker's batch-latency histogram, brought up to date."""
    with _latencies_lock:
        latency = _latencies.get(worker)
        if latency is None:
            latency = _latencies[worker] = BatchLatency()
    latency.update(batch_durations(worker))
    return latency.snapshot()


def worker_metrics(worker: Worker) -> list[Metric]:
    """The worker's metric families, each with one sample labelled ``stream`` and ``worker``."""
    report = worker.report()
    labels = {"stream": report.stream, "worker": report.worker}
    metrics = [
        Metric(figure.name, "counter", figure.help, [(labels, figure.read(report))])
        for figure in COUNTERS
    ]
    metrics += [
        Metric(figure.name, "gauge", figure.help, [(labels, figure.read(report))])
        for figure in GAUGES
    ]
    metrics.append(
        Metric(
            "keyq_worker_batch_seconds",
            "histogram",
            "Duration of committed micro-batches, from decoding to the ack, in seconds.",
            [(labels, batch_latency(worker))],
        )
    )
    return metrics
