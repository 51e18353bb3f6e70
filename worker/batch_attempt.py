"""One attempt at a group of deliveries, stage by stage: decode and order them, run the
pipeline and stage its output, dead-letter and commit fenced by the queues' locks, ack,
then keep the open gaps and the stats current.

Nothing is acked before the commit, and nothing is committed under a lock that moved on;
a dead letter is safe in its queue before the marks move past it, and so is a copy of an
event set aside for its key (``keyq.worker.key_gate``) before the event is acked."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import pika

from keyq.broker.clock import now_ms
from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.broker.dead_letter_queue import letters_of
from keyq.broker.errors import CommitRefused, KeysStopped
from keyq.broker.key_control import KeyControl, ParkedKey
from keyq.broker.locks import Lease
from keyq.broker.naming import aside_queue_name, is_side_queue
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.registry import QueueRegistry
from keyq.broker.stream_policy import StreamPolicy
from keyq.worker.batch_failures import Stale
from keyq.worker.batch_outcome import BatchProgress
from keyq.worker.batch_plan import RunPlan, plan_run
from keyq.worker.batch_spans import BatchSpans
from keyq.worker.batch_stats import BatchStats, StageClock
from keyq.worker.consumer import ConsumerLink, DeadLetter
from keyq.worker.decoding import Decoder, Undecodable, decoder_for
from keyq.worker.dedupe_ids import DedupeIds
from keyq.worker.deliveries import Delivery
from keyq.worker.fenced_commit import FencedCommit
from keyq.worker.key_gate import GateSorting, limit_rates, sort_by_key_status
from keyq.worker.pipeline_job import PipelineJob
from keyq.worker.rate_limits import KeyRateLimiter
from keyq.worker.sequencing import Gap
from keyq.worker.state_store import StateStore

log = logging.getLogger("keyq.worker.batch")


class LeaseLookup(Protocol):
    """The worker's held queues, as a batch sees them."""

    def lease_for(self, queue: str, epoch: int) -> Lease | None:
        """The lease a delivery of consumer ``epoch`` may be committed under, if any."""


@dataclass(frozen=True)
class _Computed:
    """What the pipeline made of a run's events."""

    states: dict[str, str]
    staged: str | None  # the output, staged in the sink until the commit
    spark_seconds: float


