"""The worker: claims queues of a stream, and processes what they deliver in micro-batches.

Three threads: the AMQP I/O thread (deliveries in, acks out), the claim loop (membership,
locks, fair shares) and the batch loop, which runs here in ``run`` and is the only one that
runs Spark or user code, including the ``on_assigned`` / ``on_revoked`` callbacks. What each
thread may do to a held queue is ``keyq.worker.holding.held_queues``'s to say.
"""

from __future__ import annotations

import functools
import logging
import os
import queue as queue_module
import re
import socket
import threading
import time
import uuid
from typing import Any

import redis
import redis.exceptions

from keyq.broker.clock import now_ms
from keyq.broker.errors import BrokerUnavailable, ConfigurationError
from keyq.broker.key_control import KeyControl
from keyq.broker.membership import Membership
from keyq.broker.naming import Mode, check_stream_name
from keyq.broker.producer_presence import ProducerPresence
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import load_settings
from keyq.broker.stream_policy import StreamPolicies
from keyq.broker.streams import StreamConfig
from keyq.broker.worker_report import WorkerReport
from keyq.worker.amqp.deliveries import DeliveryBuffer
from keyq.worker.amqp.link import ConsumerLink
from keyq.worker.auto_mode import OwnEventCost, auto_parts, shared_cap
from keyq.worker.batch.processor import BatchProcessor
from keyq.worker.batch.routing import AutoRouting
from keyq.worker.batch.state_store import StateStore
from keyq.worker.batch.stats import BatchListener
from keyq.worker.config import WorkerSettings
from keyq.worker.holding.assembly import assemble_holding
from keyq.worker.holding.claims import ClaimLoop
from keyq.worker.holding.handbacks import HandBacks
from keyq.worker.holding.held_queues import HeldQueues, QueueEvents
from keyq.worker.holding.queue_keys import QueueKeys
from keyq.worker.pipeline import Pipeline
from keyq.worker.pipeline_loading import load_pipeline
from keyq.worker.policy_cache import PolicyCache
from keyq.worker.redis_persistence import log_redis_persistence
from keyq.worker.reporting import worker_report
from keyq.worker.serving import QueueCallback, Session, gap_watchers
from keyq.worker.spark.engine import SparkEngine
from keyq.worker.spark.sinks import ParquetSink, open_sink
from keyq.worker.startup import (
    recover_sink,
    replicas_required,
    stream_config,
    wait_for_services,
    while_redis_is_away,
)

log = logging.getLogger("keyq.worker")

_SAFE_ID = re.compile(r"[^A-Za-z0-9_.-]")


