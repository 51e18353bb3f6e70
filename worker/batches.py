"""One micro-batch, end to end: decode, skip what was applied, run the pipeline on Spark,
commit state and output fenced by the queues' locks, dead-letter, then ack.

Nothing is acked before the commit, and nothing is committed under a lock that moved on. A
batch whose pipeline fails is retried with backoff; if it keeps failing, it is split (by
queue, then in halves, in order) until the one event that fails is found and dead-lettered
with the reason, and everything else is processed. So a poison event costs a few extra
Spark jobs, never a loop.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keyq.broker.errors import (
    CommitNotReplicated,
    CommitRefused,
    KeyqError,
    PipelineError,
    SparkUnavailable,
)
from keyq.broker.locks import Lease
from keyq.broker.log_context import about_queues
from keyq.broker.registry import QueueRegistry
from keyq.worker.config import WorkerSettings
from keyq.worker.consumer import ConsumerLink, DeadLetter
from keyq.worker.decoding import Event, Undecodable, decode
from keyq.worker.deliveries import Delivery
from keyq.worker.engine import SparkEngine, batch_table
from keyq.worker.fold import failing_event, without_event_token
from keyq.worker.holdings import Holdings
from keyq.worker.pipeline import BatchContext, KeyedState, Pipeline
from keyq.worker.sequencing import Gap, Identified, Plan, plan_batch
from keyq.worker.sinks import ParquetSink
from keyq.worker.state_store import StateStore

log = logging.getLogger("keyq.worker.batch")


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


class _EventFailed(PipelineError):
    """The pipeline failed on one event, which the failure names: (key, producer, seq)."""

    def __init__(self, reason: str, event: tuple[str, str, int]) -> None:
        super().__init__(reason)
        self.event = event


def describe_failure(exc: BaseException) -> str:
    """A one-line reason for a failure, good enough for a dead-letter header."""
    text = without_event_token(str(exc))
    marker = "FoldFailed: "
    if marker in text:
        return text[text.index(marker) + len(marker) :].splitlines()[0].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # Spark's Python errors end with the Python exception's own line.
    for line in reversed(lines):
        if ": " in line and not line.startswith(("at ", "File ")):
            return f"pipeline failed: {line}"[:1000]
    return f"pipeline failed: {type(exc).__name__}: {lines[0] if lines else ''}"[:1000]


_SPARK_DOWN_SIGNS = (
    "Py4JNetworkError",
    "Connection refused",
    "SparkContext was shut down",
    "Cannot call methods on a stopped SparkContext",
    "StatusCode.UNAVAILABLE",
    "Answer from Java side is empty",
)


def spark_unavailable(exc: BaseException) -> bool:
    """Whether a failure is Spark itself being gone, rather than the pipeline failing on
    these events: such batches wait and retry, and are never dead-lettered."""
    text = f"{type(exc).__name__}: {exc}"
    return any(sign in text for sign in _SPARK_DOWN_SIGNS)


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
        holdings: Holdings,
        keys_of_queues: Callable[[Collection[str]], Mapping[str, str | None]],
        stopping: threading.Event,
    ) -> None:
        self._settings = settings
        self._stream = stream
        self._worker_id = worker_id
        self._engine = engine
        self._pipeline = pipeline
        self._store = store
        self._registry = registry
        self._sink = sink
        self._link = link
        self._holdings = holdings
        self._keys_of_queues = keys_of_queues
        self._stopping = stopping
        self._batch_numbers = itertools.count(1)
        self._settled: set[tuple[str, int, int]] = set()
        self.lost_leases: list[Lease] = []  # found lost by a refused commit, to stop now
        # Set aside by the last ``process``: they wait for an earlier seq (to park).
        self.waiting: list[Delivery] = []
        # Sequence gaps still open, per (key, producer), with the queue their events wait in.
        self.open_gaps: dict[tuple[str, str], tuple[Gap, str]] = {}
        self._last_leases: dict[str, Lease] = {}
        # Staged output of commits not yet confirmed by the Redis replicas, by batch id.
        self._unreplicated_output: dict[str, str] = {}
        self.stats = BatchStats()

    # ---- public ---------------------------------------------------------------------------

    def process(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """Process a batch; returns the deliveries left unsettled (to put back) when the
        batch had to stop early (locks lost, a service down, shutting down)."""
        self._settled = set()
        self._last_leases = {}
        self.waiting = []
        try:
            self._process_with_retries(list(deliveries))
        except CommitRefused as exc:
            self.waiting = []  # unsettled: handed back with the rest
            self.stats.commits_refused += 1
            log.warning("commit refused: lost %s", ", ".join(sorted(exc.lost)))
            self.lost_leases.extend(
                lease for queue, lease in self._last_leases.items() if queue in exc.lost
            )
            return self.unsettled(deliveries, exclude=exc.lost)
        except (_Stale, _Interrupted):
            self.waiting = []
            return self.unsettled(deliveries)
        return []

    # ---- retries and isolation -------------------------------------------------------------

    def _process_with_retries(self, deliveries: list[Delivery]) -> None:
        failure: PipelineError | None = None
        for attempt in range(1, self._settings.max_attempts + 1):
            try:
                self._run(deliveries, attempt)
                return
            except PipelineError as exc:
                failure = exc
                self.stats.pipeline_failures += 1
                log.warning("batch failed (attempt %d): %s", attempt, describe_failure(exc))
                if attempt < self._settings.max_attempts:
                    self._backoff(attempt)
        assert failure is not None
        if len(deliveries) == 1:
            self._run(deliveries, self._settings.max_attempts, dead=describe_failure(failure))
            return
        self._isolate_queues(deliveries, failure)

    def _isolate_queues(self, deliveries: list[Delivery], failure: PipelineError) -> None:
        """After a batch failed: the queue of the event the failure names is isolated on its
        own, and every other queue's deliveries run again together, in one job. (One job per
        queue cost a key-mode batch, which spans hundreds of queues, tens of seconds per
        poison event.) A failure that names no event here falls back to a job per queue."""
        by_queue: dict[str, list[Delivery]] = {}
        for delivery in deliveries:
            by_queue.setdefault(delivery.queue, []).append(delivery)
        named = next(
            (
                queue
                for queue, group in by_queue.items()
                if self._named_event(failure, group) is not None
            ),
            None,
        )
        if named is None or len(by_queue) == 1:
            for group in by_queue.values():
                self._isolate(group, failure)
            return
        self._isolate(by_queue[named], failure)
        rest = [delivery for delivery in deliveries if delivery.queue != named]
        try:
            self._run(rest, 1)
        except PipelineError as exc:
            self.stats.pipeline_failures += 1
            self._isolate_queues(rest, exc)

    def _isolate(self, group: list[Delivery], known: PipelineError | None = None) -> None:
        """Process one queue's deliveries, in order, dead-lettering only what fails: around
        the event a failure names when it names one here, else by halves."""
        failure = known
        if failure is not None and self._named_event(failure, group) is None:
            failure = None  # it was about other events: see how this group fares alone
        if failure is None:
            try:
                self._run(group, 1)
                return
            except PipelineError as exc:
                self.stats.pipeline_failures += 1
                failure = exc
        index = self._named_event(failure, group)
        if index is not None:
            before, named, after = group[:index], group[index], group[index + 1 :]
            if before:
                self._isolate(before)
            self._isolate_one(named, failure)
            if after:
                self._isolate(after)
            return
        if len(group) == 1:
            self._isolate_one(group[0], failure)
            return
        middle = len(group) // 2
        self._isolate(group[:middle])
        self._isolate(group[middle:])

    def _named_event(self, failure: PipelineError, group: Sequence[Delivery]) -> int | None:
        """Where in ``group`` the event named by ``failure`` is, if it names one there."""
        if not isinstance(failure, _EventFailed):
            return None
        named = failure.event
        key, producer, seq = named
        fallback = self._fallback_keys(group)
        for index, delivery in enumerate(group):
            decoded = decode(delivery, fallback[delivery.queue])
            if isinstance(decoded, Event) and (decoded.key, decoded.producer, decoded.seq) == (
                key,
                producer,
                seq,
            ):
                return index
        return None

    def _isolate_one(self, delivery: Delivery, failure: PipelineError) -> None:
        """One event that failed: retried with backoff, then dead-lettered with its reason."""
        group = [delivery]
        for attempt in range(2, self._settings.max_attempts + 1):
            self._backoff(attempt - 1)
            try:
                self._run(group, attempt)
                return
            except PipelineError as exc:
                self.stats.pipeline_failures += 1
                failure = exc
        self._run(group, self._settings.max_attempts, dead=describe_failure(failure))

    def _backoff(self, attempt: int) -> None:
        delay = self._settings.retry_backoff_ms / 1000 * (2 ** (attempt - 1))
        if self._stopping.wait(min(delay, 10.0)):
            raise _Interrupted

    def unsettled(
        self, deliveries: Sequence[Delivery], exclude: frozenset[str] = frozenset()
    ) -> list[Delivery]:
        return [
            d
            for d in deliveries
            if d.queue not in exclude
            and (d.queue, d.channel_epoch, d.delivery_tag) not in self._settled
        ]

    # ---- one attempt -----------------------------------------------------------------------

    def _run(self, deliveries: list[Delivery], attempt: int, dead: str | None = None) -> None:
        with about_queues([d.queue for d in deliveries]):
            self._run_logged(deliveries, attempt, dead)

    def _run_logged(self, deliveries: list[Delivery], attempt: int, dead: str | None) -> None:
        started = time.monotonic()
        leases = self._leases(deliveries)
        events: list[Event] = []
        letters: list[Undecodable] = []
        fallback = self._fallback_keys(deliveries)
        for delivery in deliveries:
            decoded = decode(delivery, fallback[delivery.queue])
            if dead is not None and isinstance(decoded, Event):
                decoded = Undecodable(delivery, dead, decoded.key, decoded.producer, decoded.seq)
            if isinstance(decoded, Event):
                events.append(decoded)
            else:
                letters.append(decoded)

        identities: list[Identified] = []
        ordered: list[Event | Undecodable] = []
        for item in _arrival_order(deliveries, events, letters):
            if item.key is None:
                continue  # no key: dead-lettered, nothing to mark
            identities.append(
                Identified(
                    item.key,
                    item.producer,
                    item.seq,
                    counts=isinstance(item, Event),
                    waiting_since=item.delivery.waiting_since,
                )
            )
            ordered.append(item)
        keys = list(dict.fromkeys(i.key for i in identities))
        plan = plan_batch(
            identities,
            self._store.marks(keys),
            now=time.monotonic(),
            gap_timeout_s=self._settings.sequence_gap_timeout_ms / 1000,
        )
        in_order = [ordered[index] for index in plan.apply]
        fresh_events = [item for item in in_order if isinstance(item, Event)]
        fresh_letters = [letter for letter in letters if letter.key is None]
        fresh_letters += [item for item in in_order if isinstance(item, Undecodable)]
        fresh_letters += [_late(ordered[index]) for index in plan.late]
        position = {id(delivery): index for index, delivery in enumerate(deliveries)}
        fresh_letters.sort(key=lambda letter: position[id(letter.delivery)])  # as delivered
        waiting = [ordered[index].delivery for index in plan.waiting]
        waiting_ids = {id(delivery) for delivery in waiting}
        settling = [d for d in deliveries if id(d) not in waiting_ids]
        skipped = len(plan.duplicates)
        if not settling:
            self._note_gaps(keys, plan, ordered)
            self.waiting.extend(waiting)
            return  # everything here waits for an earlier seq: nothing to commit or ack

        prepared = time.monotonic()
        batch_id = f"{self._worker_id}-{next(self._batch_numbers)}"
        states: dict[str, str] = {}
        staged: str | None = None
        spark_seconds = 0.0
        if fresh_events:
            spark_started = time.monotonic()
            states, output = self._run_pipeline(batch_id, fresh_events, keys, leases, attempt)
            spark_seconds = time.monotonic() - spark_started
            if self._sink is not None and output is not None and output.num_rows:
                staged = self._sink.stage(output, batch_id)

        ran = time.monotonic()
        if fresh_letters:
            # Before the commit: once the marks move past a dead event, a redelivery would
            # skip it, so its copy must be safe in the dead-letter queue first.
            self._link.dead_letter(
                [DeadLetter(letter.delivery, letter.reason, attempt) for letter in fresh_letters]
            )
        try:
            lost = self._store.commit(
                list(leases.values()),
                plan.marks,
                states,
                None if staged is None else (batch_id, staged),
            )
        except CommitNotReplicated:
            if staged is not None:
                # Committed on the primary only: visible once a later commit proves it
                # replicated, or dropped if a failover took its record (the batch is redone).
                self._unreplicated_output[batch_id] = staged
            self.stats.commits_unreplicated += 1
            raise
        if lost:
            if staged is not None and self._sink is not None:
                self._sink.discard(staged)
            raise CommitRefused(f"batch {batch_id}: locks moved on", lost)
        if staged is not None and self._sink is not None:
            self._sink.publish(batch_id, staged)
            self._store.forget_sink_record(batch_id)
        self._publish_replicated_output()
        committed = time.monotonic()
        self._ack(settling)
        acked = time.monotonic()
        self.waiting.extend(waiting)
        self._note_gaps(keys, plan, ordered)
        try:
            self._registry.touch(leases)
        except Exception:
            log.debug("registry touch failed", exc_info=True)
        touched = time.monotonic()

        stats = self.stats
        stats.batches += 1
        stats.events += len(fresh_events)
        stats.skipped += skipped
        stats.dead_lettered += len(fresh_letters)
        stats.late += len(plan.late)
        stats.spark_seconds += spark_seconds
        stats.last_spark_seconds = spark_seconds
        stats.last_batch_events = len(fresh_events)
        stats.batch_seconds.append(touched - started)
        del stats.batch_seconds[:-1000]
        marks = (started, prepared, ran, committed, acked, touched)
        for stage, (begun, ended) in zip(STAGES, itertools.pairwise(marks), strict=True):
            stats.stage_seconds[stage] += ended - begun
        for letter in fresh_letters:
            log.warning("dead-lettered a message of %s: %s", letter.delivery.queue, letter.reason)

    def _publish_replicated_output(self) -> None:
        """Output of batches whose commit was not confirmed by the replicas: a replicated
        commit since proves their record reached them too, if it survived on the primary."""
        if not self._unreplicated_output or self._sink is None:
            self._unreplicated_output.clear()
            return
        pending = self._store.pending_sink_records()
        for batch_id, staged in self._unreplicated_output.items():
            if pending.get(batch_id) == staged:
                self._sink.publish(batch_id, staged)
                self._store.forget_sink_record(batch_id)
            else:
                self._sink.discard(staged)  # the commit was lost with a primary: redone
        self._unreplicated_output.clear()

    def _note_gaps(
        self, keys: Sequence[str], plan: Plan, items: Sequence[Event | Undecodable]
    ) -> None:
        """Keep the open gaps of this run's keys current, and report the given-up ones."""
        done = set(keys)
        for slot in [slot for slot in self.open_gaps if slot[0] in done]:
            del self.open_gaps[slot]
        queue_of = {
            (items[i].key, items[i].producer): items[i].delivery.queue for i in plan.waiting
        }
        for gap in plan.open_gaps:
            self.open_gaps[(gap.key, gap.producer)] = (gap, queue_of[(gap.key, gap.producer)])
        for gap in plan.skipped_gaps:
            self.stats.gaps_skipped += 1
            log.warning(
                "gave up waiting for seq %d..%d of producer %s on key %r after %.0f ms: "
                "applying what follows (a late arrival will be dead-lettered)",
                gap.first,
                gap.last,
                gap.producer,
                gap.key,
                self._settings.sequence_gap_timeout_ms,
            )

    def _leases(self, deliveries: Sequence[Delivery]) -> dict[str, Lease]:
        leases: dict[str, Lease] = {}
        lost: set[str] = set()
        for delivery in deliveries:
            if delivery.queue in leases or delivery.queue in lost:
                continue
            lease = self._holdings.lease_for(delivery.queue, delivery.channel_epoch)
            if lease is None:
                lost.add(delivery.queue)
            else:
                leases[delivery.queue] = lease
        if lost:
            raise _Stale(frozenset(lost))
        self._last_leases.update(leases)
        return leases

    def _fallback_keys(self, deliveries: Sequence[Delivery]) -> Mapping[str, str | None]:
        """The key each queue of ``deliveries`` was declared for, asked for all at once: a
        worker that has just taken over a thousand queues must not make a thousand round
        trips before its first batch."""
        return self._keys_of_queues({delivery.queue for delivery in deliveries})

    def _run_pipeline(
        self,
        batch_id: str,
        events: list[Event],
        keys: list[str],
        leases: dict[str, Lease],
        attempt: int,
    ) -> tuple[dict[str, str], Any]:
        state = KeyedState(self._store, keys, self._settings.spark_shuffle_partitions)
        try:
            frame = self._engine.dataframe(batch_table(self._stream, events))
            context = BatchContext(
                batch_id=batch_id,
                worker_id=self._worker_id,
                stream=self._stream,
                spark=self._engine.session,
                state=state,
                queues=list(leases),
                attempt=attempt,
            )
            output = self._pipeline(frame, context)
            folded = state.folded.toArrow() if state.folded is not None else None
            if output is None or self._sink is None:
                table = None
            elif output is state.folded:
                table = folded
            else:
                table = output.toArrow()
        except KeyqError as exc:
            if isinstance(exc, PipelineError):
                raise
            raise PipelineError(str(exc)) from exc
        except Exception as exc:
            if spark_unavailable(exc):
                raise SparkUnavailable(f"Spark is unavailable: {describe_failure(exc)}") from exc
            if "No module named" in str(exc):
                # Code missing where Spark runs Python: the deployment's fault, not the events'.
                raise SparkUnavailable(
                    f"Spark cannot import the pipeline's code: {describe_failure(exc)}"
                ) from exc
            named = failing_event(str(exc))
            if named is not None:
                raise _EventFailed(describe_failure(exc), named) from exc
            raise PipelineError(describe_failure(exc)) from exc
        states: dict[str, str] = {}
        if folded is not None:
            columns = folded.to_pydict()
            states = dict(zip(columns["key"], columns["state"], strict=True))
        return states, table

    def _ack(self, deliveries: Sequence[Delivery]) -> None:
        """Settle ``deliveries``; the link acks each channel's contiguous run in one
        ``ack(multiple)`` and anything past a waiting delivery one by one."""
        tags: dict[tuple[str, int], list[int]] = {}
        for delivery in deliveries:
            tags.setdefault((delivery.queue, delivery.channel_epoch), []).append(
                delivery.delivery_tag
            )
            self._settled.add((delivery.queue, delivery.channel_epoch, delivery.delivery_tag))
        self._link.ack([(queue, epoch, found) for (queue, epoch), found in tags.items()])


class _Stale(Exception):
    """Deliveries of a consumer that is gone (its channel closed, so the broker has them
    back): hand the batch back, the worker drops those and keeps the rest."""


class _Interrupted(Exception):
    """Shutdown came during a retry's backoff: stop and hand the batch back."""


def _late(item: Event | Undecodable) -> Undecodable:
    """An event that came after the worker gave up waiting for it: applying it now would
    break its key's order, and it is not a duplicate, so it is dead-lettered."""
    return Undecodable(
        item.delivery,
        f"late: seq {item.seq} of producer {item.producer} arrived after the worker gave up "
        "waiting for it (its successors were applied)",
        item.key,
        item.producer,
        item.seq,
    )


def _arrival_order(
    deliveries: Sequence[Delivery], events: Sequence[Event], letters: Sequence[Undecodable]
) -> list[Event | Undecodable]:
    by_delivery: dict[int, Event | Undecodable] = {id(e.delivery): e for e in events}
    by_delivery.update({id(u.delivery): u for u in letters})
    return [by_delivery[id(d)] for d in deliveries]
