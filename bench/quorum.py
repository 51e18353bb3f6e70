"""Quorum against classic queues, on a private 3-node RabbitMQ cluster, in one run.

Boots :class:`tests.cluster.RabbitCluster` (three nodes of the installed RabbitMQ on loopback,
never the machine's own node on 5672), points every client of this process and of its workers
at all three nodes (``KEYQ_AMQP_URL`` comma-separated), and measures, classic queues being the
baseline of each figure:

1. ``memory``: broker memory per idle queue. Sets of ``--memory-queues`` queues of each type
   (keyq's arguments, never used) are declared and deleted in turn; before and after each
   declaration every node garbage-collects every process and reports ``rabbit_vm:memory()``
   (``rabbitmqctl -n NODE eval``; the breakdown ``rabbitmqctl status`` prints). The figure is
   ``total.erlang`` (what the Erlang VM accounts for), summed over the three nodes, per queue;
   ``total.allocated`` and the categories (``queue_procs``, ``quorum_queue_procs``,
   ``quorum_ets``...) come along.
2. ``publish``: keyq ``Producer`` publish rate (confirmed), bucket mode and key mode, nothing
   consuming; a fresh stream per run, first-use declarations included.
3. ``e2e``: bucket mode, two ``keyq worker`` processes per queue type (production defaults,
   ``bench.pipelines:ordered_count``); events/s from the first publish until every event is
   applied. Both types' workers run side by side, and the repeats alternate the types.
4. ``worker_failover``: with a trickle of events on every bucket, kill -9 the worker holding
   the most queues; seconds until every queue it held is held by another worker, and until an
   event published after the kill is applied on each of them. A replacement joins after each.
5. ``node_failover`` (quorum): kill -9 a RabbitMQ node while events flow, in turn the one
   leading the most of the stream's queues and the one the producer is connected to; seconds
   until an event published after the kill is applied on each of the queues it led. The node
   stays down for up to 30 s; it is then restarted (and queues that had not flowed yet are
   watched on), and its replicas are back before the next.
6. ``verdict``: per stream, every key's applied count and order against what was published.

Progress goes to stderr; one JSON object to stdout (and ``--out``).

Usage: ``python -m bench.quorum [--out FILE] [--events N] [--worker-kills K] [--node-kills K]``
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pika
import pika.exceptions
import redis

from bench.common import (
    Cleanup,
    amqp,
    emit,
    log,
    machine_info,
    median,
    message_counts,
    non_negative,
    positive,
    publish_all,
    ratio,
    registered_queues,
    wait_for_total,
)
from keyq import Producer
from keyq.broker.connections import open_redis
from keyq.broker.errors import KeyqError
from keyq.broker.locks import FencedLocks
from keyq.broker.membership import Membership, fair_share
from keyq.broker.naming import Mode, bucket_queue_name, dead_letter_queue_name, stream_prefix
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import StreamConfig
from keyq.broker.topology import keyed_queue_arguments
from keyq.worker.batch.state_store import StateStore
from tests.cluster import ClusterError, RabbitCluster

REPO = Path(__file__).resolve().parent.parent
PIPELINE = "bench.pipelines:ordered_count"  # state: [applied, highest n, events after a higher n]
TYPES = ("classic", "quorum")
PAD = "x" * 120  # events of ~150 bytes of JSON, as bench.e2e
TARGET_E2E_RATIO = 0.7
TARGET_NODE_FAILOVER_S = 10.0
MAX_MEMORY_QUEUES = 300  # the nodes' open-files limit (1024) must stay far away
READY_TIMEOUT_S = 300
RECOVERY_TIMEOUT_S = 60
NODE_DOWN_WATCH_S = 30
# Node kills take these nodes in turn (see QuorumBench.kill_node).
KILL_TARGETS = ("leaders", "producer")
SETTLE_TIMEOUT_S = 120
TRICKLE_PAUSE_S = 0.05
# One CLI call per node: GC every process, then the memory breakdown.
MEMORY_EVAL = "[garbage_collect(P) || P <- processes()], rabbit_vm:memory()."
MEMORY_ITEM = re.compile(r"\{(\w+),(\d+)\}")
MEMORY_TOTALS = frozenset({"erlang", "rss", "allocated"})  # inside {total, [...]}
# keyq names its connections keyq-<what>@<host>:<pid> (client property connection_name).
CONNECTION_NAME = re.compile(r'\{"connection_name","keyq-([^"@]+)@')
EXPECTED_ERRORS = (
    KeyqError,
    RuntimeError,  # ClusterError included
    redis.RedisError,
    pika.exceptions.AMQPError,
    OSError,
    subprocess.SubprocessError,
)

T = TypeVar("T")


def summary(values: Sequence[float | None]) -> dict[str, Any]:
    """Runs, median and worst (a run that never recovered is None and counts as worst)."""
    known = [v for v in values if v is not None]
    complete = bool(values) and len(known) == len(values)
    return {
        "runs": [None if v is None else round(v, 3) for v in values],
        "median": round(median(known) or 0, 3) if known else None,
        "max": round(max(known), 3) if complete else None,
    }


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


# ----------------------------------------------------------------------------- workers
class WorkerProcess:
    """``python -m keyq worker`` on one bucket-mode stream, pointed at the private cluster."""

    def __init__(self, lane: Lane, amqp_url: str, log_dir: Path) -> None:
        self.worker_id = f"bq-{lane.queue_type}-{uuid.uuid4().hex[:6]}"
        self.log_path = log_dir / f"{self.worker_id}.log"
        self._log = self.log_path.open("wb")
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "KEYQ_AMQP_URL": amqp_url,
            "KEYQ_QUEUE_TYPE": lane.queue_type,
        }
        command = [
            sys.executable,
            "-m",
            "keyq",
            "worker",
            "--stream",
            lane.stream,
            "--pipeline",
            PIPELINE,
            "--mode",
            "bucket",
            "--buckets",
            str(lane.buckets),
            "--worker-id",
            self.worker_id,
        ]
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO
        )
        self._terminated = False

    def kill(self) -> float:
        """kill -9; returns when the signal was sent (perf_counter)."""
        sent = time.perf_counter()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        return sent

    def terminate(self) -> None:
        """SIGTERM, once: a second one makes a worker exit without finishing its batch."""
        if self.process.poll() is None and not self._terminated:
            self._terminated = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
        self._log.close()


def wait_ready(client: redis.Redis, lane: Lane, workers: Sequence[WorkerProcess]) -> float:
    """Until every one of ``workers`` says in Redis that its first claim round is done."""
    membership = Membership(client, lane.stream, ttl_ms=1)
    started = time.monotonic()
    waiting = list(workers)
    while waiting:
        for worker in list(waiting):
            if worker.process.poll() is not None:
                tail = worker.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"worker {worker.worker_id} exited: {tail}")
            if membership.serving(worker.worker_id):
                waiting.remove(worker)
        if time.monotonic() - started > READY_TIMEOUT_S:
            raise RuntimeError(f"{len(waiting)} workers not ready in {READY_TIMEOUT_S} s")
        time.sleep(0.1)
    return time.monotonic() - started


# ------------------------------------------------------------------------------- lanes
@dataclass
class Lane:
    """One bucket-mode stream of one queue type, its workers and what was published to it."""

    queue_type: str
    stream: str
    buckets: int
    workers: list[WorkerProcess] = field(default_factory=list)
    dead: list[WorkerProcess] = field(default_factory=list)  # killed, logs kept
    published: collections.Counter[str] = field(default_factory=collections.Counter)
    trickle: Trickle | None = None
    trickle_key_of: dict[str, str] = field(default_factory=dict)  # queue -> one of its keys
    _numbers: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        config = StreamConfig(self.stream, Mode.BUCKET, self.buckets, self.queue_type)
        for n in range(self.buckets * 1000):
            self.trickle_key_of.setdefault(config.queue_for(f"trickle-{n}"), f"trickle-{n}")
            if len(self.trickle_key_of) == self.buckets:
                break

    def next_n(self) -> int:
        """Event numbers increase per stream, so a key's applied events show their order."""
        return next(self._numbers)

    @property
    def queues(self) -> list[str]:
        return [bucket_queue_name(self.stream, bucket) for bucket in range(self.buckets)]

    def producer(self, settings: Settings) -> Producer:
        return Producer(
            self.stream,
            mode="bucket",
            buckets=self.buckets,
            settings=settings,
            queue_type=self.queue_type,
        )


