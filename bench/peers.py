"""keyq against the ways a user would otherwise process keyed events, on the same broker.

* ``shared_queue``: the naive way. One durable queue, competing consumers (prefetch 100).
  Fast, but two consumers hold events of one key at once: per-key order violations counted.
* ``chash_sac``: RabbitMQ's built-in way. A consistent-hash exchange routes each key to one of
  ``--queues`` durable queues declared with single-active-consumer; every consumer subscribes
  to all of them and the broker lets one consumer at a time take each queue.
* ``keyq``: bucket mode (``--queues`` buckets), then key mode (a queue per key) on a stream of
  its own, two worker processes with the production defaults, folding a keyed count in Spark
  and committing it exactly once to Redis. Each keyq run also reports where its batches spent
  their time (decode and order, Spark, fenced commit, ack, registry touch), per batch.

Baseline consumers are separate processes (``bench.peer_consumer``) that apply each event to
an in-memory count and ack it: a lower bound on their work (keyq also commits state durably).
Each system is measured the same way, in one run:

* ``throughput``: ``--events`` events over ``--keys`` keys published flat out; events/s from
  the first publish to the last event applied.
* ``latency``: ``--rate`` events/s for ``--seconds`` s; publish → applied percentiles. For keyq
  "applied" is "committed": a poller reads the keyed counts every 20 ms.
* ``failover``: kill -9 one of two consumers during a paced run; time until a queue it was
  consuming delivers again, and the order violations and duplicates that followed (keyq's
  failover is measured by ``bench.e2e``).
* ``scale_out``: a second consumer joins a running one; how many queues it receives events
  from in the second half of a paced run (keyq's time to fair share is in ``bench.e2e``).

Keys are drawn Zipf-skewed, as in real traffic: a few hot keys carry much of the load.

Progress on stderr; one JSON object on stdout (and ``--out``).

Usage: ``python -m bench.peers [--events N] [--keys K] [--queues Q] [--rate R] [--seconds S]
[--keyq-only] [--out FILE]``
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pika
import redis

from bench.common import Cleanup, amqp, emit, finish_run, log, machine_info, ratio
from bench.e2e import WorkerProcess
from keyq import Producer
from keyq.broker.connections import open_redis
from keyq.broker.errors import KeyqError
from keyq.broker.membership import Membership
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.settings import Settings, load_settings
from keyq.worker.batch.stats import STAGES

REPO = Path(__file__).resolve().parent.parent
PREFETCH = 100


@dataclass(frozen=True)
class Applied:
    key: str
    n: int
    published: float
    applied: float
    queue: str


class Consumers:
    """Baseline consumer processes and what they recorded."""

    def __init__(self, settings: Settings, queues: Sequence[str], folder: Path) -> None:
        self._settings = settings
        self._queues = list(queues)
        self._folder = folder
        self.processes: list[subprocess.Popen[bytes]] = []
        self.records: list[Path] = []

    def add(self) -> int:
        index = len(self.processes)
        record = self._folder / f"consumer-{uuid.uuid4().hex[:8]}.txt"
        record.touch()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.peer_consumer",
                self._settings.amqp_url,
                str(record),
                str(PREFETCH),
                *self._queues,
            ],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=REPO,
        )
        assert process.stdout is not None
        process.stdout.readline()  # "consuming"
        self.processes.append(process)
        self.records.append(record)
        return index

    def kill(self, index: int) -> float:
        self.processes[index].send_signal(signal.SIGKILL)
        killed = time.time()
        self.processes[index].wait(10)
        return killed

    def applied(self, index: int | None = None) -> list[Applied]:
        found: list[Applied] = []
        paths = self.records if index is None else [self.records[index]]
        for path in paths:
            for line in path.read_text().splitlines():
                parts = line.split(" ")
                if len(parts) == 5:
                    key, n, published, applied, queue = parts
                    found.append(Applied(key, int(n), float(published), float(applied), queue))
        return sorted(found, key=lambda item: item.applied)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()


def keyed_events(count: int, keys: int, seed: int = 1) -> list[tuple[str, int]]:
    """(key, n): keys drawn Zipf-skewed (a few hot keys, a long tail, like real traffic),
    each key's events numbered 1, 2, 3..."""
    rng = random.Random(seed)
    names = [f"k{rank}" for rank in range(keys)]
    weights = [1.0 / (rank + 1) for rank in range(keys)]
    numbers: dict[str, int] = {}
    events = []
    for key in rng.choices(names, weights, k=count):
        numbers[key] = numbers.get(key, 0) + 1
        events.append((key, numbers[key]))
    return events


