"""A janitor's Prometheus metrics, in a registry of its own: its ``stats`` counters,
labelled ``janitor``; the broker's file descriptors as it last saw them (when known); and
the stream gauges of the streams it leads (``keyq.janitor.stream_gauges``), labelled
``stream`` and ``janitor``. All are read at each scrape.

Serve them with ``MetricsServer(port, registry=JanitorMetrics(janitor).registry)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from keyq.broker.metrics import Health
from keyq.broker.stream_figures import StreamFigures

if TYPE_CHECKING:
    from keyq.janitor.janitor import Janitor

# (key in Janitor.stats, family name, help): all cumulative since the janitor started.
COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("deleted", "keyq_janitor_deletions_total", "Idle, drained queues deleted."),
    ("passes", "keyq_janitor_passes_total", "Passes over the streams."),
    (
        "adopted",
        "keyq_janitor_adopted_total",
        "Queues found on the broker but not in the registry, registered to be reclaimed.",
    ),
    (
        "members_pruned",
        "keyq_janitor_members_pruned_total",
        "Expired worker membership entries removed.",
    ),
    ("errors", "keyq_janitor_errors_total", "Passes that failed (a service down), then retried."),
    (
        "already_gone",
        "keyq_janitor_already_gone_total",
        "Queues to delete that no longer existed on the broker.",
    ),
    ("forgotten", "keyq_janitor_forgotten_total", "Registry entries of gone queues removed."),
    (
        "revived",
        "keyq_janitor_revived_total",
        "Queues refused as not empty and marked active again, for workers to drain.",
    ),
    (
        "deleted_during_outage",
        "keyq_janitor_deleted_during_outage_total",
        "Quorum queues deleted while a node stopped answering (its replica may be left behind).",
    ),
    (
        "watchdog_repairs",
        "keyq_janitor_watchdog_repairs_total",
        "Keys the no-progress watchdog gave a path to a worker again (their queue declared, "
        "registered and announced).",
    ),
    (
        "demoted",
        "keyq_janitor_demotions_total",
        "Promoted keys of auto-mode streams demoted once their own queue was deleted.",
    ),
    (
        "not_leader",
        "keyq_janitor_not_leader_total",
        "Stream passes skipped because another janitor leads the stream.",
    ),
)

# reason label -> key in Janitor.stats
SKIP_REASONS: tuple[tuple[str, str], ...] = (
    ("held", "skipped_held"),
    ("not_empty", "skipped_not_empty"),
    ("in_use", "skipped_in_use"),
    ("unreachable", "skipped_unreachable"),
    ("mark_lapsed", "skipped_lapsed"),
    ("aside", "skipped_aside"),
)


# (family name, help, how to read it): one sample per stream led, when measured.
STREAM_GAUGES: tuple[tuple[str, str, Callable[[StreamFigures], float | None]], ...] = (
    (
        "keyq_stream_dead_letters",
        "Messages in the stream's dead-letter queue.",
        lambda figures: figures.dead_letters,
    ),
    (
        "keyq_stream_ready_events",
        "Events ready in the stream's queues, not yet delivered to a worker: the lag.",
        lambda figures: figures.ready_events,
    ),
    (
        "keyq_stream_oldest_event_age_seconds",
        "Age of the oldest event at the head of a queue that no worker consumes (0 when "
        "nothing is ready; peeked on a bounded number of queues per pass).",
        lambda figures: figures.oldest_event_age_s,
    ),
    (
        "keyq_stream_parked_keys",
        "Keys parked at a poison event, waiting for an operator.",
        lambda figures: figures.parked_keys,
    ),
    (
        "keyq_stream_paused_keys",
        "Keys an operator paused.",
        lambda figures: figures.paused_keys,
    ),
    (
        "keyq_stream_live_workers",
        "Workers whose membership heartbeat is current.",
        lambda figures: figures.live_workers,
    ),
)


class JanitorCollector(Collector):
    """The janitor's families, read from it at each scrape."""

    def __init__(self, janitor: Janitor) -> None:
        self._janitor = janitor

    def describe(self) -> list[Metric]:
        return []  # the names are fixed above; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        janitor = self._janitor
        stats = janitor.stats
        labels = ["janitor"]
        me = [janitor.janitor_id]
        for key, name, help_text in COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=labels)
            counter.add_metric(me, stats.get(key, 0))
            yield counter
        skipped = CounterMetricFamily(
            "keyq_janitor_skipped_total",
            "Idle queues not deleted, by reason: held by a worker, not empty, in use "
            "(a consumer attached), unreachable, their retirement mark lapsed before "
            "the delete, or their key has events aside.",
            labels=["janitor", "reason"],
        )
        for reason, key in SKIP_REASONS:
            skipped.add_metric([*me, reason], stats.get(key, 0))
        yield skipped
        yield from self._broker_fds()
        yield from self._streams()

    def _broker_fds(self) -> Iterator[Metric]:
        janitor = self._janitor
        usage = janitor.fd_watch.latest
        if usage is None or usage.used is None or usage.limit is None:
            return
        labels = ["janitor", "node"]
        values = [janitor.janitor_id, usage.node or ""]
        used = GaugeMetricFamily(
            "keyq_janitor_broker_fd_used",
            "Open file descriptors of the broker node closest to its limit, at the last "
            "check (needs KEYQ_PROMETHEUS_URL or KEYQ_MANAGEMENT_URL).",
            labels=labels,
        )
        used.add_metric(values, usage.used)
        limit = GaugeMetricFamily(
            "keyq_janitor_broker_fd_limit", "That node's file descriptor limit.", labels=labels
        )
        limit.add_metric(values, usage.limit)
        yield used
        yield limit

    def _streams(self) -> Iterator[Metric]:
        janitor = self._janitor
        latest = dict(janitor.gauges.latest)  # a copy: the janitor's thread replaces entries
        for name, help_text, read in STREAM_GAUGES:
            gauge = GaugeMetricFamily(name, help_text, labels=["stream", "janitor"])
            for stream, figures in sorted(latest.items()):
                value = read(figures)
                if value is not None:
                    gauge.add_metric([stream, janitor.janitor_id], value)
            yield gauge
        stranded = GaugeMetricFamily(
            "keyq_stream_stranded_keys",
            "Keys whose waiting events made no progress for KEYQ_STRANDED_AFTER_S, as the "
            "watchdog last found them (keyq status and keyq inspect say why).",
            labels=["stream", "janitor"],
        )
        for stream, count in sorted(dict(janitor.watchdog.latest).items()):
            stranded.add_metric([stream, janitor.janitor_id], count)
        yield stranded
        promoted = GaugeMetricFamily(
            "keyq_stream_promoted_keys",
            "Keys of an auto-mode stream with a queue of their own (promoted, not yet demoted).",
            labels=["stream", "janitor"],
        )
        for stream, count in sorted(dict(janitor.gauges.promoted).items()):
            promoted.add_metric([stream, janitor.janitor_id], count)
        yield promoted


class JanitorMetrics:
    """A janitor's registry and health probes."""

    def __init__(self, janitor: Janitor) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(JanitorCollector(janitor))
        self.health = Health(live=janitor.is_live, ready=janitor.is_ready)