class Trickle(threading.Thread):
    """One event to one key of every bucket each ``TRICKLE_PAUSE_S``: every queue has work."""

    def __init__(self, lane: Lane, settings: Settings) -> None:
        super().__init__(daemon=True, name=f"trickle-{lane.queue_type}")
        self._lane = lane
        self._settings = settings
        self._keys = sorted(lane.trickle_key_of.values())
        self.halt = threading.Event()
        self.error: str | None = None
        self.stats: dict[str, int] = {}
        self._producer: Producer | None = None

    def refused(self) -> int:
        """Publishes the broker nacked or returned so far (the producer sends them again)."""
        producer = self._producer
        return producer.stats["returned"] if producer is not None else 0

    def run(self) -> None:
        lane = self._lane
        try:
            with lane.producer(self._settings) as producer:
                self._producer = producer
                while not self.halt.is_set():
                    for key in self._keys:
                        producer.publish(key, {"n": lane.next_n()})
                        lane.published[key] += 1
                    self.halt.wait(TRICKLE_PAUSE_S)
                producer.flush(timeout=SETTLE_TIMEOUT_S)
                self.stats = dict(producer.stats)
        except KeyqError as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def finish(self) -> None:
        self.halt.set()
        self.join(SETTLE_TIMEOUT_S + 30)


def applied(store: StateStore, keys: Iterable[str]) -> dict[str, tuple[int, int, int]]:
    """Each key's (events applied, highest n applied, events applied after a higher n)."""
    found = {}
    for key, raw in store.states(keys).items():
        count, last, late = orjson.loads(raw)
        found[key] = (int(count), int(last), int(late))
    return found


def total_applied(store: StateStore, keys: Sequence[str]) -> int:
    return sum(count for count, _, _ in applied(store, keys).values())


