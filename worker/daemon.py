"""The worker: claims queues of a stream, and processes what they deliver in micro-batches.

Three threads: the AMQP I/O thread (deliveries in, acks out), the claim loop (membership,
locks, fair shares) and the batch loop, which runs here in ``run`` and is the only one that
runs Spark or user code, including the ``on_assigned`` / ``on_revoked`` callbacks.
"""

from __future__ import annotations

import logging
import os
import queue as queue_module
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import redis.exceptions

from keyq.broker.clock import now_ms
from keyq.broker.connections import open_blocking_connection, open_redis, redis_errors
from keyq.broker.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    ConfigurationError,
    ConnectionFailed,
    KeyqError,
    RedisUnavailable,
    StreamConfigMismatch,
)
from keyq.broker.locks import FencedLocks
from keyq.broker.membership import Membership
from keyq.broker.naming import Mode, check_stream_name
from keyq.broker.producer_presence import ProducerPresence
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.redis_persistence import log_redis_persistence
from keyq.broker.redis_topology import connected_replicas
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import load_settings
from keyq.broker.streams import StreamConfig, ensure_stream_config, load_stream_config
from keyq.broker.worker_report import GapReport, WorkerReport
from keyq.worker.abandoned_gaps import AbandonedGaps
from keyq.worker.batches import BatchProcessor, BatchStats
from keyq.worker.claims import ClaimLoop, client_name
from keyq.worker.config import WorkerSettings
from keyq.worker.consumer import ConsumeOutcome, ConsumerLink
from keyq.worker.deliveries import Delivery, DeliveryBuffer
from keyq.worker.engine import SparkEngine
from keyq.worker.holdings import Held, Holdings
from keyq.worker.pipeline import Pipeline, load_pipeline
from keyq.worker.sinks import ParquetSink, open_sink
from keyq.worker.state_store import StateStore
from keyq.worker.stuck_gaps import StuckGaps

_T = TypeVar("_T")

log = logging.getLogger("keyq.worker")

QueueCallback = Callable[[list[str]], None]
_SAFE_ID = re.compile(r"[^A-Za-z0-9_.-]")
_ERROR_BACKOFF_S = 1.0
_MAX_PREFETCH = 65535
BATCH_WAIT_SPARK_FACTOR = 2.0
BATCH_WAIT_MAX_S = 2.0