class BatchAttempt:
    """Runs attempts for one worker; used only by the batch loop's thread."""

    def __init__(
        self,
        *,
        worker_id: str,
        job: PipelineJob,
        output: FencedCommit,
        store: StateStore,
        registry: QueueRegistry,
        link: ConsumerLink,
        holdings: LeaseLookup,
        keys_of_queues: Callable[[Collection[str]], Mapping[str, str | None]],
        gap_timeout_ms: int,
        stats: BatchStats,
        stream: str,
        control: KeyControl,
        policy: Callable[[], StreamPolicy],
    ) -> None:
        self._worker_id = worker_id
        self._stream = stream
        self._stream_keys = StreamKeys(stream)
        self._limiter: KeyRateLimiter | None = None
        self._batch_numbers_seen = itertools.count(1)
        self._control = control
        self._policy = policy
        self._dedupe = DedupeIds(store.client, stream)
        self._dead_letter_index: DeadLetterIndex | None = None  # made on first dead letter
        self._spans = BatchSpans(stream)
        self._job = job
        self._output = output
        self._store = store
        self._registry = registry
        self._link = link
        self._holdings = holdings
        self._keys_of_queues = keys_of_queues
        self._gap_timeout_ms = gap_timeout_ms
        self._stats = stats
        self._batch_numbers = itertools.count(1)
        # Sequence gaps still open, per (key, producer), with the queue their events wait in.
        self.open_gaps: dict[tuple[str, str], tuple[Gap, str]] = {}

    def run(
        self,
        deliveries: list[Delivery],
        attempt: int,
        dead: str | None,
        progress: BatchProgress,
        *,
        rerun: bool = False,
    ) -> None:
        """Run ``deliveries`` once; with ``dead``, dead-letter their events with that reason.
        What it settles, the leases it uses and what waits are noted in ``progress``. Raises
        ``KeysStopped`` (nothing settled) when the stream is paused, or a key was paused
        while its rerun ran too: the batch waits and goes back."""
        clock = StageClock()
        leases = self._leases(deliveries, progress)
        policy = self._policy()
        if policy.paused:
            raise KeysStopped("the stream is paused: its queues are being handed back")
        park = policy.poison_policy == "park"
        # The queues' declared keys are asked for all at once: a worker that has just taken
        # over a thousand queues must not make a thousand round trips before its first batch.
        decoded = decoder_for(self._keys_of_queues({delivery.queue for delivery in deliveries}))
        gate = self._gate(deliveries, decoded, park)
        progress.held.extend(gate.held)
        limiter = self._limiter_for(policy.rate_limit)
        if limiter is not None:
            limit_rates(gate, limiter)
            progress.limited.extend(gate.limited)
            if gate.limited:
                keys = {key for d in gate.limited if (key := decoded(d).key) is not None}
                due = [limiter.due_in(key) for key in keys]
                progress.retry_limited_in = min(due, default=0.05)
        run = self._plan(gate.through, decoded, dead)
        deduped = self._dedupe.take_out_repeats(run.events, policy.dedupe_window_s)
        if deduped.skipped:
            run = dataclasses.replace(run, events=deduped.events, deduped=deduped.skipped)
        settling = [*run.settling, *gate.set_aside]
        if not settling:
            self._note_gaps(run)
            progress.waiting.extend(run.waiting)
            return  # everything here waits for an earlier seq: nothing to commit or ack
        clock.lap()  # decode
        batch_id = f"{self._worker_id}-{next(self._batch_numbers)}"
        with self._spans.batch(batch_id, [event.delivery for event in run.events]):
            with self._spans.stage("spark"):
                computed = self._compute(batch_id, run, leases, attempt)
            clock.lap()  # spark
            if park:  # first: a crash after it sends the poison's redelivery aside too
                self._park(gate, run, dead)
            self._set_aside(gate, leases)
            self._dead_letter(run.letters, attempt)
            try:
                with self._spans.stage("commit"):
                    self._output.commit(
                        batch_id,
                        leases,
                        run.plan.marks,
                        computed.states,
                        computed.staged,
                        guards=self._guards(run),
                        extra=deduped.writes,
                        expiries=deduped.expiries,
                    )
            except KeysStopped:
                if rerun:
                    raise
                # Paused while it ran: once more, and the gate sets those events aside.
                log.info("a key of batch %s was paused while it ran: running it again", batch_id)
                self.run(deliveries, attempt, dead, progress, rerun=True)
                return
            clock.lap()  # commit
            with self._spans.stage("ack"):
                self._ack(settling, progress)
            clock.lap()  # ack
        progress.waiting.extend(run.waiting)
        self._note_gaps(run)
        self._touch(leases)
        clock.lap()  # touch
        self._note_committed(run, computed, clock)

    # ---- the stages, in order ----------------------------------------------------------------

    def _leases(self, deliveries: Sequence[Delivery], progress: BatchProgress) -> dict[str, Lease]:
        """The lease of each queue, for its consumer's epoch; raises ``Stale`` if any is
        gone (its deliveries are the broker's again)."""
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
            raise Stale(frozenset(lost))
        progress.leases.update(leases)
        return leases

    def _gate(self, deliveries: Sequence[Delivery], decoded: Decoder, park: bool) -> GateSorting:
        """Sort the run by what holds its keys back, read fresh (one round trip) for the
        keys its deliveries decode to."""
        keys = {key for d in deliveries if (key := decoded(d).key) is not None}
        return sort_by_key_status(
            deliveries,
            decoded,
            self._control.statuses(keys),
            is_side_queue=lambda queue: is_side_queue(self._stream, queue),
            park_at_poison=park,
            now_ms=now_ms(),
        )

    def _limiter_for(self, rate: float | None) -> KeyRateLimiter | None:
        """The token buckets for ``rate`` (kept across batches; new when the rate changes)."""
        if rate is None:
            self._limiter = None
        elif self._limiter is None or self._limiter.rate != rate:
            self._limiter = KeyRateLimiter(rate)
        elif next(self._batch_numbers_seen) % 1000 == 0:
            self._limiter.forget_full()
        return self._limiter

    def _guards(self, run: RunPlan) -> list[tuple[str, str]]:
        """What must not have been paused meanwhile for the commit to stand: the keys it
        applies events of, and the stream."""
        applied = {event.key for event in run.events}
        guards = [(self._stream_keys.paused_keys, key) for key in sorted(applied)]
        if applied:
            guards.append((self._stream_keys.policy, "paused"))
        return guards

    def _set_aside(self, gate: GateSorting, leases: Mapping[str, Lease]) -> None:
        """Copy each stopped key's events to the tail of its aside queues, confirmed, before
        they are acked (a key with none yet gets one, registered before it is declared)."""
        for key, deliveries in gate.aside.items():
            lease = leases[deliveries[0].queue]
            queues = self._control.set_aside_tail(
                key, lease, aside_queue_name(self._stream, key, uuid.uuid4().hex[:12])
            )
            if queues is None:
                raise CommitRefused(
                    f"setting events of {key!r} aside: lost {lease.queue}",
                    frozenset({lease.queue}),
                )
            self._link.set_aside(queues[-1], key, deliveries)
            log.info("set %d events of key %r aside in %s", len(deliveries), key, queues[-1])

    def _park(self, gate: GateSorting, run: RunPlan, dead: str | None) -> None:
        """Under the ``park`` policy, stop each key at its poison event, before the commit
        moves its marks past it: a redelivery of the poison then goes aside, and a redrive of
        its dead letter still applies it (``KeyMarks.redrive``)."""
        parking = dict(gate.parking)
        if dead is not None:
            for letter in run.letters:
                if letter.key is not None and letter.key not in parking:
                    parking[letter.key] = ParkedKey(
                        at_ms=now_ms(), reason=dead, producer=letter.producer, seq=letter.seq
                    )
        for key, where in parking.items():
            if self._control.park(key, where):
                log.warning("parked key %r at a poison event: %s", key, where.reason)

    def _plan(self, deliveries: Sequence[Delivery], decoded: Decoder, dead: str | None) -> RunPlan:
        return plan_run(
            deliveries,
            decoded,
            self._store.marks,
            now=time.monotonic,
            gap_timeout_s=self._gap_timeout_ms / 1000,
            dead=dead,
        )

    def _compute(
        self, batch_id: str, run: RunPlan, leases: dict[str, Lease], attempt: int
    ) -> _Computed:
        if not run.events:
            return _Computed({}, None, 0.0)
        started = time.monotonic()
        states, output = self._job.run(batch_id, run.events, run.keys, list(leases), attempt)
        spark_seconds = time.monotonic() - started
        return _Computed(states, self._output.stage(batch_id, output), spark_seconds)

    def _dead_letter(self, letters: Sequence[Undecodable], attempt: int) -> None:
        # Before the commit: once the marks move past a dead event, a redelivery would skip
        # it, so its copy must be safe in the dead-letter queue first; and indexed in the same
        # step, before the original is acked, so the index never lags a letter for long.
        if letters:
            copies = self._link.dead_letter(
                [DeadLetter(letter.delivery, letter.reason, attempt) for letter in letters]
            )
            self._index_dead_letters(copies)

    def _index_dead_letters(self, copies: Sequence[tuple[bytes, pika.BasicProperties]]) -> None:
        if not copies:
            return
        if self._dead_letter_index is None:
            self._dead_letter_index = DeadLetterIndex(self._store.client, self._stream)
        self._dead_letter_index.add(
            [found for body, properties in copies for found in letters_of(0, 0, body, properties)]
        )

    def _ack(self, deliveries: Sequence[Delivery], progress: BatchProgress) -> None:
        """Settle ``deliveries``, each a (tag, part) of its consumer: the link acks the
        messages settled whole (a pack once all its events are), each channel's contiguous
        run in one ``ack(multiple)`` and anything past a waiting delivery one by one."""
        events: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for delivery in deliveries:
            events.setdefault((delivery.queue, delivery.channel_epoch), []).append(
                (delivery.delivery_tag, delivery.part)
            )
        progress.settle(deliveries)
        self._link.ack([(queue, epoch, found) for (queue, epoch), found in events.items()])

    def _note_gaps(self, run: RunPlan) -> None:
        """Keep the open gaps of this run's keys current, and report the given-up ones."""
        done = set(run.keys)
        for slot in [slot for slot in self.open_gaps if slot[0] in done]:
            del self.open_gaps[slot]
        items = run.ordered
        queue_of = {
            (items[i].key, items[i].producer): items[i].delivery.queue for i in run.plan.waiting
        }
        for gap in run.plan.open_gaps:
            self.open_gaps[(gap.key, gap.producer)] = (gap, queue_of[(gap.key, gap.producer)])
        for gap in run.plan.skipped_gaps:
            self._stats.gaps_skipped += 1
            log.warning(
                "gave up waiting for seq %d..%d of producer %s on key %r after %.0f ms: "
                "applying what follows (a late arrival will be dead-lettered)",
                gap.first,
                gap.last,
                gap.producer,
                gap.key,
                self._gap_timeout_ms,
            )

    def _touch(self, leases: Mapping[str, Lease]) -> None:
        try:
            self._registry.touch(leases)
        except Exception:
            log.debug("registry touch failed", exc_info=True)

    def _note_committed(self, run: RunPlan, computed: _Computed, clock: StageClock) -> None:
        self._stats.note_committed(
            events=len(run.events),
            skipped=run.skipped,
            dead_lettered=len(run.letters),
            late=len(run.plan.late),
            spark_seconds=computed.spark_seconds,
            clock=clock,
            published_at_ms=[event.published_at_ms for event in run.events],
        )
        for letter in run.letters:
            log.warning("dead-lettered a message of %s: %s", letter.delivery.queue, letter.reason)
