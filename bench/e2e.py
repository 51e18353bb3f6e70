"""End to end: publish → worker → Spark → committed keyed state, against raw pika.

One run measures, on the same broker:

* ``raw_pika_unconfirmed``: the publish ceiling (as in ``bench.producer``), events/s.
* ``e2e``: one keyq producer and two worker processes (bucket mode, production defaults); the
  clock runs from the first publish until every event's state is committed. events/s. The
  workers are warmed up first with an untimed load (``--warmup-events``).
* ``spark_batch``: the Spark part of one 5,000-event batch (DataFrame via Arrow, the keyed
  fold, results back), in this process, median of repeats.
* ``failover``: with a trickle of events on every key, kill -9 a worker holding queues; the
  time until the first event of one of its queues is committed by another worker. Repeated
  ``--kills`` times, a replacement started each time.
* ``rebalance``: each replacement's time from ready (Spark up) to holding its fair share.

Progress goes to stderr; one JSON object to stdout (and ``--out``).

Usage: ``python -m bench.e2e [--events N] [--keys K] [--buckets B] [--kills K] [--out FILE]``
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from bench.common import (
    Cleanup,
    amqp,
    declare_queues,
    emit,
    finish_run,
    log,
    machine_info,
    median,
    ratio,
)
from bench.producer import publish_raw
from keyq import Producer
from keyq.broker.connections import open_redis
from keyq.broker.errors import KeyqError
from keyq.broker.locks import FencedLocks
from keyq.broker.membership import Membership, fair_share
from keyq.broker.naming import Mode
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import StreamConfig
from keyq.broker.topology import keyed_queue_arguments
from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.batch.decoding import Event
from keyq.worker.batch.state_store import StateStore
from keyq.worker.config import WorkerSettings
from keyq.worker.pipeline import KeyedState
from keyq.worker.spark.engine import SparkEngine, batch_table

REPO = Path(__file__).resolve().parent.parent
PIPELINE = "bench.pipelines:count"


class WorkerProcess:
    """``python -m keyq worker`` for the benchmark's stream."""

    def __init__(
        self,
        stream: str,
        buckets: int,
        log_dir: Path,
        pipeline: str = PIPELINE,
        mode: str = "bucket",
        env: dict[str, str] | None = None,
    ) -> None:
        self.worker_id = f"bench-{uuid.uuid4().hex[:8]}"
        self.stream = stream
        self.log_path = log_dir / f"{self.worker_id}.log"
        self._log = self.log_path.open("wb")
        environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "keyq",
                "worker",
                "--stream",
                stream,
                "--pipeline",
                pipeline,
                "--mode",
                mode,
                *(["--buckets", str(buckets)] if mode == "bucket" else []),
                "--worker-id",
                self.worker_id,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=environment,
            cwd=REPO,
        )

    def wait_ready(self, timeout: float = 120) -> float:
        """When the worker says in Redis that its first claim round is done."""
        client = open_redis(load_settings())
        try:
            membership = Membership(client, self.stream, ttl_ms=1)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"worker exited: {self.log_path.read_text()[-2000:]}")
                if membership.serving(self.worker_id):
                    return time.monotonic()
                time.sleep(0.05)
        finally:
            client.close()
        raise RuntimeError("worker did not start in time")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def measure_raw(
    settings: Settings, events: list[tuple[str, dict[str, Any]]], buckets: int
) -> float:
    """The publish ceiling; its queues are removed by a cleanup of its own (the run's
    cleanup must still know the e2e stream at the end)."""
    stream = f"bench-raw-{uuid.uuid4().hex[:6]}"
    config = StreamConfig(stream=stream, mode=Mode.BUCKET, buckets=buckets)
    queue_of = {key: config.queue_for(key) for key, _ in events}
    queues = sorted(set(queue_of.values()))
    cleanup = Cleanup(settings)
    cleanup.add_queues(queues)
    try:
        declare_queues(settings, queues, keyed_queue_arguments(stream))
        with amqp(settings, "bench-raw") as connection:
            channel = connection.channel()
            started = time.perf_counter()
            publish_raw(channel, stream, events, queue_of, mandatory=False)
            channel.basic_qos(prefetch_count=0)  # a round trip: everything was sent
            elapsed = time.perf_counter() - started
    finally:
        cleanup.run()
    return len(events) / elapsed


def committed_total(client: redis.Redis, stream: str) -> int:
    """Events applied so far, summed over the workers' last heartbeats."""
    infos = Membership(client, stream, 1000).info()
    return sum(int(str(info.get("events", 0))) for info in infos.values())


