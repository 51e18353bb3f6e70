"""A batch whose pipeline fails is retried with backoff; if it keeps failing, it is split
(by queue, then in halves, in order) until the one event that fails is found and
dead-lettered with the reason, and everything else is processed. So a poison event costs a
few extra Spark jobs, never a loop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol

from keyq.broker.backoff import Backoff
from keyq.broker.errors import PipelineError
from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.batch.decoding import Event, decode
from keyq.worker.batch.failures import EventFailed, Interrupted, describe_failure
from keyq.worker.batch.ports import KeyDirectory
from keyq.worker.batch.stats import BatchStats

log = logging.getLogger("keyq.worker.batch")

MAX_RETRY_DELAY_S = 10.0
MIN_RETRY_DELAY_S = 0.001  # a retry_backoff_ms of 0 still yields the CPU


class Attempt(Protocol):
    """Runs deliveries once (``keyq.worker.batch.attempt``); with ``dead``, dead-letters
    their events with that reason. Raises ``PipelineError`` when the pipeline fails."""

    def __call__(self, deliveries: list[Delivery], attempt: int, dead: str | None = None) -> None:
        """Run ``deliveries`` as attempt number ``attempt``."""


class Isolation:
    """Retries and isolation for one worker; used only by the batch loop's thread."""

    def __init__(
        self,
        *,
        attempt: Attempt,
        max_attempts: int,
        retry_backoff_ms: int,
        stats: BatchStats,
        stopping: threading.Event,
        keys: KeyDirectory,
    ) -> None:
        self._run = attempt
        self._max_attempts = max_attempts
        self._retry_backoff_ms = retry_backoff_ms
        self._stats = stats
        self._stopping = stopping
        self._keys = keys

    def process(self, deliveries: list[Delivery]) -> None:
        """Run ``deliveries``, retrying, then isolating what fails. Raises ``Interrupted``
        if shutdown comes during a backoff."""
        failure: PipelineError | None = None
        backoff = self._backoff()
        for attempt in range(1, self._max_attempts + 1):
            try:
                self._run(deliveries, attempt)
                return
            except PipelineError as exc:
                failure = exc
                self._stats.pipeline_failures += 1
                log.warning("batch failed (attempt %d): %s", attempt, describe_failure(exc))
                if attempt < self._max_attempts:
                    self._wait(backoff)
        assert failure is not None
        if len(deliveries) == 1:
            self._run(deliveries, self._max_attempts, dead=describe_failure(failure))
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
            (queue for queue, group in by_queue.items() if self._named(failure, group) is not None),
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
            self._stats.pipeline_failures += 1
            self._isolate_queues(rest, exc)

    def _isolate(self, group: list[Delivery], known: PipelineError | None = None) -> None:
        """Process one queue's deliveries, in order, dead-lettering only what fails: around
        the event a failure names when it names one here, else by halves."""
        failure = known
        if failure is not None and self._named(failure, group) is None:
            failure = None  # it was about other events: see how this group fares alone
        if failure is None:
            try:
                self._run(group, 1)
                return
            except PipelineError as exc:
                self._stats.pipeline_failures += 1
                failure = exc
        index = self._named(failure, group)
        if index is not None:
            self._isolate_around(group, index, failure)
        elif len(group) == 1:
            self._isolate_one(group[0], failure)
        else:
            middle = len(group) // 2
            self._isolate(group[:middle])
            self._isolate(group[middle:])

    def _isolate_around(self, group: list[Delivery], index: int, failure: PipelineError) -> None:
        """The named event on its own; what comes before and after it, as they fare."""
        before, named, after = group[:index], group[index], group[index + 1 :]
        if before:
            self._isolate(before)
        self._isolate_one(named, failure)
        if after:
            self._isolate(after)

    def _isolate_one(self, delivery: Delivery, failure: PipelineError) -> None:
        """One event that failed: retried with backoff, then dead-lettered with its reason."""
        group = [delivery]
        backoff = self._backoff()
        for attempt in range(2, self._max_attempts + 1):
            self._wait(backoff)
            try:
                self._run(group, attempt)
                return
            except PipelineError as exc:
                self._stats.pipeline_failures += 1
                failure = exc
        self._run(group, self._max_attempts, dead=describe_failure(failure))

    def _named(self, failure: PipelineError, group: Sequence[Delivery]) -> int | None:
        """Where in ``group`` the event named by ``failure`` is, if it names one there."""
        if not isinstance(failure, EventFailed):
            return None
        fallback = self._keys.keys_of({delivery.queue for delivery in group})
        return named_event(failure.event, group, fallback)

    def _backoff(self) -> Backoff:
        """Delays between a failing batch's retries: from ``retry_backoff_ms``, doubling,
        at most ``MAX_RETRY_DELAY_S``."""
        initial = min(max(self._retry_backoff_ms / 1000, MIN_RETRY_DELAY_S), MAX_RETRY_DELAY_S)
        return Backoff(initial, MAX_RETRY_DELAY_S)

    def _wait(self, backoff: Backoff) -> None:
        if self._stopping.wait(backoff.next()):
            raise Interrupted


def named_event(
    event: tuple[str, str, int],
    group: Sequence[Delivery],
    fallback_keys: Mapping[str, str | None],
) -> int | None:
    """The index in ``group`` of the delivery that decodes to ``event`` (key, producer,
    seq), if one does."""
    for index, delivery in enumerate(group):
        decoded = decode(delivery, fallback_keys[delivery.queue])
        if isinstance(decoded, Event) and (decoded.key, decoded.producer, decoded.seq) == event:
            return index
    return None
