"""One micro-batch, end to end: decode, skip what was applied, run the pipeline on Spark,
commit state and output fenced by the queues' locks, dead-letter, then ack.

Nothing is acked before the commit, and nothing is committed under a lock that moved on
(``keyq.worker.batch_attempt``). A batch whose pipeline fails is retried with backoff, then
split until the one event that fails is found and dead-lettered (``keyq.worker.isolation``).
What the batch came to is one ``BatchOutcome`` for the worker to act on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence

import redis.exceptions

from keyq.broker.errors import CommitRefused, KeyqError, KeysStopped
from keyq.broker.key_control import KeyControl
from keyq.broker.log_context import about_queues
from keyq.broker.registry import QueueRegistry
from keyq.broker.stream_policy import StreamPolicy
from keyq.worker.batch_attempt import BatchAttempt, LeaseLookup
from keyq.worker.batch_failures import Interrupted, Stale, describe_failure, spark_unavailable
from keyq.worker.batch_outcome import BatchOutcome, BatchProgress
from keyq.worker.batch_stats import STAGES, BatchStats
from keyq.worker.config import WorkerSettings
from keyq.worker.consumer import ConsumerLink
from keyq.worker.deliveries import Delivery
from keyq.worker.engine import SparkEngine
from keyq.worker.fenced_commit import FencedCommit
from keyq.worker.isolation import Isolation
from keyq.worker.pipeline import Pipeline
from keyq.worker.pipeline_job import PipelineJob
from keyq.worker.sinks import ParquetSink
from keyq.worker.state_store import StateStore

__all__ = [
    "STAGES",
    "BatchOutcome",
    "BatchProcessor",
    "BatchStats",
    "describe_failure",
    "spark_unavailable",
]

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
        link: ConsumerLink,
        holdings: LeaseLookup,
        keys_of_queues: Callable[[Collection[str]], Mapping[str, str | None]],
        stopping: threading.Event,
        control: KeyControl,
        policy: Callable[[], StreamPolicy],
    ) -> None:
        self.stats = BatchStats()
        job = PipelineJob(
            stream=stream,
            worker_id=worker_id,
            engine=engine,
            pipeline=pipeline,
            store=store,
            partitions=settings.spark_shuffle_partitions,
            wants_output=sink is not None,
        )
        self._attempt = BatchAttempt(
            worker_id=worker_id,
            job=job,
            output=FencedCommit(store=store, sink=sink, stats=self.stats),
            store=store,
            registry=registry,
            link=link,
            holdings=holdings,
            keys_of_queues=keys_of_queues,
            gap_timeout_ms=settings.sequence_gap_timeout_ms,
            stats=self.stats,
            stream=stream,
            control=control,
            policy=policy,
        )
        self._isolation = Isolation(
            attempt=self._run,
            max_attempts=settings.max_attempts,
            retry_backoff_ms=settings.retry_backoff_ms,
            stats=self.stats,
            stopping=stopping,
            keys_of_queues=keys_of_queues,
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
            return BatchOutcome(unsettled=self.unsettled(deliveries), waiting=[], lost=[])
        except KeysStopped as exc:  # the stream paused: its queues are being handed back
            worker_log.info("batch put back: %s", exc)
            unsettled = self.unsettled(deliveries)
            return BatchOutcome(unsettled=unsettled, waiting=[], lost=[], interrupted=str(exc))
        except _SERVICE_FAILURES as exc:
            worker_log.warning("batch interrupted, will retry: %s", exc)
            unsettled = self.unsettled(deliveries)
            return BatchOutcome(unsettled=unsettled, waiting=[], lost=[], interrupted=str(exc))
        progress = self._progress
        return BatchOutcome(
            unsettled=[],
            waiting=progress.waiting,
            lost=[],
            held_back=frozenset(d.queue for d in progress.held),
            limited=progress.unsettled(list({id(d): d for d in progress.limited}.values())),
            retry_limited_in=progress.retry_limited_in,
        )

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
            waiting=[],
            lost=self._progress.lost(exc.lost),
        )

    def _run(self, deliveries: list[Delivery], attempt: int, dead: str | None = None) -> None:
        with about_queues([d.queue for d in deliveries]):
            self._attempt.run(deliveries, attempt, dead, self._progress)
