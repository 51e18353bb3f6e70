"""One attempt at a group of deliveries: read what admission needs, admit each delivery
(``keyq.worker.batch.admission``), carry out the effects (``keyq.worker.batch.effects``), then
keep the open gaps and the stats current."""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence

from keyq.broker.clock import now_ms
from keyq.broker.errors import KeysStopped
from keyq.broker.key_control import KeyControl
from keyq.broker.locks import Lease
from keyq.broker.naming import is_aside_queue
from keyq.broker.registry import QueueRegistry
from keyq.broker.routes import Route
from keyq.broker.stream_policy import StreamPolicy
from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.batch.admission import Admission, Reads, admit
from keyq.worker.batch.decoding import Decoder, Event, decoder_for
from keyq.worker.batch.dedupe_ids import DedupeIds
from keyq.worker.batch.effects import BatchEffects, Computed
from keyq.worker.batch.failures import Stale
from keyq.worker.batch.key_gate import Routing
from keyq.worker.batch.outcome import BatchProgress
from keyq.worker.batch.plan import RunPlan
from keyq.worker.batch.ports import KeyDirectory, LeaseLookup
from keyq.worker.batch.rate_limits import KeyRateLimiter
from keyq.worker.batch.routing import AutoRouting
from keyq.worker.batch.sequencing import Gap
from keyq.worker.batch.spans import BatchSpans
from keyq.worker.batch.state_store import StateStore
from keyq.worker.batch.stats import BatchStats, StageClock

log = logging.getLogger("keyq.worker.batch")


