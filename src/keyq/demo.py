"""``keyq demo``: order events through real workers and a janitor, then proof from the data.

Against the configured RabbitMQ and Redis, it starts a janitor and worker processes (or uses
workers already running, ``--external-workers``), publishes a skewed stream of order events,
optionally kills, restarts and scales workers while it runs (``--chaos``), waits until every
order's state is committed, and compares each order's state in Redis with a plain-Python fold
of exactly what was published. The verdict comes from that comparison.

Orders go to a queue each (key mode, the default) or to a fixed number of hash buckets
(``--mode bucket``), on classic or quorum queues (``--queue-type``). A chaos step that fails
(a broker that does not answer, say) is logged and reported in the summary, and the next step
goes on.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pika.exceptions
import redis

from keyq.broker.connections import (
    describe_exception,
    open_blocking_connection,
    open_redis,
    redis_errors,
)
from keyq.broker.errors import ConfigurationError, KeyqError
from keyq.broker.locks import FencedLocks
from keyq.broker.membership import Membership
from keyq.broker.naming import Mode
from keyq.broker.readiness import wait_for_services
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import StreamConfig, ensure_stream_config
from keyq.broker.urls import scrub
from keyq.orders import expected_states, generate_orders
from keyq.processes import Daemon, log_folder
from keyq.producer import Producer
from keyq.worker.state_store import StateStore

PIPELINE = "keyq.orders:pipeline"
LATENCY_SAMPLE = 200
# Above this many orders, key mode on quorum queues is worth a warning: each quorum queue is a
# Raft group with file descriptors and memory on every node (2,000 of them on a node allowed
# 1,024 open files stopped it completing AMQP handshakes for over an hour).
QUORUM_KEYS_WARNING = 500
# Failures a chaos step meets when a service misbehaves: reported in one line, no traceback.
SERVICE_ERRORS: tuple[type[BaseException], ...] = (
    KeyqError,
    redis.exceptions.RedisError,
    pika.exceptions.AMQPError,
    OSError,
)

log = logging.getLogger("keyq.demo")


@dataclass
class DemoOptions:
    orders: int = 2000
    events: int = 100_000
    workers: int = 2
    max_workers: int = 4
    chaos: bool = False
    external_workers: bool = False
    stream: str | None = None
    seed: int = 7
    idle_ttl: float = 30.0
    drain_timeout: float = 600.0
    rate: float = 0.0  # events/s while publishing; 0 = as fast as possible
    wait_for_services: float = 120.0  # s for RabbitMQ and Redis to accept connections
    mode: str = "key"  # a queue per order, or "bucket": a queue per hash bucket
    buckets: int | None = None  # bucket mode only; None: the stream's, else DEFAULT_BUCKETS
    queue_type: str | None = None  # "classic" or "quorum"; None: KEYQ_QUEUE_TYPE, else classic

    def __post_init__(self) -> None:
        if self.mode not in ("key", "bucket"):
            raise ConfigurationError(f"demo mode must be 'key' or 'bucket', not {self.mode!r}")
        if self.mode == "key" and self.buckets is not None:
            raise ConfigurationError("--buckets is for bucket mode (--mode bucket)")
        if self.queue_type not in (None, "classic", "quorum"):
            raise ConfigurationError(
                f"queue type must be 'classic' or 'quorum', not {self.queue_type!r}"
            )


class DemoFailed(KeyqError):
    """The demo could not run to its verdict (a worker that did not start, say)."""


@dataclass
class Chaos:
    """What the chaos thread did: kills, restarts, scale changes, and failover durations.
    A step that failed has ``failed`` (why) in its action."""

    actions: list[dict[str, Any]] = field(default_factory=list)
    failovers_s: list[float] = field(default_factory=list)

    @property
    def failed_steps(self) -> int:
        return sum(1 for action in self.actions if "failed" in action)


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


class Demo:
    """One demo run; ``run()`` returns the summary (with the verdict)."""

    # Seconds between two chaos steps, drawn evenly from this range.
    chaos_pause_s: tuple[float, float] = (5.0, 10.0)

    def __init__(
        self,
        settings: Settings,
        options: DemoOptions,
        progress: Callable[[int, int], None] | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.options = options
        self.stream = options.stream or (
            "orders" if options.external_workers else f"demo-{uuid.uuid4().hex[:8]}"
        )
        self._progress = progress or (lambda done, total: None)
        self._say = say or (lambda text: None)
        self._logs = log_folder()
        self._workers: list[Daemon] = []
        self._janitor: Daemon | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._published = threading.Event()  # chaos runs while events are being published
        self.chaos = Chaos()
        self.run_tag = uuid.uuid4().hex[:6]
        self.config: StreamConfig | None = None  # the stream's, recorded before anything runs

    # ---- processes --------------------------------------------------------------------------

    def _layout_args(self) -> list[str]:
        """The ``--mode`` (and ``--buckets``) of the workers: the stream's, as recorded."""
        config = self.config
        assert config is not None  # recorded before any worker starts
        if config.mode is Mode.KEY:
            return ["--mode", "key"]
        return ["--mode", "bucket", "--buckets", str(config.buckets)]

    def _start_worker(self) -> Daemon:
        worker = Daemon(
            "worker",
            ["--stream", self.stream, "--pipeline", PIPELINE, *self._layout_args()],
            self._logs,
        )
        with self._lock:
            self._workers.append(worker)
        return worker

    def _wait_ready(self, members: Membership, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        for daemon in list(self._workers):
            while not daemon.serving(members):
                if not daemon.alive:
                    raise DemoFailed(f"{daemon.id} exited; see {daemon.log_path}")
                if time.monotonic() > deadline:
                    raise DemoFailed(f"{daemon.id} did not start; see {daemon.log_path}")
                time.sleep(0.2)

    def _chaos_loop(self, client: redis.Redis) -> None:
        """A step every few seconds while events are published: kill -9 (and maybe restart),
        add or remove a worker. A step that fails is logged and kept in the summary with why
        (``failed``), and the next step goes on: a broker that stops answering must not end
        the chaos, nor the failovers it measures, in silence."""
        rng = random.Random(self.options.seed)
        locks = FencedLocks(client, self.stream)
        registry = QueueRegistry(client, self.stream)
        members = Membership(client, self.stream, ttl_ms=1)
        while (
            not self._stop.wait(rng.uniform(*self.chaos_pause_s)) and not self._published.is_set()
        ):
            action: dict[str, Any] = {"at": time.time(), "action": "choose"}
            try:
                self._chaos_step(rng, locks, registry, members, action)
            except Exception as exc:  # noqa: BLE001 - the chaos goes on whatever one step met
                self._chaos_failed(action, exc)

    def _chaos_step(
        self,
        rng: random.Random,
        locks: FencedLocks,
        registry: QueueRegistry,
        members: Membership,
        action: dict[str, Any],
    ) -> None:
        with self._lock:
            # Only workers that are serving count: one still starting Spark is no help.
            alive = [w for w in self._workers if w.alive and w.serving(members)]
        choice = rng.choice(["kill", "kill", "restart", "add", "remove"])
        if len(alive) <= 1 and choice in ("kill", "restart", "remove"):
            choice = "add"  # never leave the stream without a serving worker
        action["action"] = choice
        if choice == "add" and len(alive) < self.options.max_workers:
            worker = self._start_worker()
            action["worker"] = worker.id
            self.chaos.actions.append(action)
        elif choice == "remove" and len(alive) > 1:
            victim = rng.choice(alive)
            action["worker"] = victim.id
            victim.stop()
            self.chaos.actions.append(action)
        elif alive and choice in ("kill", "restart"):
            victim = rng.choice(alive)
            action.update(action="kill -9", worker=victim.id)
            queues = list(registry.queues())
            held = [
                q
                for q, lease in locks.holders(queues).items()
                if lease and lease.owner == victim.id
            ]
            victim.kill()
            killed_at = time.monotonic()
            action["held"] = len(held)
            self.chaos.actions.append(action)
            if choice == "restart":
                self._start_worker()
            if held:
                try:
                    self._measure_failover(locks, victim.id, held, killed_at)
                except Exception as exc:  # noqa: BLE001 - the kill is done, its measure failed
                    self._chaos_failed(action, exc, "failover not measured")

    def _chaos_failed(self, action: dict[str, Any], exc: Exception, what: str = "") -> None:
        """One line on why a chaos step failed, in the log and in the step's action."""
        expected = isinstance(exc, SERVICE_ERRORS)
        reason = scrub(
            str(exc) if isinstance(exc, KeyqError) else describe_exception(exc),
            self.settings.amqp_url,
        )
        action["failed"] = f"{what}: {reason}" if what else reason
        if not any(existing is action for existing in self.chaos.actions):
            self.chaos.actions.append(action)
        log.warning(
            "chaos step %s failed, going on with the next: %s",
            action["action"],
            action["failed"],
            exc_info=not expected,
        )

    def _measure_failover(
        self, locks: FencedLocks, dead: str, held: list[str], killed_at: float
    ) -> None:
        """Time until every queue the dead worker held is in live hands: held by another
        worker, or, with its lock gone, holding no message (a drained key-mode queue needs no
        holder until its key speaks again). Not recorded if it takes over a minute; raises
        what keeps it from being measured (a service that does not answer)."""
        pending = set(held)
        with _ReadyCounter(self.settings) as counter:
            while time.monotonic() - killed_at < 60 and not self._stop.is_set():
                holders = locks.holders(sorted(pending))
                for queue, lease in holders.items():
                    taken_over = lease is not None and lease.owner != dead
                    if taken_over or (lease is None and counter.ready(queue) == 0):
                        pending.discard(queue)
                if not pending:
                    self.chaos.failovers_s.append(round(time.monotonic() - killed_at, 3))
                    return
                time.sleep(0.2)  # each look may declare hundreds of queues: not too often

    # ---- the run ----------------------------------------------------------------------------

    def _prepare_spark(self) -> None:
        """Build, once, the class-data archive that halves a local Spark's start (see
        ``keyq.worker.spark_classes``): the restarted worker of the chaos then takes less of
        its peers' CPU."""
        from keyq.worker.config import WorkerSettings  # noqa: PLC0415 - only for own workers
        from keyq.worker.spark_classes import archive_path, build_archive  # noqa: PLC0415

        settings = load_settings(WorkerSettings)
        if settings.spark_remote or not settings.spark_master.startswith("local"):
            return
        path = archive_path(settings)
        if path is None or path.is_file():
            return
        self._say("building Spark's class-data archive for faster worker starts (once, ~20 s)")
        build_archive(settings)

    def run(self) -> dict[str, Any]:
        options = self.options
        # Keys carry this run's tag, so a stream can host run after run (docker compose
        # keeps its state) and each run is checked against its own events only.
        events = [
            (f"{order}.{self.run_tag}", event)
            for order, event in generate_orders(options.orders, options.events, options.seed)
        ]
        expected = expected_states(events)
        counts: dict[str, int] = {}
        for order, _event in events:
            counts[order] = counts.get(order, 0) + 1
        waited = wait_for_services(
            self.settings, options.wait_for_services, say=self._say, name="demo"
        )
        if waited >= 0.5:
            self._say(f"RabbitMQ and Redis accept connections (waited {waited:.1f} s)")
        client = open_redis(self.settings)
        store = StateStore(client, self.stream)
        chaos_thread: threading.Thread | None = None
        try:
            config = self._record_config(client, len(counts))
            if not options.external_workers:
                self._prepare_spark()
                self._janitor = Daemon(
                    "janitor",
                    ["--stream", self.stream, "--idle-ttl", str(options.idle_ttl)],
                    self._logs,
                )
                for _ in range(options.workers):
                    self._start_worker()
                self._say(f"starting {options.workers} workers and a janitor (logs: {self._logs})")
                self._wait_ready(Membership(client, self.stream, ttl_ms=1))
            if options.chaos and not options.external_workers:
                chaos_thread = threading.Thread(
                    target=self._chaos_loop, args=(client,), daemon=True
                )
                chaos_thread.start()
            sample = set(
                random.Random(options.seed).sample(sorted(counts), min(LATENCY_SAMPLE, len(counts)))
            )
            sent: dict[tuple[str, int], float] = {}
            seen_seq: dict[str, int] = {}
            started = time.monotonic()
            latencies: list[float] = []
            watcher = threading.Thread(
                target=self._watch_latency, args=(store, sample, sent, latencies), daemon=True
            )
            watcher.start()
            self._say(
                f"publishing {len(events):,} events for {len(counts):,} orders "
                f"to stream {self.stream}"
            )
            with Producer(
                self.stream,
                mode=config.mode.value,
                buckets=config.buckets,
                queue_type=config.queue_type,
                settings=self.settings,
            ) as producer:
                for number, (order, event) in enumerate(events, 1):
                    seq = seen_seq.get(order, 0) + 1
                    seen_seq[order] = seq
                    if order in sample:
                        sent[(order, seq)] = time.monotonic()
                    producer.publish(order, event)
                    if options.rate > 0:
                        ahead = started + number / options.rate - time.monotonic()
                        if ahead > 0:
                            time.sleep(ahead)
                    if number % 1000 == 0:
                        self._progress(number, len(events))
                producer.flush()
                producer_stats = producer.stats
            self._progress(len(events), len(events))
            self._published.set()
            published_s = time.monotonic() - started
            self._say("published; waiting until every order is committed")
            drained_s = self._wait_drained(store, counts, started)
            self._stop.set()
            watcher.join(5)
            if chaos_thread is not None:
                chaos_thread.join(30)
            verdict = self._verdict(store, expected, counts)
            registry = QueueRegistry(client, self.stream)
            return {
                "stream": self.stream,
                "key_suffix": f".{self.run_tag}",
                "orders": options.orders,
                "events": len(events),
                "publish_events_per_s": round(len(events) / published_s),
                "end_to_end_events_per_s": round(len(events) / drained_s) if drained_s else None,
                "seconds_to_all_committed": round(drained_s, 1) if drained_s else None,
                "latency_ms": {
                    name: None if value is None else round(value * 1000)
                    for name, value in (
                        ("p50", percentile(latencies, 0.50)),
                        ("p95", percentile(latencies, 0.95)),
                        ("p99", percentile(latencies, 0.99)),
                    )
                },
                "mode": config.mode.value,
                "buckets": config.buckets,
                "queue_type": config.queue_type,
                "chaos": {
                    "actions": self.chaos.actions,
                    "failovers_s": self.chaos.failovers_s,
                    "failed_steps": self.chaos.failed_steps,
                },
                "queues_created": len({config.queue_for(order) for order in counts}),
                "queues_left": registry.count(),
                "producer": producer_stats,
                "verdict": verdict,
                "logs": str(self._logs),
            }
        finally:
            self._stop.set()
            for worker in self._workers:
                worker.stop()
            if self._janitor is not None:
                self._janitor.stop()
            client.close()

    def _record_config(self, client: redis.Redis, orders: int) -> StreamConfig:
        """Record the stream's mode, buckets and queue type before any worker or producer
        uses it (a worker started first would fix a new stream's queues as classic); an
        existing stream (``--external-workers``) must already be so."""
        options = self.options
        with redis_errors(self.settings.redis_url):
            config = ensure_stream_config(
                client,
                self.stream,
                options.mode,
                options.buckets,
                options.queue_type or self.settings.queue_type,
            )
        self.config = config
        self._say(f"stream {self.stream}: {config.describe()}")
        if (
            config.mode is Mode.KEY
            and config.queue_type == "quorum"
            and orders > QUORUM_KEYS_WARNING
        ):
            self._say(
                f"[yellow]key mode on quorum queues declares {orders:,} quorum queues, each a "
                "Raft group on every node: mind the nodes' file descriptors and memory "
                "(--mode bucket is the layout for quorum queues)[/yellow]"
            )
        return config

    def _watch_latency(
        self,
        store: StateStore,
        sample: set[str],
        sent: dict[tuple[str, int], float],
        latencies: list[float],
    ) -> None:
        """Publish-to-commit latency of a sample of orders: poll their marks and note when
        each sent seq is first seen applied."""
        applied: dict[str, int] = dict.fromkeys(sample, 0)
        orders = sorted(sample)
        while not self._stop.is_set():
            now = time.monotonic()
            marks = store.marks(orders)
            for order in orders:
                top = max(marks[order].seqs.values(), default=0)
                for seq in range(applied[order] + 1, top + 1):
                    at = sent.get((order, seq))
                    if at is not None:
                        latencies.append(now - at)
                applied[order] = max(applied[order], top)
            time.sleep(0.05)

    def _wait_drained(
        self, store: StateStore, counts: dict[str, int], started: float
    ) -> float | None:
        orders = sorted(counts)
        deadline = time.monotonic() + self.options.drain_timeout
        while time.monotonic() < deadline:
            states = store.states(orders)
            done = sum(
                1
                for order in orders
                if order in states and _applied(states[order]) >= counts[order]
            )
            if done == len(orders):
                return time.monotonic() - started
            time.sleep(0.25)
        return None

    def _verdict(
        self, store: StateStore, expected: dict[str, Any], counts: dict[str, int]
    ) -> dict[str, Any]:
        """Lost, applied twice, reordered: from each order's committed state and marks."""
        orders = sorted(counts)
        raw = store.states(orders)
        marks = store.marks(orders)
        lost = twice = reordered = 0
        wrong: list[str] = []
        for order in orders:
            state = None if order not in raw else orjson.loads(raw[order])
            applied = 0 if state is None else int(state["events_applied"])
            lost += max(0, counts[order] - applied)
            twice += max(0, applied - counts[order])
            if applied == counts[order] and state != expected.get(order):
                reordered += 1
            if state != expected.get(order):
                wrong.append(order)
            if marks[order].applied not in (0, applied):
                twice += abs(marks[order].applied - applied)
        return {
            "lost": lost,
            "applied_twice": twice,
            "reordered": reordered,
            "orders_checked": len(orders),
            "orders_wrong": wrong[:20],
            "ok": lost == twice == reordered == 0 and not wrong,
        }


def _applied(raw: str) -> int:
    return int(orjson.loads(raw).get("events_applied", 0))


class _ReadyCounter:
    """Messages ready in a queue, by passive declare on a connection of its own."""

    def __init__(self, settings: Settings) -> None:
        self._connection = open_blocking_connection(settings, "keyq-demo-failover")
        self._channel = self._connection.channel()

    def __enter__(self) -> _ReadyCounter:
        return self

    def __exit__(self, *_exc: object) -> None:
        with contextlib.suppress(Exception):  # a broken connection: dropped either way
            self._connection.close()

    def ready(self, queue: str) -> int:
        """0 for a queue that no longer exists (the janitor took it)."""
        if not self._channel.is_open:
            self._channel = self._connection.channel()
        try:
            declared = self._channel.queue_declare(queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                return 0
            raise
        return int(declared.method.message_count)