def watch_recovery(
    store: StateStore,
    keys: dict[str, str],
    watermark: int,
    since: float,
    *,
    locks: FencedLocks | None = None,
    dead_owner: str | None = None,
    timeout: float = RECOVERY_TIMEOUT_S,
) -> dict[str, Any]:
    """Seconds from ``since`` until every queue of ``keys`` (queue -> key) has applied an
    event numbered above ``watermark`` (so published after the fault), and, with ``locks``,
    until every one of them is held by someone other than ``dead_owner``."""
    queues = sorted(keys)
    flowing: set[str] = set()
    first_flow = all_flow = held = None
    while True:
        states = applied(store, keys.values())
        leases = locks.holders(queues) if locks is not None else {}
        elapsed = time.perf_counter() - since
        flowing.update(key for key, (_, last, _) in states.items() if last > watermark)
        if flowing and first_flow is None:
            first_flow = elapsed
        if len(flowing) == len(keys) and all_flow is None:
            all_flow = elapsed
        if (
            locks is not None
            and held is None
            and all(lease is not None and lease.owner != dead_owner for lease in leases.values())
        ):
            held = elapsed
        if all_flow is not None and (locks is None or held is not None):
            break
        if elapsed > timeout:
            break
        time.sleep(0.02)
    result: dict[str, Any] = {
        "queues": len(queues),
        "first_queue_flowing_s": rounded(first_flow),
        "all_queues_flowing_s": rounded(all_flow),
        "queues_flowing": len(flowing),
    }
    if locks is not None:
        result["all_held_again_s"] = rounded(held)
        result["recovered_s"] = (
            rounded(max(held, all_flow)) if held is not None and all_flow is not None else None
        )
    return result