class BatchAttempt:
    """Runs attempts for one worker; used only by the batch loop's thread."""

    def __init__(
        self,
        *,
        worker_id: str,
        stream: str,
        effects: BatchEffects,
        spans: BatchSpans,
        store: StateStore,
        registry: QueueRegistry,
        holdings: LeaseLookup,
        keys: KeyDirectory,
        control: KeyControl,
        policy: Callable[[], StreamPolicy],
        gap_timeout_ms: int,
        stats: BatchStats,
        routing: AutoRouting | None = None,
    ) -> None:
        self._worker_id = worker_id
        self._stream = stream
        self._effects = effects
        self._spans = spans
        self._store = store
        self._registry = registry
        self._holdings = holdings
        self._keys = keys
        self._control = control
        self._policy = policy
        self._dedupe = DedupeIds(store.client, stream)
        self._limiter: KeyRateLimiter | None = None
        self._gap_timeout_ms = gap_timeout_ms
        self._stats = stats
        self._routing = routing
        self._batch_numbers = itertools.count(1)
        self._admissions = itertools.count(1)
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
        What each delivery came to and the leases used are noted in ``progress``. Raises
        ``KeysStopped`` (nothing settled) when the stream is paused, or a key was paused
        while its rerun ran too: the batch waits and goes back."""
        clock = StageClock()
        leases = self._leases(deliveries, progress)
        policy = self._policy()
        if policy.paused:
            raise KeysStopped("the stream is paused: its queues are being handed back")
        admission, routes = self._admit(deliveries, leases, policy, dead)
        progress.admitted(admission)
        if not admission.settling:
            self._note_gaps(admission.run)
            return  # everything here waits: nothing to commit or ack
        clock.lap()  # decode
        batch_id = f"{self._worker_id}-{next(self._batch_numbers)}"
        with self._spans.batch(batch_id, [event.delivery for event in admission.events]):
            try:
                computed = self._effects.run(
                    batch_id,
                    admission=admission,
                    leases=leases,
                    attempt=attempt,
                    progress=progress,
                    clock=clock,
                    forward=self._forwarder(routes),
                )
            except KeysStopped:
                if rerun:
                    raise
                # Paused while it ran: once more, and admission sets those events aside.
                log.info("a key of batch %s was paused while it ran: running it again", batch_id)
                self.run(deliveries, attempt, dead, progress, rerun=True)
                return
        self._note_gaps(admission.run, moved=admission.forward.keys())
        self._touch(leases)
        clock.lap()  # touch
        self._note_committed(admission, computed, clock)

    def _admit(
        self,
        deliveries: list[Delivery],
        leases: Mapping[str, Lease],
        policy: StreamPolicy,
        dead: str | None,
    ) -> tuple[Admission, dict[str, Route]]:
        """Each delivery's disposition, from what is read for it now; in auto mode, routed
        first (``keyq.worker.batch.routing``), with the routes of the keys it forwards."""
        # The queues' declared keys are asked for all at once: a worker that has just taken
        # over a thousand queues must not make a thousand round trips before its first batch.
        decoded = decoder_for(self._keys.keys_of({delivery.queue for delivery in deliveries}))
        reads = self._read(deliveries, decoded, policy)
        routing: Routing | None = None
        routes: dict[str, Route] = {}
        if self._routing is not None:
            routing, routes = self._routing.prepare(deliveries, decoded, reads.statuses, leases)
        admission = admit(
            deliveries,
            decoded,
            reads,
            keys=self._dedupe.keys,
            # Asked up to three times a delivery, of a few queues: answered once per queue.
            is_aside_queue=functools.cache(functools.partial(is_aside_queue, self._stream)),
            limiter=self._limiter_for(policy.rate_limit),
            gap_timeout_s=self._gap_timeout_ms / 1000,
            dead=dead,
            routing=routing,
        )
        if self._routing is not None:
            self._routing.observe(admission, decoded)
        return admission, routes

    def _forwarder(
        self, routes: Mapping[str, Route]
    ) -> Callable[[Mapping[str, list[Delivery]]], None] | None:
        routing = self._routing
        if routing is None:
            return None
        return lambda forward: routing.forward(forward, routes)

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

    def _read(
        self, deliveries: Sequence[Delivery], decoded: Decoder, policy: StreamPolicy
    ) -> Reads:
        """What admission needs, read fresh for the keys the deliveries decode to: their
        status, their marks and the dedupe ids applied (a round trip each)."""
        items = [decoded(delivery) for delivery in deliveries]
        keys = list(dict.fromkeys(item.key for item in items if item.key is not None))
        events = [item for item in items if isinstance(item, Event)]
        return Reads(
            policy=policy,
            statuses=self._control.statuses(set(keys)),  # a dict: routing promotes in it
            marks=self._store.marks(keys),
            dedupe=self._dedupe.applied(events, policy.dedupe_window_s),
            now_ms=now_ms(),
            now_s=time.monotonic(),
        )

    def _limiter_for(self, rate: float | None) -> KeyRateLimiter | None:
        """The token buckets for ``rate`` (kept across batches; new when the rate changes)."""
        if rate is None:
            self._limiter = None
        elif self._limiter is None or self._limiter.rate != rate:
            self._limiter = KeyRateLimiter(rate)
        elif next(self._admissions) % 1000 == 0:
            self._limiter.forget_full()
        return self._limiter

    def _note_gaps(self, run: RunPlan, moved: Collection[str] = ()) -> None:
        """Keep the open gaps of this run's keys current, and report the given-up ones; the
        gaps of keys ``moved`` to queues of their own are no longer this worker's."""
        done = set(run.keys) | set(moved)
        for slot in [slot for slot in self.open_gaps if slot[0] in done]:
            del self.open_gaps[slot]
        items = run.ordered
        queue_of = {
            (items[i].key, items[i].producer): items[i].delivery.queue for i in run.plan.deferred
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

    def _note_committed(self, admission: Admission, computed: Computed, clock: StageClock) -> None:
        run = admission.run
        self._stats.note_committed(
            events=len(admission.events),
            skipped=len(run.plan.duplicates) + len(admission.deduped.skipped),
            dead_lettered=len(run.letters),
            late=len(run.plan.late),
            spark_seconds=computed.spark_seconds,
            clock=clock,
            published_at_ms=[event.published_at_ms for event in admission.events],
            applied_from=Counter(event.delivery.queue for event in admission.events),
        )
        for letter in run.letters:
            log.warning("dead-lettered a message of %s: %s", letter.delivery.queue, letter.reason)
