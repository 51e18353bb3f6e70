"""A janitor's Prometheus metrics: its ``stats`` counters as metric families, labelled with
``janitor``, and the broker's file descriptors as it last saw them (when known).

Serve them with ``MetricsServer(port, collect=lambda: janitor_metrics(janitor)).start()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from keyq.broker.metrics import Metric

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
)


def janitor_metrics(janitor: Janitor) -> list[Metric]:
    """The janitor's metric families, labelled ``janitor`` (and ``reason`` for skips)."""
    stats = janitor.stats
    labels = {"janitor": janitor.janitor_id}
    metrics = [
        Metric(name, "counter", help_text, [(labels, stats.get(key, 0))])
        for key, name, help_text in COUNTERS
    ]
    metrics.append(
        Metric(
            "keyq_janitor_skipped_total",
            "counter",
            "Idle queues not deleted, by reason: held by a worker, not empty, in use "
            "(a consumer attached), unreachable, or their retirement mark lapsed before "
            "the delete.",
            [({**labels, "reason": reason}, stats.get(key, 0)) for reason, key in SKIP_REASONS],
        )
    )
    usage = janitor.fd_watch.latest
    if usage is not None and usage.used is not None and usage.limit is not None:
        node = {**labels, "node": usage.node or ""}
        metrics += [
            Metric(
                "keyq_janitor_broker_fd_used",
                "gauge",
                "Open file descriptors of the broker node closest to its limit, at the last "
                "check (needs KEYQ_MANAGEMENT_URL).",
                [(node, usage.used)],
            ),
            Metric(
                "keyq_janitor_broker_fd_limit",
                "gauge",
                "That node's file descriptor limit.",
                [(node, usage.limit)],
            ),
        ]
    return metrics
