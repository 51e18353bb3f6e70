"""The batch loop of a serving worker: take deliveries, process a batch and have the held
queues apply what it came to; between batches hand queues back, reopen consumers and give up
gaps.

A ``Session`` exists only while the worker serves, so every part it needs is there: the
AMQP link, the held queues, the claim loop, the batch processor and the gap watchers.
"""

from __future__ import annotations

import functools
import logging
import queue as queue_module
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from keyq.broker.connections import redis_errors
from keyq.broker.errors import KeyqError
from keyq.broker.producer_presence import ProducerPresence
from keyq.worker.amqp.deliveries import Delivery, DeliveryBuffer, oldest_published_ms
from keyq.worker.amqp.link import ConsumerLink, QueueCounter
from keyq.worker.amqp.starvation import StarvedQueues
from keyq.worker.auto_mode import OwnEventCost, is_own_queue
from keyq.worker.batch.processor import BatchProcessor
from keyq.worker.config import WorkerSettings
from keyq.worker.holding.abandoned_gaps import AbandonedGaps
from keyq.worker.holding.aside_drains import AsideDrains
from keyq.worker.holding.assembly import Holding
from keyq.worker.holding.claims import ClaimLoop
from keyq.worker.holding.handbacks import HandBacks
from keyq.worker.holding.held_queues import HeldQueues, QueueEvents
from keyq.worker.holding.prefetch_fit import PrefetchFit
from keyq.worker.holding.route_moves import RouteMoves
from keyq.worker.holding.stuck_gaps import StuckGaps

log = logging.getLogger("keyq.worker")

QueueCallback = Callable[[list[str]], None]
ERROR_BACKOFF_S = 1.0
BATCH_WAIT_SPARK_FACTOR = 2.0
BATCH_WAIT_MAX_S = 2.0
RATE_WAIT_MAX_S = 0.1  # a rate-limited key's wait never holds up other keys' events longer


def batch_wait(settings: WorkerSettings, last_batch_events: int, last_spark_s: float) -> float:
    """How long a batch may wait to fill, from its first event. Under light load (the last
    batch under half of ``batch_max_events``) only ``batch_max_ms``, 0 by default: a batch
    starts as soon as the previous job ends and events are ready, and the events that arrive
    during a job make the next batch. Under heavy load up to twice the last Spark job (at
    most 2 s): every job has a fixed cost, so a loaded worker runs fewer, larger jobs."""
    floor = settings.batch_max_ms / 1000
    if last_batch_events * 2 < settings.batch_max_events:
        return floor
    return min(max(floor, BATCH_WAIT_SPARK_FACTOR * last_spark_s), BATCH_WAIT_MAX_S)


def reopen_for_gap(
    stuck: StuckGaps, held: HeldQueues, starved: StarvedQueues, queue: str, look: bool = True
) -> None:
    """Reopen ``queue``'s consumer for a sequence gap, and note when (``StuckGaps``); with
    ``look`` (a quiet queue), what the closing gives back says whether the broker keeps
    messages from this node. A busy queue's ready messages may just have arrived."""
    stuck.note_reopened(queue)
    room = held.room_of(queue)
    closed = (lambda: starved.closed_for_gap(queue, room)) if look else None
    held.reopen(queue, closed=closed)


def gap_watchers(
    settings: WorkerSettings,
    buffer: DeliveryBuffer,
    presence: ProducerPresence,
    counts: QueueCounter,
    holding: Holding,
) -> tuple[StuckGaps, AbandonedGaps]:
    """What watches the sequence gaps of the held queues between batches."""
    held, starved = holding.held, holding.starved
    stuck = StuckGaps(buffer, settings.sequence_gap_timeout_ms / 1000)
    abandoned = AbandonedGaps(
        buffer,
        alive=presence.alive,
        ready_count=counts.message_count,
        room_of=held.room_of,
        confirm_gone_s=settings.producer_ttl_ms / 2000,
        reopened_at=stuck.reopened_at,
        reopen=functools.partial(reopen_for_gap, stuck, held, starved),
    )
    return stuck, abandoned


