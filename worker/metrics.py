"""A worker's Prometheus metrics, in a registry of its own: the numbers of its ``report()``
as counters and gauges, read at each scrape, and two histograms observed as batches commit
(batch duration, and each applied event's time from publish to commit).

Each report family reads one typed field of ``WorkerReport``, so a field renamed is a type
error here, not a family that silently reads 0. All families carry ``stream`` and ``worker``.

Serve them with ``MetricsServer(port, registry=WorkerMetrics(worker).registry)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from keyq.broker.metrics import Health
from keyq.broker.worker_report import WorkerReport

if TYPE_CHECKING:
    from keyq.worker.daemon import Worker

LABELS = ("stream", "worker")

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

# Publish to commit: a batch's wait and duration when keeping up, minutes when behind.
END_TO_END_SECONDS_BUCKETS: tuple[float, ...] = (
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
    120.0,
    300.0,
    600.0,
    1800.0,
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
        "keyq_worker_starved_moves_total",
        "Connections moved to another RabbitMQ node because a quorum queue delivered nothing "
        "through this one while it had messages ready (its replica there may be down).",
        lambda report: report.starved_moves,
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
        "keyq_worker_promotions_total",
        "Auto mode: keys this worker promoted to a queue of their own (by rate, backlog, held "
        "back or rate-limited).",
        lambda report: report.promoted,
    ),
    Figure(
        "keyq_worker_events_forwarded_total",
        "Auto mode: events this worker forwarded from their bucket to their key's own queue.",
        lambda report: report.forwarded,
    ),
    Figure(
        "keyq_worker_moves_closed_total",
        "Auto mode: moves this worker closed as the holder of the key's bucket.",
        lambda report: report.moves_closed,
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
        "keyq_worker_oldest_event_age_seconds",
        "Age of the oldest event this worker holds and has not applied (0 when none).",
        lambda report: (
            0.0
            if report.oldest_event_ms is None
            else max(0.0, time.time() - report.oldest_event_ms / 1000)
        ),
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


class ReportCollector(Collector):
    """The report's counters and gauges, read from a fresh report at each scrape."""

    def __init__(self, report: Callable[[], WorkerReport]) -> None:
        self._report = report

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration: the names are fixed above

    def collect(self) -> Iterator[Metric]:
        report = self._report()
        values = [report.stream, report.worker]
        for figure in COUNTERS:
            counter = CounterMetricFamily(figure.name, figure.help, labels=LABELS)
            counter.add_metric(values, figure.read(report))
            yield counter
        for figure in GAUGES:
            gauge = GaugeMetricFamily(figure.name, figure.help, labels=LABELS)
            gauge.add_metric(values, figure.read(report))
            yield gauge


class WorkerMetrics:
    """A worker's registry: its report's families, and histograms fed by its batches.
    Made before the worker runs (or while it does): it listens from then on."""

    def __init__(self, worker: Worker) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(ReportCollector(worker.report))
        self.health = Health(live=worker.is_live, ready=worker.is_ready)
        batch = Histogram(
            "keyq_worker_batch_seconds",
            "Duration of committed micro-batches, from decoding to the ack, in seconds.",
            LABELS,
            registry=self.registry,
            buckets=BATCH_SECONDS_BUCKETS,
        )
        end_to_end = Histogram(
            "keyq_worker_end_to_end_seconds",
            "Seconds from an event's publish (its x-keyq-published-at header, the producer's "
            "clock) to the commit of the batch that applied it; one observation per event.",
            LABELS,
            registry=self.registry,
            buckets=END_TO_END_SECONDS_BUCKETS,
        )
        self._batch = batch.labels(worker.stream, worker.worker_id)
        self._end_to_end = end_to_end.labels(worker.stream, worker.worker_id)
        worker.batch_listeners.append(self)

    def batch_committed(
        self, seconds: float, committed_at_ms: int, published_at_ms: Sequence[int | None]
    ) -> None:
        self._batch.observe(seconds)
        for published in published_at_ms:
            if published is not None:
                # A producer's clock ahead of the worker's reads as 0, not a negative time.
                self._end_to_end.observe(max(0, committed_at_ms - published) / 1000)