def new_worker_id() -> str:
    host = _SAFE_ID.sub("-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def batch_wait(settings: WorkerSettings, stats: BatchStats) -> float:
    """How long a batch may wait to fill, from its first event. Under light load (the last
    batch under half of ``batch_max_events``) only ``batch_max_ms``, 0 by default: a batch
    starts as soon as the previous job ends and events are ready, and the events that arrive
    during a job make the next batch. Under heavy load up to twice the last Spark job (at
    most 2 s): every job has a fixed cost, so a loaded worker runs fewer, larger jobs."""
    floor = settings.batch_max_ms / 1000
    if stats.last_batch_events * 2 < settings.batch_max_events:
        return floor
    return min(max(floor, BATCH_WAIT_SPARK_FACTOR * stats.last_spark_seconds), BATCH_WAIT_MAX_S)


class Worker:
    """A worker daemon for one stream. ``run()`` blocks until ``stop()`` (or idle, if asked)."""

    def __init__(
        self,
        stream: str,
        pipeline: str | Pipeline,
        *,
        sink: str | ParquetSink | None = None,
        mode: str | Mode | None = None,
        buckets: int | None = None,
        settings: WorkerSettings | None = None,
        worker_id: str | None = None,
        on_assigned: QueueCallback | None = None,
        on_revoked: QueueCallback | None = None,
        engine: SparkEngine | None = None,
    ) -> None:
        self.stream = check_stream_name(stream)
        self.settings = settings or load_settings(WorkerSettings)
        self.worker_id = worker_id or new_worker_id()
        if "|" in self.worker_id:
            raise ConfigurationError("worker ids must not contain '|'")
        self._pipeline = load_pipeline(pipeline) if isinstance(pipeline, str) else pipeline
        self._sink = open_sink(sink) if sink is None or isinstance(sink, str) else sink
        self._mode = mode
        self._buckets = buckets
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        self._engine = engine
        self._owns_engine = engine is None
        self._stop = threading.Event()
        self._events: queue_module.SimpleQueue[tuple[str, list[str], str]] = (
            queue_module.SimpleQueue()
        )
        self._buffer = DeliveryBuffer(self.settings.sequence_gap_timeout_ms / 1000)
        self._holdings = Holdings()
        self._started_ms = now_ms()
        self._queue_keys: dict[str, str | None] = {}
        # Consumers reopened with a wider prefetch (only those: the rest have the setting's).
        self._prefetch_of: dict[tuple[str, int], int] = {}
        self._claims: ClaimLoop | None = None
        self._processor: BatchProcessor | None = None
        self._link: ConsumerLink | None = None
        self._stuck: StuckGaps | None = None
        self.config: StreamConfig | None = None
        self.ready = threading.Event()
        self.released = 0

    # ---- control --------------------------------------------------------------------------

    def stop(self) -> None:
        """Finish the batch in flight, commit, ack, hand every queue back, and return."""
        self._stop.set()
        self._buffer.wake()

    def batch_seconds(self) -> list[float]:
        """Durations of the most recent batches (up to 1,000), oldest first."""
        return list(self._processor.stats.batch_seconds) if self._processor else []

    @property
    def held(self) -> list[str]:
        return sorted(self._holdings.queues())

    def stats(self) -> dict[str, Any]:
        """``report()`` as plain values (what the heartbeat stores)."""
        return self.report().to_dict()

    def report(self) -> WorkerReport:
        """What this worker reports about itself: its counters and what it waits on now."""
        batch = self._processor.stats if self._processor else None
        claims = self._claims.stats if self._claims else None
        return WorkerReport(
            worker=self.worker_id,
            stream=self.stream,
            ready=self._claims.ready if self._claims else False,
            started_ms=self._started_ms,
            held=len(self._holdings),
            batches=batch.batches if batch else 0,
            events=batch.events if batch else 0,
            skipped=batch.skipped if batch else 0,
            dead_lettered=batch.dead_lettered if batch else 0,
            commits_refused=batch.commits_refused if batch else 0,
            commits_unreplicated=batch.commits_unreplicated if batch else 0,
            pipeline_failures=batch.pipeline_failures if batch else 0,
            spark_seconds=round(batch.spark_seconds, 3) if batch else 0.0,
            last_spark_seconds=round(batch.last_spark_seconds, 3) if batch else 0.0,
            stage_seconds=(
                {stage: round(value, 3) for stage, value in batch.stage_seconds.items()}
                if batch
                else {}
            ),
            claims=claims.claims if claims else 0,
            lost=claims.lost if claims else 0,
            released=self.released,
            peers_reaped=claims.peers_reaped if claims else 0,
            reconnects=self._link.reconnects if self._link else 0,
            late=batch.late if batch else 0,
            gaps_skipped=batch.gaps_skipped if batch else 0,
            gap_reopens=self._stuck.reopens if self._stuck else 0,
            waiting=self._buffer.parked(),
            **self._gap_report(),
        )

    def _gap_report(self) -> dict[str, Any]:
        """The sequence gaps this worker waits on now, the oldest first (at most five)."""
        if self._processor is None:
            return {"gaps_open": 0, "oldest_gap_s": 0.0, "gaps": ()}
        now = time.monotonic()
        gaps = sorted(
            (
                gap
                for gap, queue in list(self._processor.open_gaps.values())
                if self._buffer.parked(queue)
            ),
            key=lambda gap: gap.since,
        )
        return {
            "gaps_open": len(gaps),
            "oldest_gap_s": round(now - gaps[0].since, 3) if gaps else 0.0,
            "gaps": tuple(
                GapReport(
                    key=gap.key,
                    producer=gap.producer,
                    first=gap.first,
                    last=gap.last,
                    waited_s=round(now - gap.since, 3),
                )
                for gap in gaps[:5]
            ),
        }

    # ---- the loop -------------------------------------------------------------------------

    def run(self, *, until_idle: float | None = None) -> None:
        """Serve until stopped; with ``until_idle``, also stop once nothing arrived for that
        many seconds (a drain mode for jobs and tests)."""
        settings = self.settings
        client = self._wait_for_services()
        if client is None:
            return  # stopped while waiting
        log_redis_persistence(client, log)  # once: a Redis without AOF forgets commits
        try:
            if self._engine is None:
                self._engine = SparkEngine(settings, f"keyq-worker-{self.worker_id}")
                self._engine.start(stopping=self._stop)
                if not self._stop.is_set():
                    # On a cluster: the executors must import the pipeline and keyq's fold.
                    module = getattr(self._pipeline, "__module__", None) or "__main__"
                    self._engine.ship([module, "keyq.worker.fold"])
            if self._stop.is_set():
                log.info("worker %s stopped while starting", self.worker_id)
                return  # nothing is held yet
            config = self._while_redis_is_away(
                "reading the stream's config", lambda: self._stream_config(client)
            )
            if config is None or self._stop.is_set():
                return
            self.config = config
            replicas = self._while_redis_is_away(
                "counting Redis replicas", lambda: self._replicas_required(client)
            )
            if replicas is None:
                return
            store = StateStore(
                client,
                self.stream,
                replicas=replicas,
                replica_timeout_ms=self.settings.redis_replica_timeout_ms,
            )

            def recover_sink() -> bool:
                self._recover_sink(store)
                return True

            if not self._while_redis_is_away("finishing committed output", recover_sink):
                return
            self._serve(client, store, until_idle)
        finally:
            if self._owns_engine and self._engine is not None:
                self._engine.stop()  # after a return before serving (else already stopped)
            client.close()

    def _wait_for_services(self) -> redis.Redis | None:
        """Reach Redis and RabbitMQ before Spark starts. Bad credentials or a wrong vhost fail
        at once; a service that is down is waited for, as a daemon started beside it (or
        while it restarts) should. None if stopped while waiting."""
        backoff = 0.5
        while True:
            try:
                client = open_redis(self.settings, client_name=client_name(self.worker_id))
                try:
                    open_blocking_connection(
                        self.settings, f"worker-check-{self.worker_id}"
                    ).close()
                except BaseException:
                    client.close()
                    raise
                return client
            except AuthenticationFailed:
                raise
            except ConnectionFailed as exc:
                log.warning("waiting for the services, retrying in %.1fs: %s", backoff, exc)
                if self._stop.wait(backoff):
                    return None
                backoff = min(backoff * 2, 5.0)

    def _replicas_required(self, client: redis.Redis) -> int:
        """How many Redis replicas must confirm each commit before its events are acked:
        ``KEYQ_REDIS_MIN_REPLICAS``, or 1 when the stream's primary has a replica now."""
        wanted = self.settings.redis_min_replicas
        if wanted is None:
            try:
                found = connected_replicas(client, StreamKeys(self.stream).commits)
            except redis.exceptions.ResponseError as exc:  # INFO not permitted
                log.warning("cannot count Redis replicas (%s): commits do not wait for any", exc)
                found = 0
            wanted = 1 if found else 0
        if wanted:
            log.info(
                "each commit waits for %d Redis replica(s) before its events are acked", wanted
            )
        else:
            log.info("commits do not wait for Redis replicas (none required or none found)")
        return wanted

    def _while_redis_is_away(self, what: str, step: Callable[[], _T]) -> _T | None:
        """Run a start-up step, waiting with backoff while Redis is away (cut or restarting
        after the services check passed): a daemon outlives an outage at any point. None if
        stopped while waiting."""
        backoff = 0.5
        while not self._stop.is_set():
            try:
                with redis_errors(self.settings.redis_url):
                    return step()
            except RedisUnavailable as exc:
                log.warning("%s: retrying in %.1fs: %s", what, backoff, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        return None

    def _serve(self, client: redis.Redis, store: StateStore, until_idle: float | None) -> None:
        settings = self.settings
        assert self.config is not None and self._engine is not None
        registry = QueueRegistry(client, self.stream)
        link = ConsumerLink(
            settings=settings,
            stream=self.stream,
            name=f"worker-{self.worker_id}",
            buffer=self._buffer,
            prefetch=settings.prefetch,
            on_queue_lost=self._queue_lost,
            on_disconnected=lambda reason: log.warning("lost RabbitMQ: %s", reason),
            queue_type=self.config.queue_type,
        )
        self._link = link
        try:
            link.start(give_up=self._stop)
        except BrokerUnavailable:
            if self._stop.is_set():
                return  # stopped before RabbitMQ answered: nothing was held yet
            raise
        claims = ClaimLoop(
            settings=settings,
            stream=self.stream,
            mode=self.config.mode,
            worker_id=self.worker_id,
            client=client,
            link=link,
            holdings=self._holdings,
            buffer=self._buffer,
            notify=lambda kind, queues, reason: self._events.put((kind, queues, reason)),
            info=self.stats,
        )
        self._claims = claims
        self._processor = BatchProcessor(
            settings=settings,
            stream=self.stream,
            worker_id=self.worker_id,
            engine=self._engine,
            pipeline=self._pipeline,
            store=store,
            registry=registry,
            sink=self._sink,
            link=link,
            holdings=self._holdings,
            keys_of_queues=lambda queues: self._keys_of(registry, queues),
            stopping=self._stop,
        )
        stuck = StuckGaps(self._buffer, settings.sequence_gap_timeout_ms / 1000)
        self._stuck = stuck
        abandoned = AbandonedGaps(
            self._buffer,
            alive=ProducerPresence(client, self.stream).alive,
            ready_count=link.message_count,
            room_of=self._room_of,
            confirm_gone_s=settings.producer_ttl_ms / 2000,
            reopened_at=stuck.reopened_at,
            reopen=lambda queue: self._reopen_for_gap(queue, stuck),
        )
        claims.start()
        if not claims.wait_first_round(10):
            log.warning("the first claim round has not completed yet; serving once it does")
        last_work = time.monotonic()
        try:
            while not self._stop.is_set():
                if link.failure is not None:
                    raise link.failure
                if not self.ready.is_set() and claims.ready:
                    self.ready.set()
                    log.info("worker %s serving stream %s", self.worker_id, self.stream)
                self._fire_events()
                self._apply_releases(claims.take_release_requests(), client)
                self._give_up_abandoned_gaps(abandoned)
                self._reopen_stuck_gaps(stuck)
                batch = self._buffer.take(settings.batch_max_events, self._batch_wait(), 0.1)
                if batch:
                    self._process(batch)
                    last_work = time.monotonic()
                elif until_idle is not None and time.monotonic() - last_work >= until_idle:
                    break
        finally:
            self._shutdown(client, claims, link)

    def _process(self, batch: list[Delivery]) -> None:
        assert self._processor is not None
        try:
            leftover = self._processor.process(batch)
        except (KeyqError, redis.exceptions.RedisError, OSError) as exc:
            log.warning("batch interrupted, will retry: %s", exc)
            self._processor.waiting = []  # unsettled: put back with the rest
            leftover = self._processor.unsettled(batch)
            self._stop.wait(_ERROR_BACKOFF_S)
        self._park(self._processor.waiting)
        assert self._claims is not None
        for lease in self._processor.lost_leases:
            self._claims.lose(lease, "commit refused: the lock moved on")
        self._processor.lost_leases.clear()
        if leftover:
            still_held = []
            orphaned: set[tuple[str, int]] = set()
            for delivery in leftover:
                if self._holdings.lease_for(delivery.queue, delivery.channel_epoch):
                    still_held.append(delivery)
                else:
                    orphaned.add((delivery.queue, delivery.channel_epoch))
            self._buffer.put_back(still_held)
            assert self._link is not None
            for queue, epoch in orphaned:
                # Never keep a consumer whose deliveries we dropped: close it (if it is still
                # open) so the broker hands them out again, in order.
                self._link.close_queue(queue, epoch)

    def _room_of(self, queue: str) -> int | None:
        """The prefetch of ``queue``'s current consumer; None if it is not held."""
        held = self._holdings.get(queue)
        if held is None:
            return None
        return self._prefetch_of.get((queue, held.epoch), self.settings.prefetch)

    def _give_up_abandoned_gaps(self, abandoned: AbandonedGaps) -> None:
        """Gaps whose producer is gone need not wait out their timeout once nothing more is
        in their queue (``keyq.worker.abandoned_gaps``); a service error only postpones it."""
        if not self._buffer.parked():
            return
        try:
            with redis_errors(self.settings.redis_url):
                abandoned.check()
        except KeyqError as exc:
            log.debug("checking for abandoned sequence gaps failed (retried): %s", exc)

    def _park(self, waiting: list[Delivery]) -> None:
        """Set aside what waits for an earlier seq. A consumer whose whole prefetch waits
        would never be sent the events that fill the gap: it is reopened with room for more
        (closing hands every unacked delivery back, in order)."""
        if not waiting:
            return
        fresh = [d for d in waiting if self._holdings.lease_for(d.queue, d.channel_epoch)]
        self._buffer.park(fresh)
        assert self._link is not None
        for queue in {d.queue for d in fresh}:
            held = self._holdings.get(queue)
            room = self._room_of(queue)
            if held is None or room is None:
                continue
            parked = self._buffer.parked(queue)
            if parked < room or room >= _MAX_PREFETCH:
                continue
            wider = min(_MAX_PREFETCH, parked + self.settings.prefetch)
            log.info(
                "queue %s: all %d unacked events wait for an earlier seq; reopening it with a "
                "prefetch of %d",
                queue,
                parked,
                wider,
            )
            self._reopen(queue, wider)

    def _reopen(self, queue: str, prefetch: int | None = None) -> None:
        """Close ``queue``'s consumer, which hands every unacked delivery back to the queue in
        order, and consume it again at once (under the same lock) with ``prefetch``, or the
        one it had. Its waiting events keep their waiting time."""
        held = self._holdings.get(queue)
        if held is None:
            return
        assert self._link is not None
        if prefetch is None:
            prefetch = self._prefetch_of.get((queue, held.epoch))
        self._link.close_queue(queue, held.epoch)
        self._buffer.drop(queue, held.epoch, keep_waits=True)
        self._prefetch_of.pop((queue, held.epoch), None)
        again = Held(queue=queue, lease=held.lease, epoch=self._link.new_epoch(), since=held.since)
        self._holdings.add(again)
        consumed = self._link.consume(queue, again.epoch, prefetch=prefetch)
        if consumed.outcome is ConsumeOutcome.CONSUMING:
            if prefetch is not None:
                self._prefetch_of[(queue, again.epoch)] = prefetch
        else:
            self._queue_lost(queue, again.epoch, f"reopening it failed: {consumed.outcome}")

    def _reopen_stuck_gaps(self, stuck: StuckGaps) -> None:
        """Reopen the consumers of queues whose gap stays open (``keyq.worker.stuck_gaps``)."""
        if not self._buffer.parked():
            return
        for queue in stuck.due():
            log.warning(
                "queue %s: a sequence gap has stayed open for %.0f s; reopening its consumer so "
                "that the broker hands back anything it counts as delivered here",
                queue,
                stuck.reopen_after_s,
            )
            self._reopen_for_gap(queue, stuck)

    def _reopen_for_gap(self, queue: str, stuck: StuckGaps) -> None:
        stuck.note_reopened(queue)
        self._reopen(queue)

    def _batch_wait(self) -> float:
        assert self._processor is not None
        return batch_wait(self.settings, self._processor.stats)

    def _fire_events(self) -> None:
        while True:
            try:
                kind, queues, _reason = self._events.get_nowait()
            except queue_module.Empty:
                return
            callback = self._on_assigned if kind == "assigned" else self._on_revoked
            if callback is not None:
                try:
                    callback(list(queues))
                except Exception:
                    log.exception("%s callback failed", kind)

    def _apply_releases(self, requests: dict[str, str], client: redis.Redis) -> None:
        if not requests:
            return
        assert self._link is not None and self._claims is not None
        released = []
        for queue, reason in requests.items():
            held = self._holdings.get(queue)
            if held is None or (reason == "idle" and self._buffer.depth(queue) > 0):
                continue
            self._link.close_queue(queue, held.epoch)
            self._buffer.drop(queue, held.epoch)
            self._holdings.remove(queue, held.epoch)
            self._claims.note_released(queue)
            released.append(held)
        if released:
            try:
                with redis_errors(self.settings.redis_url):
                    FencedLocks(client, self.stream).release([h.lease for h in released])
            except RedisUnavailable as exc:
                # The consumers are closed already: the locks just run out their ttl.
                log.warning("handing back %d queues: locks left to expire: %s", len(released), exc)
            self.released += len(released)
            log.info("handed back %d queues", len(released))
            self._events.put(("revoked", [h.queue for h in released], "released"))
            self._fire_events()

    def _queue_lost(self, queue: str, epoch: int, reason: str) -> None:
        if self._claims is not None:
            self._claims.queue_lost(queue, epoch, reason)

    def _shutdown(self, client: redis.Redis, claims: ClaimLoop, link: ConsumerLink) -> None:
        claims.stop_claiming()
        held = self._holdings.all()
        for item in held:
            link.close_queue(item.queue, item.epoch)
            self._buffer.drop(item.queue, item.epoch)
            self._holdings.remove(item.queue, item.epoch)
        claims.stop()
        try:
            FencedLocks(client, self.stream).release([h.lease for h in held])
            Membership(client, self.stream, self.settings.member_ttl_ms).leave(self.worker_id)
        except (redis.exceptions.RedisError, OSError):
            log.warning("could not release locks at shutdown; they expire by themselves")
        if held:
            self._events.put(("revoked", [h.queue for h in held], "shutdown"))
        self._fire_events()
        link.stop()
        if self._owns_engine and self._engine is not None:
            self._engine.stop()
        log.info("worker %s stopped%s", self.worker_id, self._time_summary())

    def _time_summary(self) -> str:
        """Where the batches' time went, for the log line at stop."""
        stats = self._processor.stats if self._processor is not None else None
        if stats is None or not stats.batches:
            return ""
        stages = ", ".join(
            f"{name} {seconds:.1f}s" for name, seconds in stats.stage_seconds.items()
        )
        return f" after {stats.batches} batches of {stats.events} events: {stages}"

    # ---- helpers --------------------------------------------------------------------------

    def _stream_config(self, client: redis.Redis) -> StreamConfig:
        """The stream's config; without a mode given, wait for the first producer to set it.
        A queue type asked for (``KEYQ_QUEUE_TYPE``) must be the stream's."""
        asked_type = self.settings.queue_type
        with redis_errors(self.settings.redis_url):
            if self._mode is not None or self._buckets is not None:
                return ensure_stream_config(
                    client, self.stream, self._mode, self._buckets, asked_type
                )
            waited = False
            while not self._stop.is_set():
                config = load_stream_config(client, self.stream)
                if config is not None:
                    if asked_type is not None and asked_type != config.queue_type:
                        raise StreamConfigMismatch(
                            f"stream {self.stream!r} is fixed at {config.describe()}; this "
                            f"worker asked for queue type {asked_type}"
                        )
                    return config
                if not waited:
                    log.info("stream %s has no producer yet; waiting for one", self.stream)
                    waited = True
                self._stop.wait(1.0)
        raise KeyqError("stopped before the stream was configured")

    def _keys_of(self, registry: QueueRegistry, queues: Collection[str]) -> dict[str, str | None]:
        """The key each key-mode queue was declared for (a message there without a key header
        still belongs to it), the ones not known yet in one round trip. A bucket holds many
        keys: such a message has no key."""
        if self.config is None or self.config.mode is not Mode.KEY:
            return dict.fromkeys(queues)
        unknown = [queue for queue in queues if queue not in self._queue_keys]
        if unknown:
            self._queue_keys.update(registry.original_keys(unknown))
        return {queue: self._queue_keys[queue] for queue in queues}

    def _recover_sink(self, store: StateStore) -> None:
        """Finish making visible any batch output that was committed but not renamed."""
        if self._sink is None:
            return
        pending = store.pending_sink_records()
        for token, staged in pending.items():
            self._sink.publish(token, staged)
            store.forget_sink_record(token)
        self._sink.sweep_orphans(set(pending.values()))