def paced(events: Sequence[tuple[str, int]], rate: float | None) -> Any:
    """Yield events, no faster than ``rate`` per second when given."""
    started = time.monotonic()
    for index, event in enumerate(events):
        if rate:
            pause = started + index / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        yield event


def publish_baseline(
    settings: Settings,
    route: Callable[[str], tuple[str, str]],
    events: Sequence[tuple[str, int]],
    rate: float | None = None,
) -> None:
    """Persistent messages with publisher confirms off (as fast as pika goes)."""
    properties = pika.BasicProperties(delivery_mode=2, content_type="application/json")
    with amqp(settings, "bench-peers") as connection:
        channel = connection.channel()
        for key, n in paced(events, rate):
            exchange, routing_key = route(key)
            body = orjson.dumps({"k": key, "n": n, "t": time.time()})
            channel.basic_publish(exchange, routing_key, body, properties)
        connection.process_data_events(0)


def order_report(applied: Sequence[Applied]) -> dict[str, int]:
    """Per key, in the order events were applied: duplicates, and events applied after a
    later event of the same key (order violations)."""
    highest: dict[str, int] = {}
    seen: set[tuple[str, int]] = set()
    duplicates = violations = 0
    for item in applied:
        if (item.key, item.n) in seen:
            duplicates += 1
            continue
        seen.add((item.key, item.n))
        if item.n < highest.get(item.key, 0):
            violations += 1
        highest[item.key] = max(highest.get(item.key, 0), item.n)
    return {"applied": len(seen), "duplicates": duplicates, "order_violations": violations}


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    ordered = sorted(values)

    def at(share: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(share * len(ordered)))], 4)

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99), "max": round(ordered[-1], 4)}