# ----------------------------------------------------------------------------- the run
class QuorumBench:
    def __init__(self, cluster: RabbitCluster, args: argparse.Namespace, log_dir: Path) -> None:
        self.cluster = cluster
        self.args = args
        self.log_dir = log_dir
        self.run_id = uuid.uuid4().hex[:6]
        self.amqp_url = ",".join(cluster.urls)
        self.settings: Settings = load_settings(amqp_url=self.amqp_url)
        self.node0: Settings = load_settings(amqp_url=cluster.urls[0])
        self.client = open_redis(self.settings)
        self.cleanup = Cleanup(self.settings)
        self.errors: list[str] = []
        self.lanes = {
            queue_type: Lane(queue_type, f"bench-q-{self.run_id}-{queue_type}", args.buckets)
            for queue_type in TYPES
        }
        for lane in self.lanes.values():
            self.cleanup.add_stream(lane.stream)
        self.workers_ready = False

    def phase(self, name: str, action: Callable[[], T]) -> T | None:
        log(f"== {name}")
        started = time.monotonic()
        try:
            return action()
        except EXPECTED_ERRORS as exc:
            self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
            log(f"{name} FAILED: {type(exc).__name__}: {exc}")
            return None
        finally:
            log(f"{name}: {time.monotonic() - started:.1f} s")

    # -- 1. memory per idle queue ----------------------------------------------------------
    def node_memory(self) -> list[dict[str, int]]:
        """Every node's memory breakdown (bytes; the total's figures as ``total_<name>``),
        each read right after a full GC of every process of the node."""

        def one(node: int) -> dict[str, int]:
            out = self.cluster.ctl(node, "eval", MEMORY_EVAL)
            flat = {}
            for name, value in MEMORY_ITEM.findall(out):
                flat[f"total_{name}" if name in MEMORY_TOTALS else name] = int(value)
            if "total_erlang" not in flat:
                raise RuntimeError(f"no memory breakdown in {out[:300]!r}")
            return flat

        with ThreadPoolExecutor(len(self.cluster.nodes)) as pool:
            return list(pool.map(one, range(len(self.cluster.nodes))))

    def memory(self) -> dict[str, Any]:
        count = self.args.memory_queues
        stream = f"bench-q-{self.run_id}-mem"
        per_queue: dict[str, list[float]] = {t: [] for t in TYPES}
        allocated: dict[str, list[float]] = {t: [] for t in TYPES}
        per_node: dict[str, list[list[float]]] = {t: [] for t in TYPES}
        categories: dict[str, list[dict[str, float]]] = {t: [] for t in TYPES}
        before = self.node_memory()
        for repeat in range(self.args.memory_repeats):
            for queue_type in TYPES if repeat % 2 == 0 else TYPES[::-1]:
                names = [f"{stream}-{queue_type}-{repeat}-{i:04d}" for i in range(count)]
                self.cleanup.add_queues(names)
                arguments = keyed_queue_arguments(stream, queue_type)
                started = time.monotonic()
                with amqp(self.node0, "bench-quorum-memory") as connection:
                    channel = connection.channel()
                    for name in names:
                        channel.queue_declare(name, durable=True, arguments=arguments)
                declared_s = time.monotonic() - started
                time.sleep(2)  # followers on the other nodes finish starting
                after = self.node_memory()
                deltas = [
                    {name: a[name] - b.get(name, 0) for name in a}
                    for a, b in zip(after, before, strict=True)
                ]
                summed = {name: sum(d.get(name, 0) for d in deltas) / count for name in deltas[0]}
                per_queue[queue_type].append(summed["total_erlang"])
                allocated[queue_type].append(summed["total_allocated"])
                per_node[queue_type].append([d["total_erlang"] / count for d in deltas])
                categories[queue_type].append(summed)
                log(
                    f"memory {queue_type} #{repeat + 1}: {count} queues declared in "
                    f"{declared_s:.1f} s, {summed['total_erlang'] / 1024:.1f} KiB per queue "
                    f"(erlang, 3 nodes), {summed['total_allocated'] / 1024:.1f} KiB allocated"
                )
                with amqp(self.node0, "bench-quorum-memory") as connection:
                    channel = connection.channel()
                    for name in names:
                        channel.queue_delete(name)
                time.sleep(1)
                before = self.node_memory()
        result: dict[str, Any] = {
            "figure": "total.erlang of rabbit_vm:memory() (the breakdown rabbitmqctl status and "
            "rabbitmq-diagnostics memory_breakdown print), read with rabbitmqctl -n NODE eval "
            "right after a GC of every process, summed over the 3 nodes; after minus before "
            "declaring, per queue",
            "queues_per_set": count,
            "queue_arguments": "keyq's keyed_queue_arguments (durable; quorum: 3 replicas, "
            "single active consumer, delivery limit)",
        }
        for queue_type in TYPES:
            keys = categories[queue_type][0].keys() if categories[queue_type] else []
            result[queue_type] = {
                "bytes_per_queue": summary(per_queue[queue_type]),
                "allocated_bytes_per_queue": summary(allocated[queue_type]),
                "bytes_per_queue_by_node": [
                    [round(v) for v in node] for node in per_node[queue_type]
                ],
                "categories_bytes_per_queue_median": {
                    name: round(median([c[name] for c in categories[queue_type]]) or 0)
                    for name in sorted(keys)
                },
            }
        result["quorum/classic"] = rounded(
            ratio(
                result["quorum"]["bytes_per_queue"]["median"],
                result["classic"]["bytes_per_queue"]["median"],
            )
        )
        return result

    # -- 2. publish rates -------------------------------------------------------------------
    def publish_rates(self) -> dict[str, Any]:
        events_n = self.args.publish_events
        layouts = {
            "bucket": (self.args.keys, self.args.buckets),
            "key": (self.args.publish_key_keys, None),
        }
        rates: dict[str, dict[str, list[float]]] = {m: {t: [] for t in TYPES} for m in layouts}
        notes: list[str] = []
        for repeat in range(self.args.repeats):
            for mode, (key_count, buckets) in layouts.items():
                keys = [f"key-{i:04d}" for i in range(key_count)]
                events = [(keys[i % key_count], {"n": i, "pad": PAD}) for i in range(events_n)]
                for queue_type in TYPES if repeat % 2 == 0 else TYPES[::-1]:
                    stream = f"bench-q-{self.run_id}-p{mode[0]}{queue_type[0]}{repeat}"
                    self.cleanup.add_stream(stream)
                    with Producer(
                        stream,
                        mode=mode,
                        buckets=buckets,
                        settings=self.settings,
                        queue_type=queue_type,
                    ) as producer:
                        elapsed = publish_all(producer, events, SETTLE_TIMEOUT_S)
                        stats = producer.stats
                    rate = events_n / elapsed
                    rates[mode][queue_type].append(round(rate, 1))
                    log(f"publish {mode} {queue_type} #{repeat + 1}: {rate:,.0f} events/s")
                    if stats["returned"] or stats["resent"]:
                        notes.append(f"{stream}: {stats}")
                    queues = registered_queues(self.client, stream)
                    total, missing = wait_for_total(self.settings, queues, events_n)
                    if total != events_n or missing:
                        self.errors.append(
                            f"publish {stream}: {total} of {events_n} events in "
                            f"{len(queues)} queues ({len(missing)} missing)"
                        )
                    self.cleanup.run()
                    for lane in self.lanes.values():  # run() forgot them: still to clean
                        self.cleanup.add_stream(lane.stream)
        result: dict[str, Any] = {
            "events": events_n,
            "unit": "events/s, confirmed, first publish to flush done",
            "layouts": {
                "bucket": f"{self.args.keys} keys over {self.args.buckets} buckets",
                "key": f"{self.args.publish_key_keys} keys, a queue each, declared on first use",
            },
            "notes": notes,
        }
        for mode in layouts:
            entry: dict[str, Any] = {
                t: {"rates": rates[mode][t], "median": rounded(median(rates[mode][t]), 1)}
                for t in TYPES
            }
            entry["quorum/classic"] = rounded(
                ratio(entry["quorum"]["median"], entry["classic"]["median"])
            )
            entry["paired_quorum/classic"] = [
                round(q / c, 3)
                for q, c in zip(rates[mode]["quorum"], rates[mode]["classic"], strict=False)
            ]
            result[mode] = entry
        return result

    # -- workers ----------------------------------------------------------------------------
    def start_workers(self) -> dict[str, float]:
        for lane in self.lanes.values():
            lane.workers = [WorkerProcess(lane, self.amqp_url, self.log_dir) for _ in range(2)]
        took = {}
        for queue_type, lane in self.lanes.items():
            took[queue_type] = round(wait_ready(self.client, lane, lane.workers), 2)
        log(f"workers ready: {took}")
        self.workers_ready = True
        return took

    # -- 3. end to end ----------------------------------------------------------------------
    def run_e2e(self, lane: Lane, count: int) -> tuple[float, float]:
        """(events/s from the first publish until all applied, seconds to publish all)."""
        keys = [f"key-{i:04d}" for i in range(self.args.keys)]
        events = [(keys[i % len(keys)], {"n": lane.next_n(), "pad": PAD}) for i in range(count)]
        store = StateStore(self.client, lane.stream)
        target = total_applied(store, keys) + count
        with lane.producer(self.settings) as producer:
            started = time.perf_counter()
            published_s = publish_all(producer, events, SETTLE_TIMEOUT_S)
        lane.published.update(key for key, _ in events)
        deadline = time.monotonic() + 300
        while total_applied(store, keys) < target:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{lane.queue_type}: events not all applied within 300 s")
            time.sleep(0.05)
        elapsed = time.perf_counter() - started
        return count / elapsed, published_s

    def e2e(self) -> dict[str, Any]:
        if self.args.warmup_events:
            for queue_type, lane in self.lanes.items():
                warm, _ = self.run_e2e(lane, self.args.warmup_events)
                log(f"warm-up {queue_type}: {warm:,.0f} events/s")
        rates: dict[str, list[float]] = {t: [] for t in TYPES}
        publish_s: dict[str, list[float]] = {t: [] for t in TYPES}
        for repeat in range(self.args.repeats):
            for queue_type in TYPES if repeat % 2 == 0 else TYPES[::-1]:
                rate, seconds = self.run_e2e(self.lanes[queue_type], self.args.events)
                rates[queue_type].append(round(rate, 1))
                publish_s[queue_type].append(round(seconds, 2))
                log(
                    f"e2e {queue_type} #{repeat + 1}: {rate:,.0f} events/s "
                    f"(publishing took {seconds:.1f} s)"
                )
        result: dict[str, Any] = {
            "events": self.args.events,
            "keys": self.args.keys,
            "buckets": self.args.buckets,
            "warmup_events": self.args.warmup_events,
            "unit": "events/s, first publish to every event applied",
            "workers_per_type": 2,
        }
        for queue_type in TYPES:
            result[queue_type] = {
                "events_per_s": rates[queue_type],
                "median": rounded(median(rates[queue_type]), 1),
                "publish_seconds": publish_s[queue_type],
            }
        value = ratio(result["quorum"]["median"], result["classic"]["median"])
        result["quorum/classic"] = rounded(value)
        result["paired_quorum/classic"] = [
            round(q / c, 3) for q, c in zip(rates["quorum"], rates["classic"], strict=False)
        ]
        result["target"] = TARGET_E2E_RATIO
        result["meets_target"] = value is not None and value >= TARGET_E2E_RATIO
        return result

    # -- 4. a worker's kill -9 --------------------------------------------------------------
    def kill_worker(self, lane: Lane) -> dict[str, Any]:
        locks = FencedLocks(self.client, lane.stream)
        held: dict[str, list[str]] = collections.defaultdict(list)
        for queue, lease in locks.holders(lane.queues).items():
            if lease is not None:
                held[lease.owner].append(queue)
        victim = max(lane.workers, key=lambda worker: len(held.get(worker.worker_id, [])))
        queues = held.get(victim.worker_id, [])
        if not queues:
            raise RuntimeError(f"{lane.queue_type}: no worker holds any queue")
        store = StateStore(self.client, lane.stream)
        killed_at = victim.kill()
        watermark = lane.next_n()
        lane.workers.remove(victim)
        lane.dead.append(victim)
        keys = {queue: lane.trickle_key_of[queue] for queue in queues}
        result = watch_recovery(
            store, keys, watermark, killed_at, locks=locks, dead_owner=victim.worker_id
        )
        log(f"worker kill {lane.queue_type}: {result}")
        return result

    def replace_workers(self, lanes: Sequence[Lane]) -> dict[str, float | None]:
        """A new worker per lane; seconds from ready until it holds its fair share."""
        fresh = {
            lane.queue_type: WorkerProcess(lane, self.amqp_url, self.log_dir) for lane in lanes
        }
        for lane in lanes:
            lane.workers.append(fresh[lane.queue_type])
        took: dict[str, float | None] = {}
        for lane in lanes:
            worker = fresh[lane.queue_type]
            wait_ready(self.client, lane, [worker])
            ready_at = time.monotonic()
            locks = FencedLocks(self.client, lane.stream)
            share = fair_share(
                len(lane.queues), [w.worker_id for w in lane.workers], worker.worker_id
            )
            took[lane.queue_type] = None
            while time.monotonic() - ready_at < RECOVERY_TIMEOUT_S:
                leases = locks.holders(lane.queues).values()
                if sum(1 for x in leases if x is not None and x.owner == worker.worker_id) >= share:
                    took[lane.queue_type] = round(time.monotonic() - ready_at, 3)
                    break
                time.sleep(0.05)
        log(f"replacements at their fair share after: {took}")
        return took

    def worker_failover(self) -> dict[str, Any]:
        for lane in self.lanes.values():
            lane.trickle = Trickle(lane, self.settings)
            lane.trickle.start()
        time.sleep(3)
        kills: dict[str, list[dict[str, Any]]] = {t: [] for t in TYPES}
        rebalances: dict[str, list[float | None]] = {t: [] for t in TYPES}
        for repeat in range(self.args.worker_kills):
            for queue_type in TYPES if repeat % 2 == 0 else TYPES[::-1]:
                kills[queue_type].append(self.kill_worker(self.lanes[queue_type]))
            last = repeat == self.args.worker_kills - 1
            # After the last kill only the quorum stream needs its second worker back (node kills).
            lanes = [self.lanes["quorum"]] if last else list(self.lanes.values())
            for queue_type, took in self.replace_workers(lanes).items():
                rebalances[queue_type].append(took)
            time.sleep(1)
        result: dict[str, Any] = {
            "workers": 2,
            "trickle": f"one key per bucket, one event each every {TRICKLE_PAUSE_S} s",
            "measured": "seconds from the kill -9 until every queue the killed worker held is "
            "held by another worker (all_held_again_s) and has applied an event published "
            "after the kill (all_queues_flowing_s); recovered_s is the later of the two",
        }
        for queue_type in TYPES:
            runs = kills[queue_type]
            result[queue_type] = {
                "kills": runs,
                "recovered_s": summary([run.get("recovered_s") for run in runs]),
                "all_held_again_s": summary([run.get("all_held_again_s") for run in runs]),
                "first_queue_flowing_s": summary([run["first_queue_flowing_s"] for run in runs]),
                "replacement_to_fair_share_s": summary(rebalances[queue_type]),
            }
        result["quorum/classic"] = rounded(
            ratio(
                result["quorum"]["recovered_s"]["median"],
                result["classic"]["recovered_s"]["median"],
            )
        )
        return result

    # -- 5. a node's kill -9 ----------------------------------------------------------------
    def replicas_online(self, queues: Sequence[str]) -> bool:
        node = next(i for i in range(len(self.cluster.nodes)) if self.cluster.is_up(i))
        out = self.cluster.ctl(node, "list_queues", "name", "online", "--formatter", "csv")
        wanted = set(queues)
        seen = 0
        for row in csv.DictReader(io.StringIO(out)):
            if row.get("name") in wanted:
                seen += 1
                online = [n for n in row.get("online", "").strip("[]").split(",") if n.strip()]
                if len(online) < len(self.cluster.nodes):
                    return False
        return seen == len(wanted)

    def clients_by_node(self) -> dict[str, list[str]]:
        """keyq's AMQP connections on each node, by name (``worker-<id>``, ``producer-<s>``)."""
        node = next(i for i in range(len(self.cluster.nodes)) if self.cluster.is_up(i))
        out = self.cluster.ctl(
            node, "list_connections", "pid", "client_properties", "--formatter", "csv"
        )
        found: dict[str, list[str]] = {name: [] for name in self.cluster.nodes}
        for row in csv.DictReader(io.StringIO(out)):
            match = CONNECTION_NAME.search(row.get("client_properties", ""))
            home = next((n for n in found if row.get("pid", "").startswith(f"<{n}.")), None)
            if match and home is not None:
                found[home].append(match.group(1))
        return {name: sorted(clients) for name, clients in found.items()}

    def kill_node(self, lane: Lane, target: str = "leaders") -> dict[str, Any]:
        """Kill -9 a node: with ``target`` "leaders" the one leading the most of ``lane``'s
        queues, with "producer" the one the trickle's producer is connected to (its queues
        must flow again through a producer that has lost its node). Watch the queues it led
        for ``NODE_DOWN_WATCH_S``; restart it; if some never flowed, keep watching after."""
        leaders = {
            queue: node
            for queue, node in self.cluster.leaders(stream_prefix(lane.stream)).items()
            if queue in lane.trickle_key_of
        }
        spread = collections.Counter(leaders.values())
        try:
            clients: dict[str, list[str]] | str = self.clients_by_node()
        except ClusterError as exc:
            clients = f"not known: {exc}"
        producer_name = f"producer-{lane.stream}"
        producer_nodes = (
            [name for name, found in clients.items() if producer_name in found]
            if isinstance(clients, dict)
            else []
        )
        if target == "producer" and producer_nodes:
            node = producer_nodes[0]
        else:
            node, _ = spread.most_common(1)[0]
        keys = {queue: lane.trickle_key_of[queue] for queue, n in leaders.items() if n == node}
        store = StateStore(self.client, lane.stream)
        refused_before = lane.trickle.refused() if lane.trickle is not None else 0
        took = self.cluster.kill(node)
        killed_at = time.perf_counter() - took
        watermark = lane.next_n()
        try:
            result = watch_recovery(store, keys, watermark, killed_at, timeout=NODE_DOWN_WATCH_S)
        finally:
            restart_s = self.cluster.restart(node)
        restarted_at = time.perf_counter() - killed_at
        result["flowed_while_node_down"] = result["all_queues_flowing_s"] is not None
        if lane.trickle is not None:
            result["publishes_nacked_or_returned_while_down"] = (
                lane.trickle.refused() - refused_before
            )
        if result["all_queues_flowing_s"] is None:
            after = watch_recovery(
                store, keys, watermark, killed_at, timeout=restarted_at + RECOVERY_TIMEOUT_S
            )
            result["all_queues_flowing_s"] = after["all_queues_flowing_s"]
            if result["first_queue_flowing_s"] is None:
                result["first_queue_flowing_s"] = after["first_queue_flowing_s"]
            result["queues_flowing_only_after_restart"] = (
                after["queues_flowing"] - result["queues_flowing"]
            )
        result["node_back_s"] = round(restarted_at, 2)
        result["node"] = node
        result["target"] = target
        result["producer_on_killed_node"] = node in producer_nodes
        result["leaders_before"] = dict(spread)
        result["keyq_connections_by_node_before"] = clients
        result["restart_s"] = round(restart_s, 2)
        started = time.monotonic()
        while not self.replicas_online(lane.queues):
            if time.monotonic() - started > RECOVERY_TIMEOUT_S:
                raise RuntimeError(f"{node}'s replicas not back online in {RECOVERY_TIMEOUT_S} s")
            time.sleep(0.5)
        result["replicas_back_after_restart_s"] = round(time.monotonic() - started, 2)
        log(f"node kill: {result}")
        return result

    def node_failover(self) -> dict[str, Any]:
        lane = self.lanes["quorum"]
        runs = []
        for number in range(self.args.node_kills):
            runs.append(self.kill_node(lane, KILL_TARGETS[number % len(KILL_TARGETS)]))
            time.sleep(2)
        flowing = summary([run["all_queues_flowing_s"] for run in runs])
        worst = flowing["max"]
        return {
            "queue_type": "quorum",
            "measured": "seconds from the kill -9 of a node (in turn: the one leading the most "
            "of the stream's queues, then the one the producer is connected to) until each "
            "queue it led has applied an event published after the kill "
            "(producer and workers reconnect to the other nodes by themselves); watched for "
            f"{NODE_DOWN_WATCH_S:.0f} s while the node is down, then the node is restarted and "
            "queues that had not flowed yet are watched on (flowed_while_node_down: false)",
            "kills": runs,
            "all_queues_flowing_s": flowing,
            "first_queue_flowing_s": summary([run["first_queue_flowing_s"] for run in runs]),
            "target_s": TARGET_NODE_FAILOVER_S,
            "meets_target": worst is not None and worst <= TARGET_NODE_FAILOVER_S,
        }

    # -- 6. the verdict ---------------------------------------------------------------------
    def verdict(self, lane: Lane) -> dict[str, Any]:
        """Stop the trickle, wait for every published event, compare per key."""
        trickle_stats: dict[str, Any] = {}
        if lane.trickle is not None:
            lane.trickle.finish()
            if lane.trickle.error:
                self.errors.append(f"{lane.queue_type} trickle: {lane.trickle.error}")
            trickle_stats = lane.trickle.stats
        store = StateStore(self.client, lane.stream)
        keys = list(lane.published)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            states = applied(store, keys)
            behind = sum(1 for key in keys if states.get(key, (0, 0, 0))[0] < lane.published[key])
            if not behind or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        lost = duplicated = 0
        for key in keys:
            count = states.get(key, (0, 0, 0))[0]
            lost += max(0, lane.published[key] - count)
            duplicated += max(0, count - lane.published[key])
        reordered = sum(late for _, _, late in states.values())
        dlq = message_counts(self.settings, [dead_letter_queue_name(lane.stream)])
        result = {
            "keys": len(keys),
            "published": sum(lane.published.values()),
            "applied": sum(count for count, _, _ in states.values()),
            "lost": lost,
            "applied_twice": duplicated,
            "reordered": reordered,
            "dead_lettered": next(iter(dlq.values())),
            "trickle_producer": trickle_stats,
            "workers": [
                {
                    name: info.get(name)
                    for name in (
                        "events",
                        "batches",
                        "spark_seconds",
                        "reconnects",
                        "lost",
                        "commits_refused",
                        "late",
                        "gaps_skipped",
                    )
                }
                for info in Membership(self.client, lane.stream, 1000).info().values()
            ],
        }
        if lost or duplicated or reordered:
            self.errors.append(f"{lane.queue_type} verdict: {result}")
        log(f"verdict {lane.queue_type}: {result}")
        return result

    def stop_lane(self, lane: Lane) -> None:
        if lane.trickle is not None and lane.trickle.is_alive():
            lane.trickle.finish()
        for worker in lane.workers:
            worker.terminate()
        for worker in lane.workers + lane.dead:
            worker.stop()
        lane.workers, lane.dead = [], []

    # -- all of it --------------------------------------------------------------------------
    def run(self, result: dict[str, Any]) -> None:
        a = self.args
        result["memory"] = self.phase("memory", self.memory)
        result["publish"] = self.phase("publish", self.publish_rates)
        result["workers_ready_s"] = self.phase("start workers", self.start_workers)
        if not self.workers_ready:
            return
        result["e2e"] = self.phase("e2e", self.e2e)
        if a.worker_kills:
            result["worker_failover"] = self.phase("worker failover", self.worker_failover)
        verdicts: dict[str, Any] = {}
        verdicts["classic"] = self.phase(
            "verdict classic", lambda: self.verdict(self.lanes["classic"])
        )
        self.stop_lane(self.lanes["classic"])  # the quorum stream has the machine to itself
        if a.node_kills:
            if self.lanes["quorum"].trickle is None or not self.lanes["quorum"].trickle.is_alive():
                self.lanes["quorum"].trickle = Trickle(self.lanes["quorum"], self.settings)
                self.lanes["quorum"].trickle.start()
                time.sleep(3)
            result["node_failover"] = self.phase("node failover", self.node_failover)
        verdicts["quorum"] = self.phase(
            "verdict quorum", lambda: self.verdict(self.lanes["quorum"])
        )
        result["verdict"] = verdicts

    def finish(self) -> None:
        for lane in self.lanes.values():
            self.stop_lane(lane)
        try:
            self.cleanup.run()
        except EXPECTED_ERRORS as exc:
            self.errors.append(f"cleanup failed: {type(exc).__name__}: {exc}")
        self.client.close()


