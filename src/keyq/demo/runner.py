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

This module runs the demo; its chaos steps are ``keyq.demo.chaos``'s, and what it measures
and proves from Redis (latency, drain, verdict) is ``keyq.demo.proof``'s.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from keyq.broker.connections import open_redis, redis_errors
from keyq.broker.errors import ConfigurationError, KeyqError
from keyq.broker.membership import Membership
from keyq.broker.naming import Mode
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import StreamConfig, ensure_stream_config
from keyq.demo.chaos import Chaos, ChaosMonkey
from keyq.demo.orders import expected_states, generate_orders
from keyq.demo.processes import Daemon, log_folder
from keyq.demo.proof import latency_ms, verdict, wait_drained, watch_latency
from keyq.ops.readiness import wait_for_services
from keyq.producer import Producer
from keyq.worker.batch.state_store import StateStore

PIPELINE = "keyq.demo.orders:pipeline"
LATENCY_SAMPLE = 200
# Above this many orders, key mode on quorum queues is worth a warning: each quorum queue is a
# Raft group with file descriptors and memory on every node (2,000 of them on a node allowed
# 1,024 open files stopped it completing AMQP handshakes for over an hour).
QUORUM_KEYS_WARNING = 500


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
    mode: str = "key"  # a queue per order, "bucket": a queue per hash bucket, or "auto"
    buckets: int | None = None  # bucket, auto mode; None: the stream's, else DEFAULT_BUCKETS
    queue_type: str | None = None  # "classic" or "quorum"; None: KEYQ_QUEUE_TYPE, else classic

    def __post_init__(self) -> None:
        if self.mode not in ("key", "bucket", "auto"):
            raise ConfigurationError(
                f"demo mode must be 'key', 'bucket' or 'auto', not {self.mode!r}"
            )
        if self.mode == "key" and self.buckets is not None:
            raise ConfigurationError("--buckets is for bucket or auto mode (--mode bucket)")
        if self.queue_type not in (None, "classic", "quorum"):
            raise ConfigurationError(
                f"queue type must be 'classic' or 'quorum', not {self.queue_type!r}"
            )


class DemoFailed(KeyqError):
    """The demo could not run to its verdict (a worker that did not start, say)."""


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
        return ["--mode", config.mode.value, "--buckets", str(config.buckets)]

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

    def _serving_workers(self, members: Membership) -> list[Daemon]:
        """The workers alive and serving: one still starting Spark is no help."""
        with self._lock:
            return [w for w in self._workers if w.alive and w.serving(members)]

    def _chaos_loop(self, client: redis.Redis) -> None:
        """The chaos thread: kills, restarts and scale changes while events are published
        (see ``ChaosMonkey``), recorded in ``self.chaos``."""
        self._chaos_monkey().run(client)

    def _chaos_monkey(self) -> ChaosMonkey:
        return ChaosMonkey(
            self.settings,
            self.stream,
            self.chaos,
            seed=self.options.seed,
            max_workers=self.options.max_workers,
            pause_s=self.chaos_pause_s,
            serving_workers=self._serving_workers,
            start_worker=self._start_worker,
            stop=self._stop,
            published=self._published,
        )

    # ---- the run ----------------------------------------------------------------------------

    def _prepare_spark(self) -> None:
        """Build, once, the class-data archive that halves a local Spark's start (see
        ``keyq.worker.spark.classes``): the restarted worker of the chaos then takes less of
        its peers' CPU."""
        from keyq.worker.config import WorkerSettings  # noqa: PLC0415 - only for own workers
        from keyq.worker.spark.classes import archive_path, build_archive  # noqa: PLC0415

        settings = load_settings(WorkerSettings)
        if settings.spark_remote or not settings.spark_master.startswith("local"):
            return
        path = archive_path(settings)
        if path is None or path.is_file():
            return
        self._say("building Spark's class-data archive for faster worker starts (once, ~20 s)")
        build_archive(settings)

    def run(self) -> dict[str, Any]:
        """Start the daemons, publish, wait until every order is committed, and judge."""
        options = self.options
        # Keys carry this run's tag, so a stream can host run after run (docker compose
        # keeps its state) and each run is checked against its own events only.
        events = [
            (f"{order}.{self.run_tag}", event)
            for order, event in generate_orders(options.orders, options.events, options.seed)
        ]
        counts = Counter(order for order, _event in events)
        self._wait_for_services()
        client = open_redis(self.settings)
        store = StateStore(client, self.stream)
        try:
            config = self._record_config(client, len(counts))
            chaos_thread = self._start_daemons(client)
            sample = set(
                random.Random(options.seed).sample(sorted(counts), min(LATENCY_SAMPLE, len(counts)))
            )
            sent: dict[tuple[str, int], float] = {}
            latencies: list[float] = []
            watcher = threading.Thread(
                target=watch_latency,
                args=(store, sample, sent, latencies, self._stop),
                daemon=True,
            )
            watcher.start()
            started = time.monotonic()
            producer_stats = self._publish(config, events, sample, sent)
            published_s = time.monotonic() - started
            self._say("published; waiting until every order is committed")
            drained_s = wait_drained(store, dict(counts), started, options.drain_timeout)
            self._stop.set()
            watcher.join(5)
            if chaos_thread is not None:
                chaos_thread.join(30)
            return {
                "stream": self.stream,
                "key_suffix": f".{self.run_tag}",
                "orders": options.orders,
                "events": len(events),
                "publish_events_per_s": round(len(events) / published_s),
                "end_to_end_events_per_s": round(len(events) / drained_s) if drained_s else None,
                "seconds_to_all_committed": round(drained_s, 1) if drained_s else None,
                "latency_ms": latency_ms(latencies),
                "mode": config.mode.value,
                "buckets": config.buckets,
                "queue_type": config.queue_type,
                "chaos": self.chaos.as_dict(),
                "queues_created": len({config.queue_for(order) for order in counts}),
                "queues_left": QueueRegistry(client, self.stream).count(),
                "producer": producer_stats,
                "verdict": verdict(store, expected_states(events), dict(counts)),
                "logs": str(self._logs),
            }
        finally:
            self._stop_daemons()
            client.close()

    def _wait_for_services(self) -> None:
        waited = wait_for_services(
            self.settings, self.options.wait_for_services, say=self._say, name="demo"
        )
        if waited >= 0.5:
            self._say(f"RabbitMQ and Redis accept connections (waited {waited:.1f} s)")

    def _stop_daemons(self) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.stop()
        if self._janitor is not None:
            self._janitor.stop()

    def _start_daemons(self, client: redis.Redis) -> threading.Thread | None:
        """The janitor and the workers, unless they run already, and the chaos thread."""
        options = self.options
        if options.external_workers:
            return None
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
        if not options.chaos:
            return None
        chaos_thread = threading.Thread(target=self._chaos_loop, args=(client,), daemon=True)
        chaos_thread.start()
        return chaos_thread

    def _publish(
        self,
        config: StreamConfig,
        events: list[tuple[str, dict[str, Any]]],
        sample: set[str],
        sent: dict[tuple[str, int], float],
    ) -> dict[str, Any]:
        """Publish every event at ``options.rate``, noting when each sampled order's events
        left; returns the producer's stats."""
        options = self.options
        orders = len({order for order, _event in events})
        self._say(
            f"publishing {len(events):,} events for {orders:,} orders to stream {self.stream}"
        )
        seen_seq: dict[str, int] = {}
        started = time.monotonic()
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
            stats: dict[str, Any] = producer.stats
        self._progress(len(events), len(events))
        self._published.set()
        return stats

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
