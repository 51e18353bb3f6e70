"""A serving worker's report (``keyq.broker.worker_report``), read off its session's parts."""

from __future__ import annotations

import time

from keyq.broker.worker_report import GapReport, WorkerReport
from keyq.worker.amqp.deliveries import DeliveryBuffer
from keyq.worker.batch.processor import BatchProcessor
from keyq.worker.serving import Session

GAPS_REPORTED = 5


def worker_report(
    session: Session | None, *, worker_id: str, stream: str, started_ms: int, waiting: int
) -> WorkerReport:
    """The counters of ``session`` (zeros before the worker serves) and what it waits on."""
    if session is None:
        return WorkerReport(worker=worker_id, stream=stream, started_ms=started_ms, waiting=waiting)
    batch = session.processor.stats
    routing = session.processor.routing
    open_gaps = gap_reports(session.processor, session.buffer)
    return WorkerReport(
        worker=worker_id,
        stream=stream,
        ready=session.claims.ready,
        started_ms=started_ms,
        held=len(session.held),
        batches=batch.batches,
        events=batch.events,
        skipped=batch.skipped,
        dead_lettered=batch.dead_lettered,
        commits_refused=batch.commits_refused,
        commits_unreplicated=batch.commits_unreplicated,
        pipeline_failures=batch.pipeline_failures,
        spark_seconds=round(batch.spark_seconds, 3),
        last_spark_seconds=round(batch.last_spark_seconds, 3),
        stage_seconds={stage: round(value, 3) for stage, value in batch.stage_seconds.items()},
        claims=session.claims.stats.claims,
        lost=session.held.lost,
        released=session.held.released,
        peers_reaped=session.claims.peers_reaped,
        reconnects=session.link.reconnects,
        starved_moves=session.starved.starved_moves,
        late=batch.late,
        promoted=sum(routing.promoted.values()) if routing is not None else 0,
        forwarded=routing.forwarded if routing is not None else 0,
        moves_closed=session.moves.closed if session.moves is not None else 0,
        gaps_skipped=batch.gaps_skipped,
        gap_reopens=session.stuck.reopens,
        waiting=waiting,
        gaps_open=len(open_gaps),
        oldest_gap_s=open_gaps[0].waited_s if open_gaps else 0.0,
        gaps=tuple(open_gaps[:GAPS_REPORTED]),
        oldest_event_ms=session.oldest_unprocessed_ms(),
    )


def gap_reports(processor: BatchProcessor, buffer: DeliveryBuffer) -> list[GapReport]:
    """The sequence gaps the worker waits on now (events deferred behind them), oldest first."""
    now = time.monotonic()
    gaps = sorted(
        (gap for gap, queue in list(processor.open_gaps.values()) if buffer.deferred(queue)),
        key=lambda gap: gap.since,
    )
    return [
        GapReport(
            key=gap.key,
            producer=gap.producer,
            first=gap.first,
            last=gap.last,
            waited_s=round(now - gap.since, 3),
        )
        for gap in gaps
    ]