def applied_of(store: StateStore, keys: Sequence[str]) -> int:
    """Events applied to ``keys`` so far (one round trip)."""
    return sum(int(raw) for raw in store.states(keys).values())


def measure_e2e(
    settings: Settings,
    client: redis.Redis,
    stream: str,
    events: list[tuple[str, dict[str, Any]]],
    buckets: int,
) -> tuple[float, float]:
    """(events/s from first publish to all committed, seconds to publish all)."""
    store = StateStore(client, stream)
    keys = sorted({key for key, _ in events})
    before = applied_of(store, keys)
    started = time.perf_counter()
    with Producer(stream, mode="bucket", buckets=buckets, settings=settings) as producer:
        for key, event in events:
            producer.publish(key, event)
        producer.flush()
    published = time.perf_counter() - started
    target = before + len(events)
    deadline = time.monotonic() + 600
    while applied_of(store, keys) < target:
        if time.monotonic() > deadline:
            raise RuntimeError("events were not all committed within 10 minutes")
        time.sleep(0.05)
    elapsed = time.perf_counter() - started
    return len(events) / elapsed, published


def measure_spark(settings: Settings, client: redis.Redis, batch: int, repeats: int) -> list[float]:
    stream = f"bench-spark-{uuid.uuid4().hex[:6]}"
    worker_settings = load_settings(WorkerSettings)
    partitions = worker_settings.spark_shuffle_partitions
    engine = SparkEngine(worker_settings, "keyq-bench-spark")
    engine.start()
    store = StateStore(client, stream)
    timings = []
    try:
        for repeat in range(repeats):
            events = [
                Event(
                    Delivery(f"q{i % 16}", 1, i + 1, False, {}, None, f"m{i}", b"{}"),
                    f"key-{(i * 7919 + repeat) % 1000}",
                    "bench",
                    i + 1,
                    None,
                    '{"n": 1}',
                )
                for i in range(batch)
            ]
            keys = sorted({e.key for e in events})
            started = time.perf_counter()
            frame = engine.dataframe(batch_table(stream, events))
            state = KeyedState(store, keys, partitions)
            state.fold(frame, lambda s, e: (s or 0) + 1).toArrow()
            timings.append(time.perf_counter() - started)
    finally:
        engine.stop()
    return timings


class Trickle(threading.Thread):
    """A steady trickle of events to every key, so every queue always has work."""

    def __init__(self, settings: Settings, stream: str, buckets: int, keys: list[str]) -> None:
        super().__init__(daemon=True)
        self._settings, self._stream, self._buckets, self._keys = settings, stream, buckets, keys
        self.stop = threading.Event()

    def run(self) -> None:
        with Producer(
            self._stream, mode="bucket", buckets=self._buckets, settings=self._settings
        ) as producer:
            while not self.stop.is_set():
                for key in self._keys:
                    producer.publish(key, {"t": time.time()})
                self.stop.wait(0.05)


def measure_failover(
    settings: Settings,
    client: redis.Redis,
    stream: str,
    buckets: int,
    workers: list[WorkerProcess],
    kills: int,
    log_dir: Path,
) -> tuple[list[float], list[float]]:
    config = StreamConfig(stream=stream, mode=Mode.BUCKET, buckets=buckets)
    keys_of: dict[str, list[str]] = {}
    for n in range(buckets * 20):
        key = f"trickle-{n}"
        keys_of.setdefault(config.queue_for(key), []).append(key)
    one_key_per_queue = [keys[0] for keys in keys_of.values()]
    trickle = Trickle(settings, stream, buckets, one_key_per_queue)
    trickle.start()
    store = StateStore(client, stream)
    locks = FencedLocks(client, stream)
    registry = QueueRegistry(client, stream)
    failovers: list[float] = []
    rebalances: list[float] = []
    try:
        time.sleep(3)
        for kill in range(kills):
            queues = list(registry.queues())
            holders = locks.holders(queues)
            by_owner: dict[str, list[str]] = {}
            for queue, lease in holders.items():
                if lease is not None:
                    by_owner.setdefault(lease.owner, []).append(queue)
            victim = next(w for w in workers if by_owner.get(w.worker_id))
            victim_keys = [keys_of[q][0] for q in by_owner[victim.worker_id] if q in keys_of]
            victim.kill()
            killed_at = time.perf_counter()
            log(f"killed {victim.worker_id} holding {len(victim_keys)} queues")
            baseline = {key: int(raw) for key, raw in store.states(victim_keys).items()}
            while True:
                now = store.states(victim_keys)
                if any(int(raw) > baseline.get(key, 0) for key, raw in now.items()):
                    break
                if time.perf_counter() - killed_at > 60:
                    raise RuntimeError("a killed worker's queues were not taken over in 60 s")
                time.sleep(0.01)
            failovers.append(time.perf_counter() - killed_at)
            workers.remove(victim)
            victim.stop()
            log(f"kill {kill + 1}/{kills}: failover {failovers[-1]:.2f} s")
            replacement = WorkerProcess(stream, buckets, log_dir)
            workers.append(replacement)
            ready_at = replacement.wait_ready()
            members = [w.worker_id for w in workers]
            share = fair_share(len(queues), members, replacement.worker_id)
            while True:
                held = [
                    q
                    for q, lease in locks.holders(queues).items()
                    if lease is not None and lease.owner == replacement.worker_id
                ]
                if len(held) >= share:
                    break
                if time.monotonic() - ready_at > 60:
                    raise RuntimeError("a new worker did not get its fair share in 60 s")
                time.sleep(0.02)
            rebalances.append(time.monotonic() - ready_at)
            log(f"replacement held its share of {share} in {rebalances[-1]:.2f} s")
    finally:
        trickle.stop.set()
        trickle.join(10)
    return failovers, rebalances


