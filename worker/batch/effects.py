"""The effects of an admitted attempt, in the one order that keeps the guarantees:
compute → park → set aside → forward → dead letters → fenced commit → ack.

Nothing is acked before the commit, and nothing is committed under a lock that moved on. A
key is parked before the commit moves its marks past its poison event, so a crash after it
sends the poison's redelivery aside too. A copy set aside, forwarded or dead-lettered is
confirmed in its queue before the commit, so a redelivery that the moved marks would skip is
never the only copy."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pika

from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.broker.dead_letter_queue import letters_of
from keyq.broker.errors import CommitRefused
from keyq.broker.key_control import KeyControl
from keyq.broker.locks import Lease
from keyq.broker.naming import aside_queue_name
from keyq.broker.redis_keys import StreamKeys
from keyq.worker.amqp.dead_letters import DeadLetter
from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.batch.admission import Admission
from keyq.worker.batch.fenced_commit import FencedCommit
from keyq.worker.batch.outcome import BatchProgress
from keyq.worker.batch.ports import Acker, DeadLetterSink
from keyq.worker.batch.spans import BatchSpans
from keyq.worker.batch.state_store import StateStore
from keyq.worker.batch.stats import StageClock
from keyq.worker.spark.job import PipelineJob

log = logging.getLogger("keyq.worker.batch")


@dataclass(frozen=True)
class Computed:
    """What the pipeline made of an attempt's events."""

    states: dict[str, str]
    staged: str | None  # the output, staged in the sink until the commit
    spark_seconds: float


class BatchEffects:
    """Carries out admissions for one worker; used only by the batch loop's thread."""

    def __init__(  # noqa: PLR0917 - the parts it drives, in the order they act
        self,
        stream: str,
        job: PipelineJob,
        output: FencedCommit,
        store: StateStore,
        control: KeyControl,
        acker: Acker,
        dead_letters: DeadLetterSink,
        spans: BatchSpans,
    ) -> None:
        self._stream = stream
        self._stream_keys = StreamKeys(stream)
        self._job = job
        self._output = output
        self._store = store
        self._control = control
        self._acker = acker
        self._dead_letters = dead_letters
        self._spans = spans
        self._dead_letter_index: DeadLetterIndex | None = None  # made on first dead letter

    def run(
        self,
        batch_id: str,
        *,
        admission: Admission,
        leases: dict[str, Lease],
        attempt: int,
        progress: BatchProgress,
        clock: StageClock,
        forward: Callable[[Mapping[str, list[Delivery]]], None] | None = None,
    ) -> Computed:
        """Every effect of ``admission``, in order; raises before the ack when one fails
        (``PipelineError``, ``CommitRefused``, ``KeysStopped``, a service down). What the
        commit settled is noted in ``progress`` before the ack, which may still fail."""
        with self._spans.stage("spark"):
            computed = self._compute(batch_id, admission, leases, attempt)
        clock.lap()  # spark
        for key, where in admission.parking.items():
            if self._control.park(key, where):
                log.warning("parked key %r at a poison event: %s", key, where.reason)
        self._set_aside(admission.aside, leases)
        if admission.forward:
            assert forward is not None  # only auto mode forwards (``keyq.worker.batch.routing``)
            forward(admission.forward)
        self._dead_letter(admission, attempt)
        with self._spans.stage("commit"):
            self._output.commit(
                batch_id,
                leases,
                admission.run.plan.marks,
                computed.states,
                computed.staged,
                guards=self._guards(admission),
                extra=admission.deduped.writes,
                expiries=admission.deduped.expiries,
            )
        clock.lap()  # commit: with the park, the copies aside and the dead letters before it
        settling = admission.settling
        progress.settle(settling)
        with self._spans.stage("ack"):
            self._ack(settling)
        clock.lap()  # ack
        return computed

    def _compute(
        self, batch_id: str, admission: Admission, leases: dict[str, Lease], attempt: int
    ) -> Computed:
        events = admission.events
        if not events:
            return Computed({}, None, 0.0)
        started = time.monotonic()
        states, output = self._job.run(batch_id, events, admission.run.keys, list(leases), attempt)
        spark_seconds = time.monotonic() - started
        return Computed(states, self._output.stage(batch_id, output), spark_seconds)

    def _set_aside(self, aside: Mapping[str, list[Delivery]], leases: Mapping[str, Lease]) -> None:
        """Copy each stopped key's events to the tail of its aside queues, confirmed (a key
        with none yet gets one, registered before it is declared)."""
        for key, deliveries in aside.items():
            lease = leases[deliveries[0].queue]
            queues = self._control.set_aside_tail(
                key, lease, aside_queue_name(self._stream, key, uuid.uuid4().hex[:12])
            )
            if queues is None:
                raise CommitRefused(
                    f"setting events of {key!r} aside: lost {lease.queue}",
                    frozenset({lease.queue}),
                )
            self._dead_letters.set_aside(queues[-1], key, deliveries)
            log.info("set %d events of key %r aside in %s", len(deliveries), key, queues[-1])

    def _dead_letter(self, admission: Admission, attempt: int) -> None:
        """Copies confirmed in the dead-letter queue and indexed in the same step, before the
        originals are acked, so the index never lags a letter for long."""
        letters = admission.run.letters
        if not letters:
            return
        copies = self._dead_letters.dead_letter(
            [DeadLetter(letter.delivery, letter.reason, attempt) for letter in letters]
        )
        self._index(copies)

    def _index(self, copies: Sequence[tuple[bytes, pika.BasicProperties]]) -> None:
        if not copies:
            return
        if self._dead_letter_index is None:
            self._dead_letter_index = DeadLetterIndex(self._store.client, self._stream)
        self._dead_letter_index.add(
            [found for body, properties in copies for found in letters_of(0, 0, body, properties)]
        )

    def _guards(self, admission: Admission) -> list[tuple[str, str]]:
        """What must not have been paused meanwhile for the commit to stand: the keys it
        applies events of, and the stream."""
        applied = {event.key for event in admission.events}
        guards = [(self._stream_keys.paused_keys, key) for key in sorted(applied)]
        if applied:
            guards.append((self._stream_keys.policy, "paused"))
        return guards

    def _ack(self, deliveries: Sequence[Delivery]) -> None:
        """Settle ``deliveries``, each a (tag, part) of its consumer: the acker acks the
        messages settled whole (a pack once all its events are), each channel's contiguous
        run in one ``ack(multiple)`` and anything past a deferred delivery one by one."""
        events: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for delivery in deliveries:
            events.setdefault((delivery.queue, delivery.channel_epoch), []).append(
                (delivery.delivery_tag, delivery.part)
            )
        self._acker.ack([(queue, epoch, found) for (queue, epoch), found in events.items()])
