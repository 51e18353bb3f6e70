"""CPU per 1,000 events, end to end, with packing off and on, by process.

Each round runs one stream of its own: ``--workers`` ``keyq worker`` processes
(``bench.pipelines:count``), an untimed warm-up load (a fresh JVM spends its first dozens of
Spark jobs compiling), then ``--events`` order events over ``--keys`` orders, Zipf-skewed as
the demo's (``keyq.demo.orders.generate_orders``), published flat out by a ``Producer`` in a
process of its own. The measured interval runs from the first publish until every event's
state is committed. Over it, the CPU (``/proc/<pid>/stat``, utime + stime, exited children
included) of:

* ``broker``: the RabbitMQ node ``KEYQ_AMQP_URL`` names (the process listening on its port);
  the whole node, so anything else using it meanwhile is counted too (see ``idle_cores``);
* ``producer``: the publishing process (its own interpreter, its I/O thread);
* ``workers``: each worker's process tree, also split into ``workers_python`` (the worker and
  Spark's Python workers) and ``workers_jvm`` (its Spark JVM);
* ``redis``: the Redis server ``KEYQ_REDIS_URL`` names (the whole server, too).

Packing is off (``KEYQ_PACK_MAX_EVENTS=1``) and on (``--pack-on``, the default setting) for
the producer and the workers alike; rounds alternate off and on, ``--rounds`` of each. Each
figure is the median over a mode's rounds, and ``on_over_off`` their ratios. Before each
measured load the services' and workers' CPU is read over ``--idle-seconds`` with nothing
published, as ``idle_cores``: what the figures include that is not this load.

The benchmark only reads the services' processes; it never restarts or reconfigures them.
Its queues and Redis keys are removed after each round.

Progress on stderr; one JSON object on stdout (and ``--out``).

In ``--mode bucket`` and ``auto`` keys share ``--buckets`` queues (in auto mode a key the
workers promote gets a queue of its own); the stream's config is recorded before its workers
start, so that they adopt its bucket count.

Usage: ``python -m bench.cpu_per_event [--events N] [--keys K] [--mode key|bucket|auto]
[--rounds R] [--out FILE]``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson
import redis

from bench import proc_cpu
from bench.common import (
    Cleanup,
    emit,
    log,
    machine_info,
    measure_then_clean,
    median,
    non_negative,
    positive,
    ratio,
)
from bench.e2e import WorkerProcess
from bench.service_process import service_pid
from keyq import Producer
from keyq.broker.connections import open_redis
from keyq.broker.naming import Mode
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import ensure_stream_config
from keyq.demo.orders import generate_orders
from keyq.worker.batch.state_store import StateStore

REPO = Path(__file__).resolve().parent.parent
PIPELINE = "bench.pipelines:count"
PACK_ENV = "KEYQ_PACK_MAX_EVENTS"
PACK_DEFAULT = int(Settings.model_fields["pack_max_events"].default)
PARTS = ("broker", "producer", "workers_python", "workers_jvm", "workers", "redis")
COMMIT_TIMEOUT_S = 600.0


# ------------------------------------------------------------------------- the services
# ------------------------------------------------------------------------ the producer
def keyed_load(events: int, keys: int, seed: int, tag: str) -> list[tuple[str, Any]]:
    """The demo's order events, each order's key tagged (the warm-up's keys are others)."""
    return [(f"{order}.{tag}", event) for order, event in generate_orders(keys, events, seed)]


def counts_of(load: Sequence[tuple[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for key, _ in load:
        counts[key] = counts.get(key, 0) + 1
    return counts


@dataclass(frozen=True)
class LoadSpec:
    stream: str
    mode: str
    buckets: int
    events: int
    keys: int
    seed: int
    tag: str

    def argv(self) -> list[str]:
        return [
            "--publisher",
            self.stream,
            "--mode",
            self.mode,
            "--buckets",
            str(self.buckets),
            "--events",
            str(self.events),
            "--keys",
            str(self.keys),
            "--seed",
            str(self.seed),
            "--tag",
            self.tag,
        ]


def publisher_main(spec: LoadSpec) -> int:
    """The publishing process: make the load and connect, say ``ready``; on ``go`` publish it
    all flat out and flush, say how long that took; on ``exit`` close and exit. It stays
    connected meanwhile, so that its CPU can be read until every event is committed."""
    load = keyed_load(spec.events, spec.keys, spec.seed, spec.tag)
    buckets = spec.buckets if Mode(spec.mode).hashes else None
    with Producer(spec.stream, mode=spec.mode, buckets=buckets) as producer:
        _say({"ready": True, "pack_max_events": load_settings().pack_max_events})
        sys.stdin.readline()
        started = time.perf_counter()
        publish = producer.publish
        for key, event in load:
            publish(key, event)
        producer.flush()
        _say({"published_s": time.perf_counter() - started, "stats": producer.stats})
        sys.stdin.readline()
    return 0


def _say(message: Mapping[str, Any]) -> None:
    sys.stdout.write(orjson.dumps(message, default=str).decode() + "\n")
    sys.stdout.flush()


class Publisher:
    """A publishing process (``publisher_main``) driven over its stdin and stdout."""

    def __init__(self, spec: LoadSpec, pack: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), PACK_ENV: str(pack)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.cpu_per_event", *spec.argv()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=REPO,
        )
        self.pid = self.process.pid

    def _read(self) -> dict[str, Any]:
        stdout: IO[bytes] | None = self.process.stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            code = self.process.wait(30)
            raise RuntimeError(f"the publishing process exited ({code}) before it was told to")
        message: dict[str, Any] = orjson.loads(line)
        return message

    def _tell(self) -> None:
        stdin: IO[bytes] | None = self.process.stdin
        assert stdin is not None
        stdin.write(b"\n")
        stdin.flush()

    def ready(self) -> dict[str, Any]:
        return self._read()

    def go(self) -> None:
        self._tell()

    def published(self) -> dict[str, Any]:
        return self._read()

    def close(self) -> None:
        with suppress(OSError):
            self._tell()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


# ---------------------------------------------------------------------------- measuring
@contextmanager
def pack_setting(pack: int) -> Iterator[None]:
    """``KEYQ_PACK_MAX_EVENTS`` for the processes started inside (workers copy the env)."""
    earlier = os.environ.get(PACK_ENV)
    os.environ[PACK_ENV] = str(pack)
    try:
        yield
    finally:
        if earlier is None:
            os.environ.pop(PACK_ENV, None)
        else:
            os.environ[PACK_ENV] = earlier


WORKER_KINDS = {"workers_jvm": proc_cpu.is_jvm, "workers_python": lambda _stat: True}


def read_cpu(
    broker: int | None, redis_pid: int | None, producer: int | None, workers: Sequence[int]
) -> dict[str, float]:
    """CPU seconds so far of each part, from one scan of ``/proc``."""
    table = proc_cpu.snapshot()
    cpu: dict[str, float] = {}
    for name, pid in (("broker", broker), ("redis", redis_pid), ("producer", producer)):
        if pid is not None:
            cpu[name] = proc_cpu.tree_seconds(pid, table)["total"]
    totals = {"workers": 0.0, "workers_python": 0.0, "workers_jvm": 0.0}
    for pid in workers:
        tree = proc_cpu.tree_seconds(pid, table, WORKER_KINDS)
        totals["workers"] += tree["total"]
        totals["workers_python"] += tree["workers_python"]
        totals["workers_jvm"] += tree["workers_jvm"]
    return {**cpu, **totals}


def committed(store: StateStore, keys: Sequence[str]) -> int:
    """Events applied to ``keys`` so far (``bench.pipelines:count``: the state is a count)."""
    return sum(int(raw) for raw in store.states(keys).values())


def wait_committed(store: StateStore, keys: Sequence[str], total: int) -> float:
    """Poll until ``total`` events of ``keys`` are committed; the ``perf_counter`` then."""
    deadline = time.monotonic() + COMMIT_TIMEOUT_S
    while True:
        if committed(store, keys) >= total:
            return time.perf_counter()
        if time.monotonic() > deadline:
            raise RuntimeError(f"events not all committed within {COMMIT_TIMEOUT_S:.0f} s")
        time.sleep(0.1)


@dataclass(frozen=True)
class Services:
    broker: int | None
    redis: int | None


@dataclass(frozen=True)
class Plan:
    mode: str
    buckets: int
    events: int
    keys: int
    warmup_events: int
    workers: int
    idle_seconds: float
    seed: int


def run_round(
    label: str,
    pack: int,
    plan: Plan,
    services: Services,
    client: redis.Redis,
    cleanup: Cleanup,
    folder: Path,
) -> dict[str, Any]:
    """One round on a fresh stream: workers up, warm-up, idle reading, the measured load."""
    stream = f"bench-cpu-{label}-{uuid.uuid4().hex[:6]}"
    cleanup.add_stream(stream)
    store = StateStore(client, stream)
    # Recorded first: a worker given no --buckets (in auto mode) adopts the stream's count.
    ensure_stream_config(
        client, stream, plan.mode, plan.buckets if Mode(plan.mode).hashes else None
    )
    with pack_setting(pack):
        workers = [
            WorkerProcess(stream, plan.buckets, folder, PIPELINE, mode=plan.mode)
            for _ in range(plan.workers)
        ]
    try:
        for worker in workers:
            worker.wait_ready()
        worker_pids = [worker.process.pid for worker in workers]
        if plan.warmup_events:
            warm_keys = max(1, min(plan.keys, plan.warmup_events // 10))
            warm = LoadSpec(
                stream, plan.mode, plan.buckets, plan.warmup_events, warm_keys, plan.seed + 1, "w"
            )
            publisher = Publisher(warm, pack)
            try:
                publisher.ready()
                publisher.go()
                publisher.published()
            finally:
                publisher.close()
            warm_load = counts_of(keyed_load(warm.events, warm.keys, warm.seed, warm.tag))
            wait_committed(store, sorted(warm_load), warm.events)
        time.sleep(1.0)  # the warm-up's last acks and heartbeats

        spec = LoadSpec(stream, plan.mode, plan.buckets, plan.events, plan.keys, plan.seed, "m")
        keys = sorted(counts_of(keyed_load(spec.events, spec.keys, spec.seed, spec.tag)))
        publisher = Publisher(spec, pack)
        try:
            said = publisher.ready()
            if said.get("pack_max_events") != pack:
                raise RuntimeError(f"the producer runs with {said}, not pack_max_events={pack}")
            idle_before = read_cpu(services.broker, services.redis, None, worker_pids)
            time.sleep(plan.idle_seconds)
            idle = proc_cpu.spent(
                idle_before, read_cpu(services.broker, services.redis, None, worker_pids)
            )
            before = read_cpu(services.broker, services.redis, publisher.pid, worker_pids)
            started = time.perf_counter()
            publisher.go()
            published = publisher.published()
            finished = wait_committed(store, keys, spec.events)
            after = read_cpu(services.broker, services.redis, publisher.pid, worker_pids)
        finally:
            publisher.close()
    finally:
        for worker in workers:
            worker.stop()
    cpu = proc_cpu.spent(before, after)
    seconds = finished - started
    return {
        "pack": label,
        "pack_max_events": pack,
        "stream": stream,
        "events": spec.events,
        "seconds": round(seconds, 3),
        "publish_seconds": round(float(published["published_s"]), 3),
        "events_per_s": round(spec.events / seconds),
        "cpu_s": {name: round(value, 3) for name, value in cpu.items()},
        "cpu_s_per_1000_events": {
            name: round(1000 * value / spec.events, 4) for name, value in cpu.items()
        },
        "idle_cores": {name: round(value / plan.idle_seconds, 3) for name, value in idle.items()},
        "producer_stats": published.get("stats"),
    }


def measured_round(
    settings: Settings,
    label: str,
    pack: int,
    plan: Plan,
    services: Services,
    client: redis.Redis,
    folder: Path,
    errors: list[str],
) -> dict[str, Any] | None:
    """``run_round``, then its stream's queues and keys removed whatever happened."""
    cleanup = Cleanup(settings)
    entries: list[dict[str, Any]] = []

    def measure() -> None:
        entries.append(run_round(label, pack, plan, services, client, cleanup, folder))

    measure_then_clean(measure, cleanup, errors)
    return entries[0] if entries else None


def summarise(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A mode's medians over its rounds."""
    per_1000 = {
        name: median(
            [r["cpu_s_per_1000_events"][name] for r in rounds if name in r["cpu_s_per_1000_events"]]
        )
        for name in PARTS
    }
    return {
        "rounds": len(rounds),
        "events_per_s": median([r["events_per_s"] for r in rounds]),
        "cpu_s_per_1000_events": {
            name: None if value is None else round(value, 4) for name, value in per_1000.items()
        },
    }


def compare(off: dict[str, Any], on: dict[str, Any]) -> dict[str, float | None]:
    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    ratios = {"events_per_s": rounded(ratio(on["events_per_s"], off["events_per_s"]))}
    for name in PARTS:
        ratios[name] = rounded(
            ratio(on["cpu_s_per_1000_events"][name], off["cpu_s_per_1000_events"][name])
        )
    return ratios


# ------------------------------------------------------------------------------- main
def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_per_event", description=__doc__)
    parser.add_argument("--events", type=positive, default=50_000)
    parser.add_argument("--keys", type=positive, default=2000, help="orders (keys)")
    parser.add_argument("--mode", choices=("key", "bucket", "auto"), default="key")
    parser.add_argument(
        "--buckets", type=positive, default=16, help="bucket and auto mode's queues"
    )
    parser.add_argument("--rounds", type=positive, default=2, help="rounds of each, off and on")
    parser.add_argument("--workers", type=positive, default=2)
    parser.add_argument(
        "--warmup-events", type=non_negative, default=10_000, help="untimed load before each round"
    )
    parser.add_argument("--idle-seconds", type=float, default=2.0)
    parser.add_argument(
        "--pack-on", type=positive, default=PACK_DEFAULT, help="KEYQ_PACK_MAX_EVENTS when on"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--publisher", metavar="STREAM", help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="m", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.keys > args.events:
        parser.error("--keys must be at most --events")
    if args.idle_seconds <= 0:
        parser.error("--idle-seconds must be more than 0")
    if args.pack_on == 1:
        parser.error("--pack-on 1 is packing off")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.publisher:
        spec = LoadSpec(
            args.publisher, args.mode, args.buckets, args.events, args.keys, args.seed, args.tag
        )
        return publisher_main(spec)

    settings: Settings = load_settings()
    broker, broker_how = service_pid(
        settings.amqp_url, 5672, "beam.smp", ("rabbit@localhost", "rabbit boot")
    )
    redis_pid, redis_how = service_pid(settings.redis_url, 6379, "redis-server", ("6379",))
    params = {
        **{k: v for k, v in vars(args).items() if k not in {"publisher", "tag"}},
        "out": str(args.out) if args.out else None,
        "pack_off": 1,
        "pack_max_bytes": settings.pack_max_bytes,
        "pack_linger_ms": settings.pack_linger_ms,
        "pipeline": PIPELINE,
        "load": "keyq.demo.orders.generate_orders (Zipf-skewed orders)",
    }
    result: dict[str, Any] = {
        "benchmark": "cpu_per_event",
        "machine": machine_info(),
        "params": params,
        "processes": {
            "broker": {"pid": broker, "found": broker_how},
            "redis": {"pid": redis_pid, "found": redis_how},
        },
    }
    errors: list[str] = []
    if broker is None:
        errors.append(f"broker CPU not measured: {broker_how}")
    if redis_pid is None:
        errors.append(f"Redis CPU not measured: {redis_how}")
    plan = Plan(
        args.mode,
        args.buckets,
        args.events,
        args.keys,
        args.warmup_events,
        args.workers,
        args.idle_seconds,
        args.seed,
    )
    services = Services(broker, redis_pid)
    folder = Path(tempfile.mkdtemp(prefix="keyq-bench-cpu-"))
    client = open_redis(settings)
    rounds: list[dict[str, Any]] = []
    try:
        for number in range(1, args.rounds + 1):
            for label, pack in (("off", 1), ("on", args.pack_on)):
                log(f"round {number}/{args.rounds}, packing {label} ({PACK_ENV}={pack})")
                entry = measured_round(
                    settings, label, pack, plan, services, client, folder, errors
                )
                if entry is not None:
                    rounds.append(entry)
                    log(orjson.dumps(entry).decode())
    except RuntimeError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        client.close()
    off = summarise([r for r in rounds if r["pack"] == "off"])
    on = summarise([r for r in rounds if r["pack"] == "on"])
    result.update(
        {
            "off": off,
            "on": on,
            "on_over_off": compare(off, on),
            "rounds": rounds,
            "errors": errors,
            "worker_logs": str(folder),
        }
    )
    result["broker_cpu_per_1000_on_over_off"] = result["on_over_off"]["broker"]
    emit(result, args.out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