def wait_applied(count: Callable[[], int], target: int, timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    while count() < target:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {count()} of {target} events applied in {timeout:.0f} s")
        time.sleep(0.02)
    return time.time()


# --------------------------------------------------------------------------- baselines
class Baseline:
    """One baseline topology: declared, consumed, measured, deleted."""

    def __init__(self, name: str, settings: Settings, queues: int, folder: Path) -> None:
        self.name = name
        self.settings = settings
        tag = uuid.uuid4().hex[:6]
        self.exchange = f"bench-peers-{tag}-chash"
        if name == "shared_queue":
            self.queues = [f"bench-peers-{tag}-shared"]
        else:
            self.queues = [f"bench-peers-{tag}-q{index:02d}" for index in range(queues)]
        self.folder = folder

    def declare(self) -> None:
        with amqp(self.settings, "bench-peers") as connection:
            channel = connection.channel()
            if self.name == "shared_queue":
                channel.queue_declare(self.queues[0], durable=True)
                return
            channel.exchange_declare(self.exchange, "x-consistent-hash", durable=True)
            for queue in self.queues:
                channel.queue_declare(
                    queue, durable=True, arguments={"x-single-active-consumer": True}
                )
                channel.queue_bind(queue, self.exchange, routing_key="1")  # equal weights

    def delete(self) -> None:
        with amqp(self.settings, "bench-peers") as connection:
            channel = connection.channel()
            for queue in self.queues:
                channel.queue_delete(queue)
            if self.name != "shared_queue":
                channel.exchange_delete(self.exchange)

    def route(self, key: str) -> tuple[str, str]:
        if self.name == "shared_queue":
            return "", self.queues[0]
        return self.exchange, key

    def consumers(self) -> Consumers:
        return Consumers(self.settings, self.queues, self.folder)

    def run(
        self, events: Sequence[tuple[str, int]], rate: float | None, consumers: int = 2
    ) -> dict[str, Any]:
        group = self.consumers()
        try:
            for _ in range(consumers):
                group.add()
            started = time.time()
            publish_baseline(self.settings, self.route, events, rate)
            done = wait_applied(lambda: len(group.applied()), len(events))
            applied = group.applied()
        finally:
            group.stop()
        result = order_report(applied)
        result["events_per_s"] = round(len(events) / (done - started))
        result["latency_s"] = percentiles(
            [item.applied - item.published for item in dict_first(applied)]
        )
        return result

    def failover(self, events: Sequence[tuple[str, int]], rate: float) -> dict[str, Any]:
        """Kill -9 one of two consumers a third of the way through a paced run."""
        group = self.consumers()
        try:
            group.add()
            group.add()
            kill_after = len(events) // 3
            publish_baseline(self.settings, self.route, events[:kill_after], rate)
            time.sleep(0.5)
            owned = {item.queue for item in group.applied(0)}
            killed = group.kill(0)
            publish_baseline(self.settings, self.route, events[kill_after:], rate)
            wait_applied(lambda: len({(a.key, a.n) for a in group.applied()}), len(events))
            resumed = [
                a.applied for a in group.applied(1) if a.queue in owned and a.applied > killed
            ]
            result = order_report(group.applied())
        finally:
            group.stop()
        result["queues_of_killed_consumer"] = len(owned)
        result["failover_s"] = round(min(resumed) - killed, 4) if resumed else None
        return result

    def scale_out(self, events: Sequence[tuple[str, int]], rate: float) -> dict[str, Any]:
        """A second consumer joins a running one: how many queues does it get?"""
        group = self.consumers()
        try:
            group.add()
            half = len(events) // 2
            publish_baseline(self.settings, self.route, events[:half], rate)
            group.add()
            publish_baseline(self.settings, self.route, events[half:], rate)
            wait_applied(lambda: len(group.applied()), len(events))
            newcomer = group.applied(1)
        finally:
            group.stop()
        return {
            "queues": len(self.queues),
            "queues_active_on_new_consumer": len({item.queue for item in newcomer}),
            "events_on_new_consumer": len(newcomer),
            "seconds_observed": round(len(events) / 2 / rate, 1),
        }


def dict_first(applied: Sequence[Applied]) -> list[Applied]:
    """The first application of each event."""
    first: dict[tuple[str, int], Applied] = {}
    for item in applied:
        first.setdefault((item.key, item.n), item)
    return list(first.values())


# ------------------------------------------------------------------------------- keyq
def keyq_states(client: redis.Redis, stream: str) -> dict[str, tuple[int, int, int]]:
    """key -> (events applied, highest n, order violations), as ``ordered_count`` folds."""
    raw: dict[Any, Any] = client.hgetall(StreamKeys(stream).state)  # type: ignore[assignment]
    states = {}
    for key, value in raw.items():
        count, last, violations = orjson.loads(value)
        states[key.decode() if isinstance(key, bytes) else key] = (count, last, violations)
    return states


def keyq_counts(client: redis.Redis, stream: str) -> dict[str, int]:
    return {key: state[0] for key, state in keyq_states(client, stream).items()}


class CommitPoller(threading.Thread):
    """Reads the keyed counts every 20 ms while events are published, and notes when each
    published event is first seen committed (its key's count reached its number)."""

    def __init__(self, client: redis.Redis, stream: str, before: dict[str, int]) -> None:
        super().__init__(name="commit-poller", daemon=True)
        self.client = client
        self.stream = stream
        self.before = before
        self.lock = threading.Lock()
        self.published: dict[str, list[float]] = {}
        self.done: dict[str, int] = {}  # events of the key seen committed in this run
        self.latencies: list[float] = []
        self.finished = 0.0
        self.stop_event = threading.Event()

    def publishing(self, key: str) -> None:
        with self.lock:
            self.published.setdefault(key, []).append(time.time())

    def poll(self) -> None:
        now = time.time()
        counts = keyq_counts(self.client, self.stream)
        with self.lock:
            for key, times in self.published.items():
                seen = counts.get(key, 0) - self.before.get(key, 0)
                done = self.done.get(key, 0)
                while done < min(seen, len(times)):
                    self.latencies.append(now - times[done])
                    done += 1
                    self.finished = now
                self.done[key] = done

    def committed(self) -> int:
        with self.lock:
            return sum(self.done.values())

    def run(self) -> None:
        while not self.stop_event.wait(0.02):
            self.poll()


def worker_time(client: redis.Redis, stream: str) -> dict[str, float]:
    """The stream's live workers' batches, events and seconds per batch stage, summed (from
    what each worker reports with its heartbeat)."""
    totals: dict[str, float] = {"batches": 0, "events": 0}
    for info in Membership(client, stream, ttl_ms=1).info().values():
        totals["batches"] += float(info.get("batches", 0))  # type: ignore[arg-type]
        totals["events"] += float(info.get("events", 0))  # type: ignore[arg-type]
        stages = info.get("stage_seconds") or {}
        for stage, seconds in stages.items():  # type: ignore[union-attr]
            totals[stage] = totals.get(stage, 0.0) + float(seconds)
    return totals


def breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Where a run's batches spent their time: per batch, in ms, by stage."""
    batches = after["batches"] - before["batches"]
    if batches <= 0:
        return {"batches": 0}
    result: dict[str, Any] = {
        "batches": int(batches),
        "events_per_batch": round((after["events"] - before["events"]) / batches, 1),
    }
    for stage in STAGES:
        spent = after.get(stage, 0.0) - before.get(stage, 0.0)
        result[f"{stage}_ms_per_batch"] = round(1000 * spent / batches, 1)
    return result


def run_keyq(
    settings: Settings,
    client: redis.Redis,
    stream: str,
    buckets: int,
    events: Sequence[tuple[str, int]],
    rate: float | None,
    mode: str = "bucket",
) -> dict[str, Any]:
    """Publish with the SDK while a poller notes when each event's count is committed."""
    time.sleep(0.6)  # the workers' last heartbeats carry their counters up to now
    spent_before = worker_time(client, stream)
    before = keyq_counts(client, stream)
    violations_before = sum(state[2] for state in keyq_states(client, stream).values())
    poller = CommitPoller(client, stream, before)
    poller.start()
    started = time.time()
    try:
        bucketed = {"buckets": buckets} if mode == "bucket" else {}
        with Producer(stream, mode=mode, settings=settings, **bucketed) as producer:
            for key, n in paced(events, rate):
                poller.publishing(key)
                # numbered on from this key's earlier runs, so the order check spans runs
                producer.publish(key, {"k": key, "n": n + before.get(key, 0)})
            producer.flush()
        wait_applied(poller.committed, len(events))
    finally:
        poller.stop_event.set()
        poller.join(5)
    time.sleep(0.6)
    return {
        "events_per_s": round(len(events) / (poller.finished - started)),
        "latency_s": percentiles(poller.latencies),
        "order_violations": sum(state[2] for state in keyq_states(client, stream).values())
        - violations_before,
        "batches": breakdown(spent_before, worker_time(client, stream)),
    }


def run_keyq_mode(
    settings: Settings,
    client: redis.Redis,
    cleanup: Cleanup,
    folder: Path,
    mode: str,
    buckets: int,
    flat: Sequence[tuple[str, int]],
    paced_events: Sequence[tuple[str, int]],
    rate: float,
) -> dict[str, Any]:
    """keyq in one mode on a stream of its own, two workers: warm-up, throughput, latency."""
    stream = f"bench-peers-{mode}-{uuid.uuid4().hex[:6]}"
    cleanup.add_stream(stream)
    workers = [
        WorkerProcess(stream, buckets, folder, "bench.pipelines:ordered_count", mode=mode)
        for _ in range(2)
    ]
    try:
        for worker in workers:
            worker.wait_ready()
        log(f"keyq ({mode} mode): warm-up")
        run_keyq(settings, client, stream, buckets, flat, None, mode)  # JIT warm-up, untimed
        log(f"keyq ({mode} mode): throughput")
        entry = {"throughput": run_keyq(settings, client, stream, buckets, flat, None, mode)}
        log(f"keyq ({mode} mode): latency at {rate:.0f}/s")
        entry["latency"] = run_keyq(settings, client, stream, buckets, paced_events, rate, mode)
        log(f"keyq ({mode} mode): {orjson.dumps(entry).decode()}")
        return entry
    finally:
        for worker in workers:
            worker.stop()


# ------------------------------------------------------------------------------- main
def ensure_consistent_hash_exchange(settings: Settings) -> str | None:
    """None if the broker knows the x-consistent-hash exchange type, else why not. Tries
    ``rabbitmq-plugins enable`` on a local broker once."""
    name = f"bench-peers-probe-{uuid.uuid4().hex[:6]}"

    def probe() -> bool:
        # An unknown exchange type is a connection error (503): use a connection of its own.
        connection = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
        try:
            channel = connection.channel()
            channel.exchange_declare(name, "x-consistent-hash", auto_delete=True)
            channel.exchange_delete(name)
            return True
        except (pika.exceptions.ChannelClosedByBroker, pika.exceptions.ConnectionClosedByBroker):
            return False
        finally:
            if connection.is_open:
                connection.close()

    if probe():
        return None
    try:
        subprocess.run(
            ["rabbitmq-plugins", "enable", "rabbitmq_consistent_hash_exchange"],
            check=True,
            capture_output=True,
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"rabbitmq_consistent_hash_exchange is not enabled and could not be: {exc}"
    return None if probe() else "rabbitmq_consistent_hash_exchange did not load"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__)
    parser.add_argument("--events", type=int, default=30_000)
    parser.add_argument("--keys", type=int, default=500)
    parser.add_argument("--queues", type=int, default=16)
    parser.add_argument("--rate", type=float, default=1000.0, help="paced runs, events/s")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of paced runs")
    parser.add_argument("--keyq-only", action="store_true", help="skip the baselines")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    settings = load_settings()
    result: dict[str, Any] = {
        "benchmark": "peers",
        "machine": machine_info(),
        "params": {**vars(args), "out": str(args.out) if args.out else None},
    }
    errors: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="keyq-bench-peers-"))
    flat = keyed_events(args.events, args.keys)
    paced_events = keyed_events(int(args.rate * args.seconds), args.keys)
    cleanup = Cleanup(settings)
    client = open_redis(settings)
    try:
        missing = ensure_consistent_hash_exchange(settings)
        systems = ["shared_queue"] + (["chash_sac"] if missing is None else [])
        if args.keyq_only:
            systems = []
        if missing:
            errors.append(missing)
        for name in systems:
            baseline = Baseline(name, settings, args.queues, folder)
            baseline.declare()
            try:
                log(f"{name}: throughput")
                entry = {"throughput": baseline.run(flat, None)}
                log(f"{name}: latency at {args.rate:.0f}/s")
                entry["latency"] = baseline.run(paced_events, args.rate)
                log(f"{name}: failover")
                entry["failover"] = baseline.failover(paced_events, args.rate)
                log(f"{name}: scale out")
                entry["scale_out"] = baseline.scale_out(paced_events, args.rate)
                result[name] = entry
                log(f"{name}: {orjson.dumps(entry).decode()}")
            finally:
                baseline.delete()

        for mode in ("bucket", "key"):
            keyq_entry = run_keyq_mode(
                settings, client, cleanup, folder, mode, args.queues, flat, paced_events, args.rate
            )
            result["keyq" if mode == "bucket" else "keyq_key_mode"] = keyq_entry
        for name in systems:
            result[name]["throughput"]["keyq_over_this"] = round(
                ratio(
                    result["keyq"]["throughput"]["events_per_s"],
                    result[name]["throughput"]["events_per_s"],
                )
                or 0,
                3,
            )
    except (KeyqError, RuntimeError, redis.RedisError, OSError, pika.exceptions.AMQPError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        finish_run([], cleanup, client, errors)  # each mode stops its own workers
    result["errors"] = errors
    emit(result, args.out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
