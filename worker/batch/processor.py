"""One micro-batch, end to end: decode, skip what was applied, run the pipeline on Spark,
commit state and output fenced by the queues' locks, dead-letter, then ack.

Nothing is acked before the commit, and nothing is committed under a lock that moved on
(``keyq.worker.batch.attempt``). A batch whose pipeline fails is retried with backoff, then
split until the one event that fails is found and dead-lettered (``keyq.worker.batch.isolation``).
What the batch came to is one ``BatchOutcome`` for the worker to act on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import redis.exceptions

from keyq.broker.errors import CommitRefused, KeyqError, KeysStopped
from keyq.broker.key_control import KeyControl
from keyq.broker.log_context import about_queues
from keyq.broker.registry import QueueRegistry
from keyq.broker.stream_policy import StreamPolicy
from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.batch.attempt import BatchAttempt
from keyq.worker.batch.effects import BatchEffects
from keyq.worker.batch.failures import Interrupted, Stale
from keyq.worker.batch.fenced_commit import FencedCommit
from keyq.worker.batch.isolation import Isolation
from keyq.worker.batch.outcome import BatchOutcome, BatchProgress
from keyq.worker.batch.ports import Acker, DeadLetterSink, KeyDirectory, LeaseLookup
from keyq.worker.batch.routing import AutoRouting
from keyq.worker.batch.spans import BatchSpans
from keyq.worker.batch.state_store import StateStore
from keyq.worker.batch.stats import BatchStats
from keyq.worker.config import WorkerSettings
from keyq.worker.pipeline import Pipeline
from keyq.worker.spark.engine import SparkEngine
from keyq.worker.spark.job import PipelineJob
from keyq.worker.spark.sinks import ParquetSink

log = logging.getLogger("keyq.worker.batch")
# A batch a service failure interrupted is reported where the worker's own messages go.
worker_log = logging.getLogger("keyq.worker")

# What makes a batch stop mid-way without blaming its events: a service failed.
_SERVICE_FAILURES = (KeyqError, redis.exceptions.RedisError, OSError)


class BatchProcessor:
    """Processes batches for one worker; used only by the batch loop's thread."""

    def __init__(
        self,
        *,
        settings: WorkerSettings,
        stream: str,
        worker_id: str,
        engine: SparkEngine,
        pipeline: Pipeline,
        store: StateStore,
        registry: QueueRegistry,
        sink: ParquetSink | None,
        acker: Acker,
        dead_letters: DeadLetterSink,
        keys: KeyDirectory,
        holdings: LeaseLookup,
        stopping: threading.Event,
        control: KeyControl,
        policy: Callable[[], StreamPolicy],
        routing: AutoRouting | None = None,
    ) -> None:
        self.stats = BatchStats()
        spans = BatchSpans(stream)
        job = PipelineJob(
            stream=stream,
            worker_id=worker_id,
            engine=engine,
            pipeline=pipeline,
            store=store,
            partitions=settings.spark_shuffle_partitions,
            wants_output=sink is not None,
        )
        output = FencedCommit(store=store, sink=sink, stats=self.stats)
        effects = BatchEffects(stream, job, output, store, control, acker, dead_letters, spans)
        self._attempt = BatchAttempt(
            worker_id=worker_id,
            stream=stream,
            effects=effects,
            spans=spans,
            store=store,
            registry=registry,
            holdings=holdings,
            keys=keys,
            control=control,
            policy=policy,
            gap_timeout_ms=settings.sequence_gap_timeout_ms,
            stats=self.stats,
            routing=routing,
        )
        self.routing = routing
        self._isolation = Isolation(
            attempt=self._run,
            max_attempts=settings.max_attempts,
            retry_backoff_ms=settings.retry_backoff_ms,
            stats=self.stats,
            stopping=stopping,
            keys=keys,
        )
        self._progress = BatchProgress()
        # Sequence gaps still open, per (key, producer), with the queue their events wait in.
        self.open_gaps = self._attempt.open_gaps

    def process(self, deliveries: Sequence[Delivery]) -> BatchOutcome:
        """Process a batch: what waits for an earlier seq, and, when it had to stop early
        (locks lost, a service down, shutting down), what is left unsettled."""
        self._progress = BatchProgress()
        try:
            self._isolation.process(list(deliveries))
        except CommitRefused as exc:
            return self._refused(deliveries, exc)
        except (Stale, Interrupted):
            return BatchOutcome(unsettled=self.unsettled(deliveries), deferred=[], lost=[])
        except KeysStopped as exc:  # the stream paused: its queues are being handed back
            worker_log.info("batch put back: %s", exc)
            unsettled = self.unsettled(deliveries)
            return BatchOutcome(unsettled=unsettled, deferred=[], lost=[], interrupted=str(exc))
        except _SERVICE_FAILURES as exc:
            worker_log.warning("batch interrupted, will retry: %s", exc)
            unsettled = self.unsettled(deliveries)
            return BatchOutcome(unsettled=unsettled, deferred=[], lost=[], interrupted=str(exc))
        return self._progress.outcome()

    def unsettled(
        self, deliveries: Sequence[Delivery], exclude: frozenset[str] = frozenset()
    ) -> list[Delivery]:
        """``deliveries`` the last ``process`` did not settle, but for queues in ``exclude``."""
        return self._progress.unsettled(deliveries, exclude)

    def _refused(self, deliveries: Sequence[Delivery], exc: CommitRefused) -> BatchOutcome:
        """A commit found locks lost: their queues stop; the rest goes back, unsettled
        (what was waiting too)."""
        self.stats.commits_refused += 1
        log.warning("commit refused: lost %s", ", ".join(sorted(exc.lost)))
        return BatchOutcome(
            unsettled=self.unsettled(deliveries, exclude=exc.lost),
            deferred=[],
            lost=self._progress.lost(exc.lost),
        )

    def _run(self, deliveries: list[Delivery], attempt: int, dead: str | None = None) -> None:
        with about_queues([d.queue for d in deliveries]):
            self._attempt.run(deliveries, attempt, dead, self._progress)