def summary(values: Sequence[float]) -> dict[str, Any]:
    return {
        "runs": [round(v, 3) for v in values],
        "median": None if not values else round(median(values) or 0, 3),
        "max": None if not values else round(max(values), 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__)
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--buckets", type=int, default=16)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument(
        "--warmup-events", type=int, default=50_000, help="untimed load before the e2e run"
    )
    parser.add_argument("--spark-repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.spark_repeats < 2:
        parser.error("--spark-repeats must be at least 2 (the first run only warms Spark up)")

    settings = load_settings()
    machine = machine_info()
    cleanup = Cleanup(settings)
    client = open_redis(settings)
    events = [(f"key-{i % args.keys}", {"n": i, "pad": "x" * 120}) for i in range(args.events)]
    params = {**vars(args), "out": str(args.out) if args.out else None}
    result: dict[str, Any] = {"benchmark": "e2e", "machine": machine, "params": params}
    errors: list[str] = []
    workers: list[WorkerProcess] = []
    stream = f"bench-e2e-{uuid.uuid4().hex[:6]}"
    cleanup.add_stream(stream)
    log_dir = Path(tempfile.mkdtemp(prefix="keyq-bench-"))
    try:
        spark = measure_spark(settings, client, 5000, args.spark_repeats)
        result["spark_batch_5000_s"] = summary(spark[1:])  # the first includes JIT warm-up
        log(f"spark per 5,000-event batch: median {median(spark[1:]):.3f} s")
        raw = measure_raw(settings, events, args.buckets)
        log(f"raw pika unconfirmed: {raw:,.0f} events/s")
        workers = [WorkerProcess(stream, args.buckets, log_dir) for _ in range(2)]
        for worker in workers:
            worker.wait_ready()
        if args.warmup_events:
            # Untimed: a fresh JVM spends its first dozens of jobs compiling Spark's hot
            # paths (the CPU per job falls about fivefold over the first ~50 jobs); long-running
            # workers are measured in their steady state.
            warm, _ = measure_e2e(
                settings, client, stream, events[: args.warmup_events], args.buckets
            )
            log(f"warm-up: {warm:,.0f} events/s")
        e2e, publish_s = measure_e2e(settings, client, stream, events, args.buckets)
        log(f"end to end: {e2e:,.0f} events/s (publishing took {publish_s:.1f} s)")
        time.sleep(1)  # one more heartbeat, so the workers' figures include the last batch
        infos = Membership(client, stream, 1000).info()
        result["e2e_workers"] = [
            {name: info.get(name) for name in ("events", "batches", "spark_seconds")}
            for info in infos.values()
        ]
        log(f"workers: {result['e2e_workers']}")
        result["raw_pika_unconfirmed_events_per_s"] = round(raw)
        result["e2e_events_per_s"] = round(e2e)
        result["e2e_over_raw"] = round(ratio(e2e, raw) or 0, 3)
        result["e2e_publish_seconds"] = round(publish_s, 2)
        if args.kills:
            failovers, rebalances = measure_failover(
                settings, client, stream, args.buckets, workers, args.kills, log_dir
            )
            result["failover_s"] = summary(failovers)
            result["rebalance_to_fair_share_s"] = summary(rebalances)
    except (KeyqError, RuntimeError, redis.RedisError, OSError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        finish_run(workers, cleanup, client, errors)
    result["errors"] = errors
    result["worker_logs"] = str(log_dir)
    emit(result, args.out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