def cluster_version(cluster: RabbitCluster) -> str | None:
    try:
        return cluster.ctl(0, "eval", "rabbit_misc:version().").strip().strip('"') or None
    except ClusterError:
        return None


def targets(result: dict[str, Any]) -> dict[str, Any]:
    e2e = result.get("e2e") or {}
    node = result.get("node_failover") or {}
    return {
        "e2e quorum/classic": {
            "target": f">= {TARGET_E2E_RATIO}",
            "value": e2e.get("quorum/classic"),
            "meets_target": bool(e2e.get("meets_target")),
        },
        "node kill -9 until its queues flow again (worst)": {
            "target": f"<= {TARGET_NODE_FAILOVER_S} s",
            "value": (node.get("all_queues_flowing_s") or {}).get("max"),
            "median": (node.get("all_queues_flowing_s") or {}).get("median"),
            "meets_target": bool(node.get("meets_target")),
        },
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.quorum", description=__doc__)
    parser.add_argument("--events", type=positive, default=20_000, help="per timed e2e run")
    parser.add_argument("--warmup-events", type=non_negative, default=10_000)
    parser.add_argument("--keys", type=positive, default=1000, help="bucket-mode keys")
    parser.add_argument("--buckets", type=positive, default=16)
    parser.add_argument("--repeats", type=positive, default=3, help="publish and e2e runs")
    parser.add_argument("--publish-events", type=positive, default=10_000)
    parser.add_argument("--publish-key-keys", type=positive, default=100, help="key-mode keys")
    parser.add_argument("--worker-kills", type=non_negative, default=2)
    parser.add_argument("--node-kills", type=non_negative, default=2)
    parser.add_argument("--memory-queues", type=positive, default=200)
    parser.add_argument("--memory-repeats", type=positive, default=2)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.memory_queues > MAX_MEMORY_QUEUES:
        parser.error(f"--memory-queues at most {MAX_MEMORY_QUEUES} (the nodes' open-files limit)")
    if args.publish_key_keys > MAX_MEMORY_QUEUES:
        parser.error(f"--publish-key-keys at most {MAX_MEMORY_QUEUES}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    params = {**vars(args), "out": str(args.out) if args.out else None}
    result: dict[str, Any] = {"benchmark": "quorum", "params": params}
    errors: list[str] = []
    log_dir = Path(tempfile.mkdtemp(prefix="keyq-bench-quorum-"))
    try:
        with RabbitCluster() as cluster:
            # Every client of this process and of its workers goes to the private cluster.
            os.environ["KEYQ_AMQP_URL"] = ",".join(cluster.urls)
            result["machine"] = machine_info(lambda: cluster_version(cluster))
            result["cluster"] = {
                "nodes": len(cluster.nodes),
                "boot_s": {name: round(value, 1) for name, value in cluster.timings.items()},
                "clients": "KEYQ_AMQP_URL = the three nodes' URLs, comma-separated",
            }
            log(f"cluster up: {result['cluster']}")
            bench = QuorumBench(cluster, args, log_dir)
            try:
                bench.run(result)
            finally:
                bench.finish()
                errors.extend(bench.errors)
    except EXPECTED_ERRORS as exc:
        errors.append(f"aborted: {type(exc).__name__}: {exc}")
    result["targets"] = targets(result)
    result["meets_targets"] = all(t["meets_target"] for t in result["targets"].values())
    result["errors"] = errors
    result["ok"] = not errors
    result["worker_logs"] = str(log_dir)
    result["wall_seconds"] = round(time.monotonic() - started, 1)
    if "machine" in result:
        result["machine"]["loadavg_end"] = list(os.getloadavg())
    emit(result, args.out)
    for error in errors:
        log(f"FAILED: {error}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