def new_worker_id() -> str:
    host = _SAFE_ID.sub("-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


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
        self._events: QueueEvents = queue_module.SimpleQueue()
        self._cost = OwnEventCost()  # auto mode
        self._buffer = DeliveryBuffer(
            self.settings.sequence_gap_timeout_ms / 1000,
            shared_cap=lambda queue, others: shared_cap(self.settings, queue, self._cost, others),
        )
        self._started_ms = now_ms()
        self._session: Session | None = None  # while serving
        self.config: StreamConfig | None = None
        self.ready = threading.Event()
        # Told of every committed batch (the metrics' histograms); kept across sessions.
        self.batch_listeners: list[BatchListener] = []
        self._claim_tick_at: float | None = None  # monotonic: the claim loop's last heartbeat

    # ---- control --------------------------------------------------------------------------

    def stop(self) -> None:
        """Finish the batch in flight, commit, ack, hand every queue back, and return."""
        self._stop.set()
        self._buffer.wake()

    def batch_seconds(self) -> list[float]:
        """Durations of the most recent batches (up to 1,000), oldest first."""
        session = self._session
        return list(session.processor.stats.batch_seconds) if session else []

    def is_live(self) -> bool:
        """True unless the claim loop stopped turning: its last heartbeat began within the
        lock ttl (and three ticks). Starting up, before the loop runs, counts as live."""
        ticked = self._claim_tick_at
        if ticked is None or self._session is None:
            return True
        settings = self.settings
        within = max(settings.lock_ttl_ms, 3 * settings.tick_ms) / 1000
        return time.monotonic() - ticked <= within

    def is_ready(self) -> bool:
        """True while serving: connected to RabbitMQ, the first claim round done, not
        stopping."""
        session = self._session
        serving = session is not None and session.claims.ready and session.link.connected
        return serving and not self._stop.is_set()

    def _heartbeat_info(self) -> dict[str, Any]:
        """What the claim loop's heartbeat stores; asked once per heartbeat, so also when
        the loop last turned."""
        self._claim_tick_at = time.monotonic()
        return self.stats()

    @property
    def held(self) -> list[str]:
        return sorted(self._session.held.queues()) if self._session else []

    @property
    def released(self) -> int:
        """Queues handed back while running (idle, or to rebalance)."""
        return self._session.held.released if self._session else 0

    def stats(self) -> dict[str, Any]:
        """``report()`` as plain values (what the heartbeat stores)."""
        return self.report().to_dict()

    def report(self) -> WorkerReport:
        """What this worker reports about itself: its counters and what it waits on now."""
        return worker_report(
            self._session,
            worker_id=self.worker_id,
            stream=self.stream,
            started_ms=self._started_ms,
            waiting=self._buffer.deferred(),
        )

    # ---- the loop -------------------------------------------------------------------------

    def run(self, *, until_idle: float | None = None) -> None:
        """Serve until stopped; with ``until_idle``, also stop once nothing arrived for that
        many seconds (a drain mode for jobs and tests)."""
        client = wait_for_services(self.settings, self.worker_id, self._stop)
        if client is None:
            return  # stopped while waiting
        log_redis_persistence(client, log)  # once: a Redis without AOF forgets commits
        try:
            self._start_engine()
            if self._stop.is_set():
                log.info("worker %s stopped while starting", self.worker_id)
                return  # nothing is held yet
            store = self._prepare(client)
            if store is not None:
                self._serve(client, store, until_idle)
        finally:
            if self._owns_engine and self._engine is not None:
                self._engine.stop()  # after a return before serving (else already stopped)
            client.close()

    def _start_engine(self) -> None:
        if self._engine is not None:
            return
        self._engine = SparkEngine(self.settings, f"keyq-worker-{self.worker_id}")
        self._engine.start(stopping=self._stop)
        if not self._stop.is_set():
            # On a cluster: the executors must import the pipeline and keyq's fold.
            module = getattr(self._pipeline, "__module__", None) or "__main__"
            self._engine.ship([module, "keyq.worker.spark.fold"])

    def _prepare(self, client: redis.Redis) -> StateStore | None:
        """Read the stream's config, count the Redis replicas a commit waits for and finish
        output committed before a crash, each waiting out a Redis that is away; None if
        stopped meanwhile."""
        settings, stop = self.settings, self._stop

        def read_config() -> StreamConfig:
            return stream_config(
                settings, client, self.stream, mode=self._mode, buckets=self._buckets, stop=stop
            )

        config = while_redis_is_away(settings, stop, "reading the stream's config", read_config)
        if config is None or stop.is_set():
            return None
        self.config = config
        replicas = while_redis_is_away(
            settings,
            stop,
            "counting Redis replicas",
            lambda: replicas_required(settings, client, self.stream),
        )
        if replicas is None:
            return None
        store = StateStore(
            client,
            self.stream,
            replicas=replicas,
            replica_timeout_ms=settings.redis_replica_timeout_ms,
        )

        def recovered() -> bool:
            recover_sink(self._sink, store)
            return True

        if not while_redis_is_away(settings, stop, "finishing output", recovered):
            return None
        return store

    def _serve(self, client: redis.Redis, store: StateStore, until_idle: float | None) -> None:
        settings = self.settings
        assert self.config is not None
        link = ConsumerLink(
            settings=settings,
            stream=self.stream,
            name=f"worker-{self.worker_id}",
            buffer=self._buffer,
            prefetch=settings.prefetch,
            on_disconnected=functools.partial(log.warning, "lost RabbitMQ: %s"),
            queue_type=self.config.queue_type,
        )
        try:
            link.start(give_up=self._stop)
        except BrokerUnavailable:
            if self._stop.is_set():
                return  # stopped before RabbitMQ answered: nothing was held yet
            raise
        session = self._session = self._session_for(client, store, link)
        session.claims.start()
        if not session.claims.wait_first_round(10):
            log.warning("the first claim round has not completed yet; serving once it does")
        try:
            session.serve(
                until_idle, self.ready, f"worker {self.worker_id} serving stream {self.stream}"
            )
        finally:
            session.shut_down()
            try:
                Membership(client, self.stream, settings.member_ttl_ms).leave(self.worker_id)
            except (redis.exceptions.RedisError, OSError):
                log.warning("could not leave the stream's members; the entry expires by itself")
            link.stop()
            if self._owns_engine and self._engine is not None:
                self._engine.stop()
            log.info("worker %s stopped%s", self.worker_id, self._time_summary())

    @property
    def _stream_config(self) -> StreamConfig:
        assert self.config is not None, "the stream's config is read before serving"
        return self.config

    def _session_for(self, client: redis.Redis, store: StateStore, link: ConsumerLink) -> Session:
        """The session's parts, each given the small part of the link it uses."""
        settings, config = self.settings, self._stream_config
        registry, control = QueueRegistry(client, self.stream), KeyControl(client, self.stream)
        policy = PolicyCache(StreamPolicies(client, self.stream))
        holding = assemble_holding(
            config,
            client=client,
            link=link,
            registry=registry,
            control=control,
            buffer=self._buffer,
            events=self._events,
        )
        handbacks = HandBacks(self._buffer)
        claims = ClaimLoop(
            settings=settings,
            stream=self.stream,
            mode=config.mode,
            worker_id=self.worker_id,
            client=client,
            link=link,
            held=holding.held,
            handbacks=handbacks,
            info=self._heartbeat_info,
            aside=holding.drains,
            starved=holding.starved,
            policy=policy,
        )
        auto = auto_parts(settings, config, client, link.dead_letters, self._cost)
        processor = self._processor(
            store,
            registry=registry,
            link=link,
            held=holding.held,
            control=control,
            policy=policy,
            routing=auto.routing,
        )
        presence = ProducerPresence(client, self.stream)
        stuck, abandoned = gap_watchers(settings, self._buffer, presence, link.counts, holding)
        return Session(
            settings=settings,
            buffer=self._buffer,
            link=link,
            held=holding.held,
            handbacks=handbacks,
            claims=claims,
            processor=processor,
            stuck=stuck,
            abandoned=abandoned,
            events=self._events,
            stop=self._stop,
            drains=holding.drains,
            starved=holding.starved,
            own_cost=auto.cost,
            moves=auto.moves,
            on_assigned=self._on_assigned,
            on_revoked=self._on_revoked,
        )

    def _processor(
        self,
        store: StateStore,
        *,
        registry: QueueRegistry,
        link: ConsumerLink,
        held: HeldQueues,
        control: KeyControl,
        policy: PolicyCache,
        routing: AutoRouting | None,
    ) -> BatchProcessor:
        assert self.config is not None and self._engine is not None
        processor = BatchProcessor(
            settings=self.settings,
            stream=self.stream,
            worker_id=self.worker_id,
            engine=self._engine,
            pipeline=self._pipeline,
            store=store,
            registry=registry,
            sink=self._sink,
            acker=link.consumers,
            dead_letters=link.dead_letters,
            keys=QueueKeys(registry, self.config.mode, self.stream),
            holdings=held,
            stopping=self._stop,
            control=control,
            policy=policy,
            routing=routing,
        )
        processor.stats.listeners = self.batch_listeners
        return processor

    def _time_summary(self) -> str:
        """Where the batches' time went, for the log line at stop."""
        stats = self._session.processor.stats if self._session is not None else None
        if stats is None or not stats.batches:
            return ""
        stages = ", ".join(f"{name} {s:.1f}s" for name, s in stats.stage_seconds.items())
        return f" after {stats.batches} batches of {stats.events} events: {stages}"