@dataclass
class Session:
    """What a serving worker runs with; used by the batch loop's thread (its parts say
    which of them other threads use)."""

    settings: WorkerSettings
    buffer: DeliveryBuffer
    link: ConsumerLink
    held: HeldQueues
    handbacks: HandBacks
    claims: ClaimLoop
    processor: BatchProcessor
    stuck: StuckGaps
    abandoned: AbandonedGaps
    events: QueueEvents
    stop: threading.Event
    drains: AsideDrains
    starved: StarvedQueues
    own_cost: OwnEventCost | None = None  # auto mode
    moves: RouteMoves | None = None  # auto mode
    on_assigned: QueueCallback | None = None
    on_revoked: QueueCallback | None = None
    # When the oldest event of the batch being processed was published (read by reports).
    in_batch_since_ms: int | None = None

    def __post_init__(self) -> None:
        events = self.settings.prefetch
        self.prefetch = PrefetchFit(
            events,
            self.settings.amqp_prefetch(events),
            self.settings.batch_max_events,
            self.settings.prefetch_widen_events,
            widens=self._widens,
        )

    def _widens(self, queue: str) -> bool:
        """In auto mode only a promoted key's own queue is widened, not a bucket
        (``keyq.worker.holding.prefetch_fit``)."""
        return self.own_cost is None or is_own_queue(self.own_cost.config, queue)

    def oldest_unprocessed_ms(self) -> int | None:
        """When the oldest event this worker holds and has not applied was published."""
        stamps = [self.in_batch_since_ms, self.buffer.oldest_published_ms()]
        return min((stamp for stamp in stamps if stamp is not None), default=None)

    def serve(self, until_idle: float | None, ready: threading.Event, started: str) -> None:
        """Run batches until stopped (or idle for ``until_idle`` seconds, if given)."""
        last_work = time.monotonic()
        while not self.stop.is_set():
            if self.link.failure is not None:
                raise self.link.failure
            if not ready.is_set() and self.claims.ready:
                ready.set()
                log.info(started)
            self.held.settle_gone()
            self.fire_events()
            self.hand_back(self.handbacks.take())
            self.give_up_abandoned_gaps()
            self.reopen_stuck_gaps()
            self.drain_aside()
            self.close_moves()
            self.prefetch.refit(self.held.room_of, self.buffer.deferred, self.held.reopen)
            stats = self.processor.stats
            wait = batch_wait(self.settings, stats.last_batch_events, stats.last_spark_seconds)
            batch = self.buffer.take(self.settings.batch_max_events, wait, 0.1)
            if batch:
                self.process(batch)
                last_work = time.monotonic()
            elif until_idle is not None and time.monotonic() - last_work >= until_idle:
                return

    def process(self, batch: list[Delivery]) -> None:
        """Process one batch and have the held queues apply its outcome; back off after a
        service failure, and wait for a token when every event was over its key's rate."""
        self.in_batch_since_ms = oldest_published_ms(batch)
        committed = None if self.own_cost is None else self.processor.stats.batches
        try:
            outcome = self.processor.process(batch)
        finally:
            self.in_batch_since_ms = None
        if outcome.interrupted is not None:
            self.stop.wait(ERROR_BACKOFF_S)
        self.held.apply(outcome)
        self.prefetch.observe(
            batch,
            self.held.room_of,
            self.buffer.ready_messages,
            put_back=[*outcome.later, *outcome.unsettled],
        )
        if self.own_cost is not None and committed is not None:
            stats = self.processor.stats
            if stats.batches > committed:  # committed: what its last run applied, and its job
                self.own_cost.note(stats.last_applied, stats.last_spark_seconds)
        if outcome.later and len(outcome.later) == len(batch):
            self.stop.wait(min(max(outcome.retry_later_in, 0.005), RATE_WAIT_MAX_S))

    def drain_aside(self) -> None:
        """Drain what keys that flow again had waiting aside (``keyq.worker.holding.aside_drains``);
        a service error only postpones it."""
        try:
            with redis_errors(self.settings.redis_url):
                self.drains.step(self.held)
        except KeyqError as exc:
            log.debug("draining events set aside failed (retried): %s", exc)

    def close_moves(self) -> None:
        """Close the moves of promoted keys whose buckets this worker holds
        (``keyq.worker.holding.route_moves``); a service error only postpones it."""
        if self.moves is None:
            return
        try:
            with redis_errors(self.settings.redis_url):
                self.moves.step(self.held)
        except KeyqError as exc:
            log.debug("closing moves failed (retried): %s", exc)

    def give_up_abandoned_gaps(self) -> None:
        """Gaps whose producer is gone need not wait out their timeout once nothing more is
        in their queue (``keyq.worker.holding.abandoned_gaps``); a service error only
        postpones it."""
        if not self.buffer.deferred():
            return
        try:
            with redis_errors(self.settings.redis_url):
                self.held.settle_gone()  # a gone consumer's queue is not judged by its counts
                self.abandoned.check()
        except KeyqError as exc:
            log.debug("checking for abandoned sequence gaps failed (retried): %s", exc)

    def reopen_stuck_gaps(self) -> None:
        """Reopen the consumers of queues whose gap stays open
        (``keyq.worker.holding.stuck_gaps``)."""
        if not self.buffer.deferred():
            return
        for queue in self.stuck.due():
            log.warning(
                "queue %s: a sequence gap has stayed open for %.0f s or more; reopening its "
                "consumer so that the broker hands back anything it counts as delivered here",
                queue,
                self.stuck.reopen_after_s,
            )
            quiet = self.stuck.quiet(queue)
            reopen_for_gap(self.stuck, self.held, self.starved, queue, look=quiet)

    def hand_back(self, requests: dict[str, str]) -> None:
        """Hand back the queues the claim loop asked for, at this batch boundary."""
        if not requests:
            return
        draining = self.drains.draining()
        queues = self.held.hand_back(
            requests, busy=lambda queue: self.buffer.depth(queue) > 0 or queue in draining
        )
        self.handbacks.handed_back(queues)
        self.fire_events()

    def fire_events(self) -> None:
        """Run the user's ``on_assigned`` / ``on_revoked`` callbacks, on this thread."""
        while True:
            try:
                kind, queues, _reason = self.events.get_nowait()
            except queue_module.Empty:
                return
            callback = self.on_assigned if kind == "assigned" else self.on_revoked
            if callback is not None:
                try:
                    callback(list(queues))
                except Exception:
                    log.exception("%s callback failed", kind)

    def shut_down(self) -> list[str]:
        """Take nothing new, close every consumer and hand every lock back; returns what
        was held."""
        self.claims.stop_claiming()  # it renews the locks until they are handed back
        held = self.held.hand_back_all()
        self.claims.stop()
        self.fire_events()
        return [item.queue for item in held]
