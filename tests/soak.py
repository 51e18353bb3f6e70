"""The combined-fault soak: every fault at once on a private RabbitMQ (or 3-node cluster, with
node faults) and Redis, then every key's applied events checked against what its producer
accepted, and the dead letters against what was planted (docs/testing.md, The soak).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from threading import Event
from typing import Any

import pika
import redis

from keyq import Producer, PublishTimeout
from keyq.broker.clock import now_ms
from keyq.broker.connections import open_redis
from keyq.broker.envelope import HEADER_DEAD_REASON
from keyq.broker.naming import base_queue_name, dead_letter_queue_name, key_queue_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.routes import LOG_KEPT, RouteBook
from keyq.broker.settings import Settings, load_settings
from tests.cluster import ClusterError, RabbitCluster
from tests.faults import FaultProxy
from tests.helpers import drain, poll_until
from tests.redis_topologies import RedisClusterServers, redis_topologies_available
from tests.servers import PrivateRabbit, PrivateRedis, private_servers_available
from tests.workers import JanitorProcess, WorkerProcess, run_keyq

MODES = ("key", "bucket", "auto")  # one stream each; a worker fault aims at one of them
ROUTINE_FAULTS = ("kill", "pause", "add", "remove", "cut_amqp", "cut_redis", "delay", "promote")
# The cluster soak's node faults; each kind comes at least once in every run.
NODE_FAULTS = ("stop_leader", "kill_node", "restart_node", "cut_node")
CLUSTER_MAX_KEYS = 300  # a node restart recovers every quorum queue (40-170 s for 2,000)
NODE_FAULT_EVERY_S = 30.0  # a long cluster soak has a node fault about this often
MAX_WORKERS_PER_STREAM = 3
BUCKETS = 8
# Lock and membership ttls of the soak's workers: a pause longer than this makes a zombie.
WORKER_ENV = {"KEYQ_LOCK_TTL_MS": "2000", "KEYQ_MEMBER_TTL_MS": "2000"}
# The auto stream's keys are promoted at 20 events/s or 100 in a batch, and an own queue quiet
# for 3 s is released, so the janitor (idle ttl 1 s) demotes its key within the run.
AUTO_WORKER_ENV = {
    "KEYQ_AUTO_PROMOTE_RATE": "20",
    "KEYQ_AUTO_PROMOTE_BACKLOG": "100",
    "KEYQ_IDLE_RELEASE_MS": "3000",
}
# The operator promotes 1 to 3 distinct keys of the auto stream's last RECENT_KEYS events
# (about 10 s): mostly of the skew's long tail, which go quiet and are demoted within the run.
PROMOTED_AT_MOST = 3
RECENT_KEYS = 600
PROMOTE_TIMEOUT_S = 180.0  # for one ``keyq key promote``
PROMOTE_ATTEMPTS = 3  # a promote that fails (a server down or cut) is run again, after
PROMOTE_RETRY_S = 5.0
POISON_AT = frozenset({200, 1200})
UNDECODABLE = (b"\xff\xfe\x00 not utf-8", b"{not json", b'{"valid": "json", "but": "no key"}')
JANITOR_CATCH_UP_S = 90.0  # at most this long after draining for a first janitor delete
REPLICAS_TIMEOUT_S = 60.0  # after a node fault, for every quorum replica to be online again
STALL_DESCRIBED_AFTER_S = 60.0  # of draining, then the queues of keys still short are described
PUBLISH_TIMEOUT_S = 5.0  # then the event is not accepted, and the publisher goes on
FIGURES = ("accepted", "applied", "lost", "reordered", "applied_twice", "unexpected")


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after faults begin
    kind: str
    stream: str  # "key", "bucket" or "auto": which workers it aims at (promote: "auto")
    seconds: float  # how long a pause or a delay lasts
    pick: float  # which worker, as a fraction of the live ones (promote: how many keys)

    def describe(self) -> str:
        return f"t={self.at:6.1f}s {self.kind:<16} {self.stream:<6} {self.seconds:.1f}s"


def pick_of(items: list[Any], fraction: float) -> Any:
    return items[min(int(fraction * len(items)), len(items) - 1)]


def fault_schedule(
    seed: int, seconds: float, mean_gap: float = 4.0, *, cluster: bool = False
) -> list[Fault]:
    """The faults of one run, the same for the same seed, length and broker. One operator
    promotion comes early, so its keys can go idle and be demoted before the end."""
    rng = random.Random(seed)
    faults = [Fault(round(rng.uniform(0.25, 0.45) * seconds, 1), "restart_redis", "", 0.0, 0.0)]
    if cluster:
        faults += node_fault_schedule(rng, seconds)
    else:
        at = round(rng.uniform(0.55, 0.75) * seconds, 1)
        faults.append(Fault(at, "restart_rabbitmq", "", 0.0, 0.0))
    faults.append(Fault(round(rng.uniform(0.1, 0.3) * seconds, 1), "promote", "auto", 0.0, 0.5))
    at = rng.uniform(1.0, mean_gap)
    while at < seconds:
        kind, stream = rng.choice(ROUTINE_FAULTS), rng.choice(MODES)
        stream = "auto" if kind == "promote" else stream
        faults.append(
            Fault(round(at, 1), kind, stream, round(rng.uniform(1.0, 6.0), 1), rng.random())
        )
        at += rng.expovariate(1.0 / mean_gap)
    return sorted(faults, key=lambda fault: fault.at)


def node_fault_schedule(rng: random.Random, seconds: float) -> list[Fault]:
    """One node fault per :data:`NODE_FAULT_EVERY_S`, every kind at least once, over the first
    80% of the run; a stopped or killed node stays down ``seconds`` (1 to 8)."""
    count = max(len(NODE_FAULTS), round(seconds / NODE_FAULT_EVERY_S))
    longest_down = min(8.0, max(2.0, seconds / 20))
    kinds: list[str] = []
    while len(kinds) < count:
        round_of_kinds = list(NODE_FAULTS)
        rng.shuffle(round_of_kinds)
        kinds += round_of_kinds
    begin = 0.1 * seconds
    slot = (0.8 * seconds - begin) / count
    faults = []
    for index, kind in enumerate(kinds[:count]):
        at = begin + slot * (index + rng.uniform(0.0, 0.5))
        stays_down = kind in ("stop_leader", "kill_node")
        down = round(rng.uniform(1.0, longest_down), 1) if stays_down else 0.0
        faults.append(Fault(round(at, 1), kind, "", down, rng.random()))
    return faults


class Publisher(threading.Thread):
    """Publishes numbered events to Zipf-skewed keys, new keys appearing as it goes (up to
    ``max_keys``), and records every event the producer accepted: each must be applied once."""

    def __init__(
        self, producer: Producer, seed: int, rate: float, stop: Event, max_keys: int | None
    ) -> None:
        super().__init__(name=f"publisher-{producer.stream}", daemon=True)
        self.producer, self.rate, self.stop_event, self.max_keys = producer, rate, stop, max_keys
        self.rng = random.Random(seed)
        self.keys: list[str] = []
        self.recent: deque[str] = deque(maxlen=RECENT_KEYS)  # newest last: what promote picks
        self.accepted: dict[str, list[int]] = {}
        self.poisoned: set[tuple[str, int]] = set()
        self.error: BaseException | None = None
        self.timed_out = 0  # publishes that timed out: those events were not accepted

    def _next_key(self) -> str:
        room = self.max_keys is None or len(self.keys) < self.max_keys
        if not self.keys or (room and self.rng.random() < 0.05):
            name = self.rng.choice(("order-{}", "ключ-{}", "dev ice.{}", "账户/{}"))
            self.keys.append(name.format(len(self.keys)))
        weights = [1.0 / (rank + 1) for rank in range(len(self.keys))]
        return self.rng.choices(self.keys, weights)[0]

    def run(self) -> None:
        started, sent = time.monotonic(), 0
        try:
            while not self.stop_event.is_set():
                key = self._next_key()
                numbers = self.accepted.setdefault(key, [])
                n = (numbers[-1] if numbers else 0) + 1
                while (key, n) in self.poisoned:
                    n += 1
                poison = sent in POISON_AT
                event = {"producer": self.producer.producer_id, "n": n, "poison": poison}
                try:
                    self.producer.publish(key, event, timeout=PUBLISH_TIMEOUT_S)
                except PublishTimeout:  # not accepted (a queue the broker keeps refusing, say)
                    self.timed_out += 1
                    continue
                if poison:
                    self.poisoned.add((key, n))
                else:
                    numbers.append(n)
                self.recent.append(key)
                sent += 1
                time.sleep(max(0.0, started + sent / self.rate - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - reported by the soak
            self.error = exc

    @property
    def total(self) -> int:
        return sum(len(numbers) for numbers in self.accepted.values())


@dataclass
class KeyVerdict:
    stream: str
    key: str
    accepted: int
    applied: int
    lost: int
    reordered: int
    applied_twice: int
    unexpected: int
    unapplied_tail: int = 0  # the last events of the key, none applied (stalled, or lost)


def totals(verdicts: list[KeyVerdict]) -> dict[str, int]:
    return {name: sum(getattr(verdict, name) for verdict in verdicts) for name in FIGURES}


def stalled_events(
    verdicts: list[KeyVerdict], queue_of: Callable[[str], str], unconfirmed_by_queue: dict[str, int]
) -> int:
    """Unapplied events that are unconfirmed, not lost: a queue's unconfirmed events are the last
    of its keys, so its keys' unapplied tails are stalled up to its unconfirmed count only."""
    tails: Counter[str] = Counter()
    for verdict in verdicts:
        tails[queue_of(verdict.key)] += verdict.unapplied_tail
    return sum(min(tail, unconfirmed_by_queue.get(queue, 0)) for queue, tail in tails.items())


@dataclass
class SoakReport:
    seed: int
    seconds: float
    schedule: list[str]
    done: list[str] = field(default_factory=list)
    events_accepted: int = 0
    events_applied: int = 0
    keys: int = 0
    lost: int = 0
    reordered: int = 0
    applied_twice: int = 0
    unexpected: int = 0
    dead_letters_planted: int = 0
    dead_letters_found: int = 0
    dead_letters_missing: int = 0
    dead_letters_unplanted: int = 0
    dead_letter_copies: int = 0
    dead_letter_reasons: dict[str, int] = field(default_factory=dict)
    # Each dead letter not planted (or planted, found under another identity), to follow up.
    unplanted_letters: list[dict[str, str]] = field(default_factory=list)
    bad_keys: list[dict[str, Any]] = field(default_factory=list)
    producer_stats: dict[str, dict[str, int]] = field(default_factory=dict)
    drain_seconds: float = 0.0
    janitor_deleted: int = 0
    # Queues the broker said held messages as the janitor deleted them: where a confirmed event
    # can vanish.
    janitor_deleted_holding: list[str] = field(default_factory=list)
    janitor_alive: bool = True
    workers_crashed: list[str] = field(default_factory=list)
    faults_applied: dict[str, int] = field(default_factory=dict)
    # Events unconfirmed when the final flush gave up, per mode (and queue); at most that many
    # of the keys' unapplied last events are stalled, any more are lost.
    unconfirmed: dict[str, int] = field(default_factory=dict)
    unconfirmed_by_queue: dict[str, dict[str, int]] = field(default_factory=dict)
    stalled: int = 0
    by_mode: dict[str, dict[str, int]] = field(default_factory=dict)  # which stream a bad one is
    # The auto stream's route counts at the end (promoted:<why>, demoted), those before the
    # last fault was over (from the route log), the keys still promoted, and what the operator
    # promotions did.
    route_counts: dict[str, int] = field(default_factory=dict)
    promoted_while_faulting: int = 0
    demoted_while_faulting: int = 0
    still_promoted: int = 0
    operator_promotions: dict[str, int] = field(default_factory=dict)

    @property
    def safe(self) -> bool:
        """Nothing lost, reordered or applied twice; every dead letter as planted."""
        events = (self.lost, self.reordered, self.applied_twice, self.unexpected)
        letters = (self.dead_letters_missing, self.dead_letters_unplanted)
        return self.janitor_alive and not self.workers_crashed and not any(events + letters)

    @property
    def clean(self) -> bool:
        """Safe, and every accepted event confirmed and applied."""
        return self.safe and self.stalled == 0 and not any(self.unconfirmed.values())

    @property
    def promotions(self) -> int:
        return sum(n for why, n in self.route_counts.items() if why.startswith("promoted:"))

    @property
    def demotions(self) -> int:
        return self.route_counts.get("demoted", 0)

    @property
    def passed(self) -> bool:
        """Clean, with the auto stream's moves (a promotion and a demotion) exercised."""
        return self.clean and self.promotions > 0 and self.demotions > 0

    def text(self) -> str:
        return json.dumps(asdict(self), indent=2, ensure_ascii=False)

    def outcome(self) -> str:
        if self.passed:
            return "CLEAN"
        if self.clean:
            return "CLEAN BUT NOT EXERCISED (no promotion or no demotion in the auto stream)"
        if self.safe:
            return "SAFE BUT STALLED (nothing lost, reordered or repeated; some never confirmed)"
        return "NOT CLEAN"

    def verdict(self) -> str:
        """The outcome in a few lines, for a person reading the end of a run."""

        def dumped(value: Any) -> str:
            return json.dumps(value, sort_keys=True, ensure_ascii=False)

        lines = [
            f"verdict: {self.outcome()} (seed {self.seed}, {self.seconds:g}s of faults)",
            f"  events: {self.events_accepted} accepted, {self.events_applied} applied, "
            f"{self.keys} keys",
            f"  lost {self.lost}, reordered {self.reordered}, "
            f"applied twice {self.applied_twice}, unexpected {self.unexpected}",
            *(f"    {mode}: {dumped(figures)}" for mode, figures in self.by_mode.items()),
            f"  never confirmed: {dumped(self.unconfirmed)}, "
            f"{self.stalled} events stalled at the end of their keys",
            f"  dead letters: {self.dead_letters_planted} planted, "
            f"{self.dead_letters_found} found, {self.dead_letters_missing} missing, "
            f"{self.dead_letters_unplanted} unplanted, {self.dead_letter_copies} extra copies",
            *(f"    unplanted: {dumped(letter)}" for letter in self.unplanted_letters),
            f"  faults applied: {dumped(self.faults_applied)}",
            f"  auto mode: {self.promotions} promotions, {self.demotions} demotions "
            f"({dumped(self.route_counts)}; {self.promoted_while_faulting} and "
            f"{self.demoted_while_faulting} while faulting), {self.still_promoted} keys "
            f"still promoted; operator promotions: {dumped(self.operator_promotions)}",
            f"  drained in {self.drain_seconds}s; janitor deleted {self.janitor_deleted} "
            f"queues ({len(self.janitor_deleted_holding)} holding messages), "
            f"{'alive' if self.janitor_alive else 'DEAD'}; "
            f"workers crashed: {len(self.workers_crashed)}",
        ]
        return "\n".join(lines)


def judge_key(stream: str, key: str, accepted: list[int], seen: list[int]) -> KeyVerdict:
    """Compare what a key's producer had accepted with what its state says was applied."""
    copies = Counter(seen)
    firsts = list(dict.fromkeys(seen))
    expected = set(accepted)
    lost, unexpected = len(expected - copies.keys()), len(copies.keys() - expected)
    reordered = sum(1 for before, after in itertools.pairwise(firsts) if after < before)
    twice = sum(count - 1 for count in copies.values())
    # The last events of the key, none applied.
    tail = next((i for i, n in enumerate(reversed(accepted)) if n in copies), len(accepted))
    return KeyVerdict(
        stream, key, len(accepted), len(seen), lost, reordered, twice, unexpected, tail
    )


class SoakRedis:
    """The soak's own Redis, behind a fault proxy for its clients, restarted with kill -9."""

    def __init__(self, folder: Path) -> None:
        self.server = PrivateRedis(folder / "redis")
        self.proxies: list[FaultProxy] = []  # the delay fault slows these

    def start(self) -> None:
        self.server.start()
        self.proxies.append(FaultProxy("127.0.0.1", self.server.port).start())
        self.client_url, self.direct_url = self.proxies[0].url_for(self.server.url), self.server.url

    def fail(self, note: Callable[[str], None]) -> tuple[Callable[[], None], str]:
        """Announce the Redis fault; the action to run in the background, and its end."""
        note("Redis: kill -9 and start again (AOF, fsync always)")
        return self.server.restart, "Redis: back"

    def cut(self) -> str:
        open_now = self.proxies[0].connections
        self.proxies[0].cut()
        return f"cut all Redis connections ({open_now} open)"

    def stop(self) -> None:
        for proxy in self.proxies:
            proxy.stop()
        self.server.stop()


class SoakRedisCluster:
    """A Redis Cluster of the soak's own, whose fault kills the key stream's primary with -9.
    Cluster clients follow the nodes' own addresses, so there is no proxy and no delay fault."""

    def __init__(self, folder: Path, stream: str) -> None:
        self.cluster = RedisClusterServers(folder / "redis-cluster")
        self.slot_key = StreamKeys(stream).config
        self.client_url = self.direct_url = self.cluster.url
        self.proxies: list[FaultProxy] = []

    def start(self) -> None:
        self.cluster.__enter__()

    def fail(self, note: Callable[[str], None]) -> tuple[Callable[[], None], str]:
        primary = self.cluster.primary_for(self.slot_key)
        note(f"Redis Cluster: kill -9 the primary on port {primary.port} (serves the key stream)")

        def failover() -> None:
            old, took = self.cluster.kill_primary_of(self.slot_key)
            note(f"Redis Cluster: a replica took over from {old.port} in {took:.1f}s")
            self.cluster.restart(old)
            self.cluster.await_replicas()

        return failover, "Redis Cluster: the old primary is back, as a replica"

    def cut(self) -> str:
        killed = 0
        for server in self.cluster.servers:
            if server.alive:
                with contextlib.suppress(redis.exceptions.RedisError):
                    killed += int(server.client().client_kill_filter(_type="normal"))
        return f"cut all Redis Cluster connections ({killed} open)"

    def stop(self) -> None:
        self.cluster.close()


def applied_by_key(client: redis.Redis, stream: str, producer_id: str) -> dict[str, list[int]]:
    """Every key's state straight from Redis: the numbers the fold saw, in order."""
    raw: dict[str, str] = client.hgetall(StreamKeys(stream).state)  # type: ignore[assignment]
    return {
        key: [int(n) for n in json.loads(value)["seen"].get(producer_id, [])]
        for key, value in raw.items()
    }


def read_dead_letters(amqp_url: str, stream: str) -> list[tuple[str, str, bytes]]:
    """(key, reason, body) of each dead letter of ``stream``, left in place (not acked)."""
    with pika.BlockingConnection(pika.URLParameters(amqp_url)) as connection:
        landed = drain(connection.channel(), dead_letter_queue_name(stream), ack=False)
    letters = []
    for letter in landed:
        reason = letter.headers.get(HEADER_DEAD_REASON, "")
        text = reason.decode() if isinstance(reason, bytes) else str(reason)
        letters.append((letter.key, text, letter.body))
    return letters


class Soak:
    """One soak run: its servers, proxies, processes, producers and fault schedule."""

    def __init__(
        self,
        folder: Path,
        seed: int,
        seconds: float,
        rate: float = 60.0,
        *,
        cluster: bool = False,
        redis_cluster: bool = False,
        janitor_catch_up: float = JANITOR_CATCH_UP_S,
        progress_every: float | None = None,
    ) -> None:
        self.seed, self.seconds, self.rate = seed, seconds, rate
        self.janitor_catch_up = janitor_catch_up
        self.progress_every = progress_every  # seconds between progress notes, or none
        self.schedule = fault_schedule(seed, seconds, cluster=cluster)
        self.report = SoakReport(seed, seconds, [fault.describe() for fault in self.schedule])
        self.last_verdicts: list[KeyVerdict] = []
        self.rng = random.Random(seed + 1)
        self.streams = {mode: f"soak-{mode}-{seed % 100000:05d}" for mode in MODES}
        self.redis: SoakRedis | SoakRedisCluster = (
            SoakRedisCluster(folder, self.streams["key"]) if redis_cluster else SoakRedis(folder)
        )
        self.cluster = RabbitCluster(folder / "cluster") if cluster else None  # started in start()
        self.rabbit = None if cluster else PrivateRabbit(folder / "rabbitmq")
        # On a cluster, workers log each consumer they open and close (its queue, epoch and
        # consumer tag): a consumer the broker lists on a stuck queue is then traced to one.
        cluster_env = {"KEYQ_QUEUE_TYPE": "quorum", "KEYQ_WORKER_LOG_LEVEL": "debug"}
        self.worker_env = {**WORKER_ENV, **(cluster_env if cluster else {})}
        self.log_dir = folder / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers: dict[str, list[WorkerProcess]] = {mode: [] for mode in MODES}
        self.retired: list[WorkerProcess] = []  # sent SIGTERM
        self.killed: list[WorkerProcess] = []
        self.pending: list[tuple[float, str, Any]] = []  # (due, what, target) to undo a fault
        self.promotions: list[threading.Thread] = []  # operator promotions under way
        self.promoted: Counter[str] = Counter()  # what they did
        self.stopping = Event()  # for the publishers
        self.publishers: dict[str, Publisher] = {}
        self.producers: dict[str, Producer] = {}
        self.janitor: JanitorProcess | None = None
        # Every AMQP client connection goes through these: the broker's, or one per node.
        self.amqp_proxies: list[FaultProxy] = []
        self.started = 0.0
        self.restarts: list[threading.Thread] = []
        self.restart_errors: list[str] = []
        self.node_faults: list[Fault] = []  # due, waiting for the node fault before to end
        self.node_thread: threading.Thread | None = None
        self.node_in_fault: str | None = None  # the node a node fault is taking down
        self.faults_over_ms = 0  # wall clock, ms: when the last fault was over

    def note(self, line: str) -> None:
        entry = f"[{time.monotonic() - self.started if self.started else 0.0:7.1f}s] {line}"
        self.report.done.append(entry)
        print(entry, flush=True)

    def start(self) -> None:
        planned = "".join(f"\n  planned {line}" for line in self.report.schedule)
        print(f"soak seed={self.seed} seconds={self.seconds}{planned}", flush=True)
        self.redis.start()
        if self.cluster is not None:
            began = time.monotonic()
            nodes = ", ".join(self.cluster.start().nodes)
            print(f"cluster up in {time.monotonic() - began:.1f}s: {nodes}", flush=True)
            # Comma-separated: each connection a client opens takes the next node.
            amqp_url, direct_amqp_url = ",".join(self.cluster.proxied_urls), self.cluster.urls[0]
            self.amqp_proxies = [self.cluster.proxy(node) for node in self.cluster.nodes]
        else:
            assert self.rabbit is not None
            self.rabbit.start()
            self.amqp_proxies = [FaultProxy("127.0.0.1", self.rabbit.port).start()]
            amqp_url, direct_amqp_url = (
                self.amqp_proxies[0].url_for(self.rabbit.url),
                self.rabbit.url,
            )
        self.client_settings: Settings = load_settings(
            amqp_url=amqp_url,
            redis_url=self.redis.client_url,
            reconnect_timeout=600,
            publish_timeout=600,
            queue_type="quorum" if self.cluster is not None else None,
        )
        self.direct_settings: Settings = load_settings(
            amqp_url=direct_amqp_url, redis_url=self.redis.direct_url
        )
        max_keys = CLUSTER_MAX_KEYS if self.cluster is not None else None
        for index, (mode, stream) in enumerate(self.streams.items()):
            producer = self.producers[mode] = Producer(
                stream,
                mode=mode,
                buckets=BUCKETS if mode in ("bucket", "auto") else None,
                settings=self.client_settings,
                producer_id=f"soak-{mode}",
            )
            seed = self.seed * 10 + index
            self.publishers[mode] = Publisher(producer, seed, self.rate, self.stopping, max_keys)
        # At DEBUG a line per queue deleted, to follow a lost event to its queue.
        options = ["--idle-ttl", "1", "--log-level", "DEBUG"]
        env = {"KEYQ_RECONNECT_TIMEOUT": "600"}
        self.janitor = JanitorProcess(self.client_settings, self.log_dir, *options, env=env)
        # Two of key and auto: a key's bucket and its own queue may have different holders.
        for mode in (*MODES, "key", "auto"):
            self.add_worker(mode)
        for process in [w for mode in MODES for w in self.alive(mode)]:
            process.wait_ready(180)
        for publisher in self.publishers.values():
            publisher.start()
        self.plant_undecodable()

    def plant_undecodable(self) -> None:
        """Payloads no worker can decode, into bucket queues (never deleted: nothing races)."""
        producer = self.producers["bucket"]
        for index in range(len(UNDECODABLE)):  # the producer declares the bucket queues
            producer.publish(f"planted-{index}", {"producer": "planter", "n": 1})
        producer.flush(60)
        with pika.BlockingConnection(pika.URLParameters(self.direct_settings.amqp_url)) as conn:
            channel = conn.channel()
            channel.confirm_delivery()
            for index, body in enumerate(UNDECODABLE):
                queue = producer.config.queue_for(f"planted-{index}")
                channel.queue_declare(queue, passive=True)
                properties = pika.BasicProperties(delivery_mode=2, message_id=f"planted-{index}")
                channel.basic_publish("", queue, body, properties, mandatory=True)

    def alive(self, mode: str) -> list[WorkerProcess]:
        return [w for w in self.workers[mode] if w.process.poll() is None]

    def add_worker(self, mode: str) -> WorkerProcess:
        env = {**self.worker_env, **(AUTO_WORKER_ENV if mode == "auto" else {})}
        where = (self.client_settings, self.streams[mode], self.log_dir)
        self.workers[mode].append(WorkerProcess(*where, pipeline="tests.pipelines:ledger", env=env))
        return self.workers[mode][-1]

    def pick(self, fault: Fault) -> WorkerProcess | None:
        """A live worker of the fault's stream, neither paused nor leaving."""
        skip = {id(target) for _, what, target in self.pending if what == "resume"}
        skip |= {id(target) for target in self.retired}
        candidates = [w for w in self.alive(fault.stream) if id(w) not in skip]
        return pick_of(candidates, fault.pick) if candidates else None

    def apply(self, fault: Fault) -> None:
        kind, stream = fault.kind, fault.stream
        if kind in ("kill", "pause", "remove"):
            target = self.pick(fault)
            if target is None or (kind == "remove" and len(self.alive(stream)) <= 1):
                return
        if kind == "restart_redis":
            self.in_background(*self.redis.fail(self.note))
        elif kind == "restart_rabbitmq":
            assert self.rabbit is not None
            self.note("RabbitMQ: stop and start again (durable queues, persistent messages)")
            self.in_background(self.rabbit.restart, "RabbitMQ: back")
        elif kind == "cut_node":
            self.cut_node(fault)
        elif kind in NODE_FAULTS:
            self.node_faults.append(fault)  # started in turn by start_node_fault
            return
        elif kind == "cut_amqp":
            open_now = sum(proxy.connections for proxy in self.amqp_proxies)
            self.note(f"cut all AMQP connections ({open_now} open)")
            for proxy in self.amqp_proxies:
                proxy.cut()
        elif kind == "cut_redis":
            self.note(self.redis.cut())
        elif kind == "delay":
            delay = round(0.05 + fault.pick * 0.25, 3)
            self.note(f"delay every byte by {delay * 1000:.0f} ms for {fault.seconds}s")
            for proxy in self.amqp_proxies + self.redis.proxies:
                proxy.set_delay(delay)
            self.pending.append((time.monotonic() + fault.seconds, "undelay", None))
        elif kind == "add":
            if len(self.alive(stream)) >= MAX_WORKERS_PER_STREAM:
                return
            self.note(f"add worker {self.add_worker(stream).worker_id} to {stream}")
        elif kind == "kill":
            target.kill()
            self.killed.append(target)
            self.note(f"kill -9 {target.worker_id} ({stream}); supervisor restarts it")
            self.add_worker(stream)
        elif kind == "pause":
            target.pause()
            self.note(f"SIGSTOP {target.worker_id} ({stream}) for {fault.seconds}s")
            self.pending.append((time.monotonic() + fault.seconds, "resume", target))
        elif kind == "remove":
            self.note(f"SIGTERM {target.worker_id} ({stream})")
            target.process.send_signal(signal.SIGTERM)
            self.retired.append(target)
        elif kind == "promote" and not self.promote_recent(fault):
            return  # nothing published yet
        self.report.faults_applied[kind] = self.report.faults_applied.get(kind, 0) + 1

    def promote_recent(self, fault: Fault) -> bool:
        """An operator promotes some of the auto stream's latest keys; False if there is none."""
        recent = list(dict.fromkeys(reversed(self.publishers["auto"].recent)))
        if not recent:
            return False
        keys = self.rng.sample(recent, min(len(recent), 1 + int(fault.pick * PROMOTED_AT_MOST)))
        self.note(f"operator: keyq key promote {' '.join(repr(k) for k in keys)} (auto)")
        self.promotions.append(threading.Thread(target=self.run_promote, args=(keys,), daemon=True))
        self.promotions[-1].start()
        return True

    def run_promote(self, keys: list[str]) -> None:
        """``keyq key promote`` (exit 0 promoted, 1 refused) until it answers: a server down or
        cut fails it, and an operator runs it again a little later, up to PROMOTE_ATTEMPTS."""
        command = ["key", "promote", *keys, "--stream", self.streams["auto"], "--json"]
        for attempt in range(1, PROMOTE_ATTEMPTS + 1):
            rows: list[dict[str, Any]] = []
            refused: list[str] = []
            try:
                done = run_keyq(self.client_settings, *command, timeout=PROMOTE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - reported by the soak
                failure = repr(exc)
            else:
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    answer = json.loads(done.stdout)
                    rows, refused = answer["promoted"], answer["refused"]
                if done.returncode in (0, 1) and len(rows) + len(refused) == len(keys):
                    break
                output = (done.stderr or done.stdout).strip().splitlines()[-3:]
                failure = f"exit {done.returncode}: {output}"
            self.note(f"operator: promote {keys} failed ({failure})")
            if attempt == PROMOTE_ATTEMPTS:
                self.promoted["failed"] += len(keys)
                return
            time.sleep(PROMOTE_RETRY_S)
        for row in rows:
            self.promoted["already" if row["already"] else "promoted"] += 1
        self.promoted["refused"] += len(refused)
        moves = [
            f"{row['key']!r} {'already ' if row['already'] else ''}promoted to {row['queue']} "
            f"(epoch {row['epoch']}, move {row['move']}, why {row['why']})"
            for row in rows
        ]
        self.note(f"operator: {'; '.join(moves)}" + (f"; refused {refused}" if refused else ""))

    def in_background(self, action: Any, done: str) -> None:
        """Restart a server while the other faults go on (a restart takes many seconds)."""

        def run() -> None:
            try:
                action()
                self.note(done)
            except BaseException as exc:  # noqa: BLE001 - reported by the soak
                self.restart_errors.append(f"{done}: {exc!r}")

        thread = threading.Thread(target=run, name=done, daemon=True)
        thread.start()
        self.restarts.append(thread)

    def cut_node(self, fault: Fault) -> None:
        """Reset one running node's client connections (a cut takes no node down)."""
        assert self.cluster is not None
        up = [n for n in self.cluster.nodes if self.cluster.is_up(n) and n != self.node_in_fault]
        node = pick_of(up, fault.pick)
        open_now = self.cluster.proxy(node).connections
        self.note(f"node {node}: cut its {open_now} client connections")
        self.cluster.cut(node)

    def start_node_fault(self) -> None:
        """Start the next due node fault unless one is under way: at most one node is down."""
        if not self.node_faults or (self.node_thread is not None and self.node_thread.is_alive()):
            return
        fault = self.node_faults.pop(0)
        late = time.monotonic() - self.started - fault.at
        self.node_thread = threading.Thread(
            target=self.run_node_fault, args=(fault, late), name=f"soak-{fault.kind}", daemon=True
        )
        self.node_thread.start()

    def busiest_node(self, fault: Fault) -> tuple[str, str]:
        """The node leading the most of the streams' queues now, and how many it leads."""
        assert self.cluster is not None
        prefixes = tuple(f"keyq.{stream}." for stream in self.streams.values())
        leaders = Counter(
            leader
            for queue, leader in self.cluster.leaders("keyq.").items()
            if queue.startswith(prefixes)
        )
        if not leaders:
            return pick_of(self.cluster.nodes, fault.pick), "no queue yet"
        node, count = leaders.most_common(1)[0]
        return node, f"leads {count} of the streams' {sum(leaders.values())} queues"

    def run_node_fault(self, fault: Fault, late: float) -> None:
        """One node fault from start to end: the node is back and every replica online."""
        cluster, kind = self.cluster, fault.kind
        assert cluster is not None
        waited = f" ({late:.1f}s late: the node fault before it was not over)" if late > 1 else ""
        goes_down = kind != "restart_node"
        try:
            if kind == "stop_leader":
                node, leads = self.busiest_node(fault)
                what = f"stop, gracefully ({leads})"
            else:
                node = pick_of(cluster.nodes, fault.pick)
                what = "kill -9" if kind == "kill_node" else "restart (stop and start)"
            self.node_in_fault = node
            self.note(f"node {node}: {what}{waited}")
            if goes_down:
                taken = cluster.stop(node) if kind == "stop_leader" else cluster.kill(node)
            self.report.faults_applied[kind] = self.report.faults_applied.get(kind, 0) + 1
            if goes_down:
                self.note(f"node {node}: down in {taken:.1f}s, stays down {fault.seconds}s")
                time.sleep(fault.seconds)
            back = cluster.restart(node)
            how = "started again" if goes_down else "restarted"
            self.note(f"node {node}: back, {how} in {back:.1f}s")
            self.await_replicas()
        except BaseException as exc:  # noqa: BLE001 - reported by the soak
            self.restart_errors.append(f"{kind}: {exc!r}")
            self.note(f"node fault {kind} failed: {exc!r}")
        finally:
            self.node_in_fault = None

    def await_replicas(self) -> None:
        """Every replica online again before the next node fault; past the timeout, a note."""
        assert self.cluster is not None
        began = time.monotonic()
        try:
            self.cluster.await_replicas("keyq.", timeout=REPLICAS_TIMEOUT_S)
        except ClusterError as exc:
            self.note(f"going on with quorum queues short of a replica: {exc}")
            return
        self.note(f"every quorum replica online ({time.monotonic() - began:.1f}s)")

    def restore_nodes(self) -> None:
        """Every node running and every replica online, whatever a node fault left (normally
        nothing)."""
        assert self.cluster is not None
        down = [node for node in self.cluster.nodes if not self.cluster.is_up(node)]
        for node in down:
            self.note(f"node {node}: down after the faults, start it again")
            self.cluster.restart(node)
        if down:
            self.await_replicas()

    def undo_due(self, now: float, *, everything: bool = False) -> None:
        keep = []
        for due, what, target in self.pending:
            if due > now and not everything:
                keep.append((due, what, target))
            elif what == "resume":
                target.resume()
                self.note(f"SIGCONT {target.worker_id}")
            else:
                for proxy in self.amqp_proxies + self.redis.proxies:
                    proxy.set_delay(0)
                self.note("delay off")
        self.pending = keep

    def progress(self) -> None:
        """A note of what the producers have done so far (with ``progress_every``)."""
        done = [
            f"{m} {p.total} accepted, {self.producers[m].stats}" for m, p in self.publishers.items()
        ]
        self.note(f"progress: {'; '.join(done)}")

    def check_publishers(self) -> None:
        for mode, publisher in self.publishers.items():
            if publisher.error is not None:
                raise AssertionError(f"publisher {mode} failed: {publisher.error!r}")

    def run_faults(self) -> None:
        self.started = time.monotonic()
        upcoming = list(self.schedule)
        next_progress = self.started + (self.progress_every or 0.0)
        while time.monotonic() - self.started < self.seconds or upcoming or self.node_faults:
            now = time.monotonic()
            if self.progress_every and now >= next_progress:
                self.progress()
                next_progress = now + self.progress_every
            self.undo_due(now)
            if upcoming and now - self.started >= upcoming[0].at:
                self.apply(upcoming.pop(0))
                continue
            self.start_node_fault()
            self.check_publishers()
            time.sleep(0.05)
        if self.node_thread is not None:
            self.node_thread.join(600)
        for thread in self.restarts:
            thread.join(300)
        for thread in self.promotions:
            thread.join(PROMOTE_ATTEMPTS * (PROMOTE_TIMEOUT_S + PROMOTE_RETRY_S))
        self.report.operator_promotions = dict(sorted(self.promoted.items()))
        self.faults_over_ms = now_ms()
        if self.progress_every:
            self.progress()
        if self.cluster is not None and not self.restart_errors:
            self.restore_nodes()
        if self.restart_errors:
            raise AssertionError(f"a server did not restart: {self.restart_errors}")
        self.undo_due(time.monotonic(), everything=True)

    def finish(self, drain_timeout: float) -> SoakReport:
        report = self.report
        self.stopping.set()
        for publisher in self.publishers.values():
            publisher.join(60)
        self.check_publishers()
        for mode, producer in self.producers.items():
            try:
                producer.flush(300)
            except PublishTimeout as exc:
                # Checked all the same: the events that were confirmed must all be there.
                report.unconfirmed[mode] = producer.unconfirmed
                report.unconfirmed_by_queue[mode] = producer.unconfirmed_by_queue
                self.note(f"{mode}: {exc}; checking the rest")
            timeouts = self.publishers[mode].timed_out
            report.producer_stats[mode] = {**producer.stats, "publish_timeouts": timeouts}
        for mode in MODES:
            if not self.alive(mode):
                self.add_worker(mode)
        published = ", ".join(f"{mode} {p.total} events" for mode, p in self.publishers.items())
        self.note(f"publishing done: {published}")
        begun = time.monotonic()
        described = False

        def drained() -> bool:
            nonlocal described
            self.check(client)
            if not described and time.monotonic() - begun > STALL_DESCRIBED_AFTER_S:
                described = True  # a stall may clear before the drain ends: describe it now
                lost = json.dumps({mode: f["lost"] for mode, f in report.by_mode.items()})
                self.note(
                    f"still draining: {report.lost} events missing ({lost}), {report.stalled} "
                    f"stalled, {report.dead_letters_missing} dead letters missing"
                )
                self.describe_bad_queues(self.last_verdicts)
            settled = report.stalled == sum(report.unconfirmed.values())
            return report.lost == 0 and settled and report.dead_letters_missing == 0

        # The janitor backs off up to 30 s while RabbitMQ is away; once every key-mode queue is
        # drained and idle it must delete some, and a delete that took events with it would
        # show in the check after. Likewise an idle own queue of the auto stream: its key is
        # demoted (if none was during the run, one is now).
        def janitor_caught_up() -> bool:
            report.route_counts = book.counts()
            deleted = self.janitor_deletions() > 0
            return deleted and (report.demotions > 0 or report.promotions == 0)

        client = open_redis(self.direct_settings)
        try:
            with contextlib.suppress(TimeoutError):  # the check after says what is missing
                poll_until(drained, drain_timeout, 1.0, lambda last: last or TimeoutError())
            report.drain_seconds = round(time.monotonic() - begun, 1)
            book = RouteBook(client, self.streams["auto"])
            with contextlib.suppress(TimeoutError):
                poll_until(janitor_caught_up, self.janitor_catch_up, 1.0, lambda _: TimeoutError())
            time.sleep(2.0)  # a late duplicate would show now
            self.check(client)
            self.describe_bad_queues(self.last_verdicts)
            report.route_counts = dict(sorted(book.counts().items()))
            report.still_promoted = book.count()
            changes = Counter(
                str(row.get("what"))
                for row in book.history(limit=LOG_KEPT)
                if int(str(row.get("at", 0))) <= self.faults_over_ms
            )
            report.promoted_while_faulting = changes["promoted"]
            report.demoted_while_faulting = changes["demoted"]
        finally:
            client.close()
        self.note(f"checked after {report.drain_seconds}s of draining")
        self.check_daemons()
        return report

    def check_daemons(self) -> None:
        """Every daemon this soak did not stop itself must still be running."""
        stopped = {id(process) for process in self.killed + self.retired}
        self.report.workers_crashed = [
            f"{w.worker_id}: {w.log()[-1500:]}"
            for ws in self.workers.values()
            for w in ws
            if w.process.poll() is not None and id(w) not in stopped
        ]
        assert self.janitor is not None
        self.report.janitor_alive = self.janitor.process.poll() is None
        self.report.janitor_deleted = self.janitor_deletions()
        self.report.janitor_deleted_holding = re.findall(
            r"queue (\S+): the broker counted \d+ messages when deleting it", self.janitor.log()
        )

    def janitor_deletions(self) -> int:
        """Queues the janitor has deleted so far, from the tallies it logs per pass."""
        assert self.janitor is not None
        return sum(int(n) for n in re.findall(r"'deleted': (\d+)", self.janitor.log()))

    def check(self, client: redis.Redis) -> None:
        """Every key of every stream judged on its state in Redis, then the dead letters."""
        report = self.report
        verdicts: list[KeyVerdict] = []
        report.stalled, report.by_mode = 0, {}
        for mode, publisher in self.publishers.items():
            stream, accepted = self.streams[mode], publisher.accepted
            applied = applied_by_key(client, stream, publisher.producer.producer_id)
            judged = [  # every key accepted, then any other the state holds
                judge_key(stream, key, accepted.get(key, []), applied.get(key, []))
                for key in {**accepted, **applied}
            ]
            unconfirmed = report.unconfirmed_by_queue.get(mode, {})
            stalled = stalled_events(judged, publisher.producer.config.queue_for, unconfirmed)
            report.by_mode[mode] = figures = {**totals(judged), "stalled": stalled}
            figures["lost"] -= stalled
            report.stalled += stalled
            verdicts += judged
        figures = totals(verdicts)
        report.keys = len(verdicts)
        report.events_accepted, report.events_applied = figures["accepted"], figures["applied"]
        report.lost = figures["lost"] - report.stalled
        report.reordered, report.applied_twice = figures["reordered"], figures["applied_twice"]
        report.unexpected = figures["unexpected"]
        report.bad_keys = [
            asdict(v) for v in verdicts if v.lost or v.reordered or v.applied_twice or v.unexpected
        ][:20]
        self.last_verdicts = verdicts
        self.check_dead_letters()

    def describe_bad_queues(self, verdicts: list[KeyVerdict]) -> None:
        """On a cluster, print the broker's side of each key-mode queue of a bad key."""
        cluster = self.cluster
        wanted = {
            key_queue_name(v.stream, v.key, incarnations=True): v.key
            for v in verdicts
            if (v.lost or v.unapplied_tail) and v.stream == self.streams["key"]
        }
        if cluster is None or not wanted:
            return
        up = [index for index in range(len(cluster.nodes)) if cluster.is_up(index)]
        if not up:
            return
        columns = ("name", "messages_ready", "messages_unacknowledged", "consumers", "online")
        found: dict[str, list[dict[str, Any]]] = {}
        try:  # a diagnostic must not cost the verdict
            for row in cluster.list_queues(*columns, "members", via=up[0]):
                found.setdefault(base_queue_name(row["name"]), []).append(row)
        except Exception as exc:  # noqa: BLE001
            print(f"could not list the bad keys' queues: {exc!r}", flush=True)
            return
        for queue, key in sorted(wanted.items()):
            rows = found.get(queue, "no such queue (any incarnation)")
            print(f"queue of bad key {key!r}: {rows}", flush=True)
        queues = {row["name"] for queue in wanted for row in found.get(queue, [])}
        if not queues:
            return

        def listing(command: str, *columns: str) -> list[dict[str, Any]]:
            out = cluster.ctl(up[0], command, "-q", *columns, "--formatter", "json")
            return [dict(row) for row in json.loads(out or "[]")]

        # The consumers' tags name the worker, whose debug log records each consumer it opens;
        # one whose channel no node lists is kept by the broker for a client that left. A
        # channel that does not answer fails the second listing, so the first prints alone.
        try:
            columns = ("queue_name", "channel_pid", "consumer_tag", "active")
            consumers = [
                r for r in listing("list_consumers", *columns) if r.get("queue_name") in queues
            ]
            print("".join(f"consumer {row}\n" for row in consumers), end="", flush=True)
            listed = listing("list_channels", "pid", "consumer_count", "messages_unacknowledged")
            channels = {str(row.get("pid")): row for row in listed}
        except Exception as exc:  # noqa: BLE001
            print(f"could not list consumers or channels: {str(exc)[:300]}", flush=True)
            return
        for row in consumers:
            channel = channels.get(str(row.get("channel_pid")))
            where = f"open channel {channel}" if channel else "a channel no node lists"
            print(f"consumer {row.get('consumer_tag')}: {where}", flush=True)

    def check_dead_letters(self) -> None:
        """Every planted poison event and undecodable payload dead-lettered, and nothing else."""
        report = self.report
        planted: set[Any] = {
            (self.streams[mode], key, n)
            for mode, publisher in self.publishers.items()
            for key, n in publisher.poisoned
        } | set(UNDECODABLE)
        found: Counter[Any] = Counter()  # (stream, key, n) of a poison event, or a planted body
        reasons: Counter[str] = Counter()
        report.unplanted_letters = []  # judged again on each check
        for stream in self.streams.values():
            for key, reason, body in read_dead_letters(self.direct_settings.amqp_url, stream):
                reasons[reason.split(":")[0][:60]] += 1
                try:
                    event = json.loads(body)
                except ValueError:
                    event = None
                if isinstance(event, dict) and event.get("poison") and "planted poison" in reason:
                    found[(stream, key, int(event["n"]))] += 1
                elif body in UNDECODABLE:
                    found[body] += 1
                else:
                    text = body[:200].decode("utf-8", "replace")
                    letter = {"stream": stream, "key": key, "reason": reason[:300], "body": text}
                    report.unplanted_letters.append(letter)
        report.unplanted_letters += [
            {"stream": stream, "key": key, "reason": "planted poison", "body": f"n={n}"}
            for stream, key, n in sorted(found.keys() - planted)
        ]
        report.dead_letters_planted, report.dead_letters_found = len(planted), len(found)
        report.dead_letters_missing = len(planted - found.keys())
        report.dead_letters_unplanted = len(report.unplanted_letters)
        report.dead_letter_copies = found.total() - len(found)
        report.dead_letter_reasons = dict(reasons)

    def close(self) -> None:
        self.stopping.set()
        for publisher in self.publishers.values():
            publisher.join(5)
        for producer in self.producers.values():
            with contextlib.suppress(Exception):
                producer.close(5)
        for process in [*itertools.chain(*self.workers.values()), self.janitor]:
            if process is not None:  # the retired are among the workers
                process.close()
        if self.rabbit is not None:
            for proxy in self.amqp_proxies:
                proxy.stop()
            self.rabbit.stop()
        if self.cluster is not None:
            self.keep_node_logs()
            self.cluster.close()
        self.redis.stop()

    def keep_node_logs(self) -> None:
        """Copy the nodes' logs beside the workers' (closing the cluster removes its folder)."""
        assert self.cluster is not None
        for index in range(len(self.cluster.nodes)):
            source = self.cluster.folder / f"n{index + 1}"
            target = self.log_dir / f"rabbit-n{index + 1}"
            for path in [source / "console.log", *sorted((source / "log").glob("*.log"))]:
                with contextlib.suppress(OSError):
                    target.mkdir(exist_ok=True)
                    shutil.copyfile(path, target / path.name)


def run_soak(
    folder: Path, seed: int, seconds: float, drain_timeout: float, **options: Any
) -> SoakReport:
    """One soak, start to verdict: its report written to ``soak-report.json`` and printed."""
    soak = Soak(folder, seed, seconds, **options)
    try:
        soak.start()
        soak.run_faults()
        report = soak.finish(drain_timeout)
    finally:
        soak.close()
    (folder / "soak-report.json").write_text(report.text())
    print(f"{report.text()}\n{report.verdict()}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    """One soak by hand: prints the seed, the schedule, each fault and the verdict; exits 0 only
    if the run was clean and the auto stream's keys were promoted and demoted."""
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=main.__doc__)
    parser.add_argument("--cluster", action="store_true", help="a 3-node RabbitMQ cluster")
    parser.add_argument("--redis-cluster", action="store_true", help="a Redis Cluster")
    for flag, default, what in (
        ("--seconds", 600.0, "of faults"),
        ("--rate", 60.0, "events/s per producer"),
        ("--drain-timeout", 300.0, "s to wait for every event"),
        ("--janitor-catch-up", JANITOR_CATCH_UP_S, "s to wait for a first janitor delete"),
        ("--progress", 15.0, "s between progress notes (0: none)"),
    ):
        parser.add_argument(flag, type=float, default=default, help=f"{what} ({default:g})")
    parser.add_argument("--seed", type=int, default=None, help="replay a run (default: random)")
    parser.add_argument("--folder", type=Path, default=None, help="for data and logs")
    args = parser.parse_args(argv)
    missing = private_servers_available() or (
        redis_topologies_available() if args.redis_cluster else None
    )
    if missing:
        print(f"cannot soak here: {missing}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    folder = args.folder or Path(tempfile.mkdtemp(prefix="keyq-soak-"))
    print(f"soak folder (logs under logs/): {folder}", flush=True)
    options = {"rate": args.rate, "cluster": args.cluster, "redis_cluster": args.redis_cluster}
    options |= {"janitor_catch_up": args.janitor_catch_up, "progress_every": args.progress or None}
    try:
        report = run_soak(folder, seed, args.seconds, args.drain_timeout, **options)
    except Exception as exc:  # noqa: BLE001 - the run failed before a verdict: say so
        print(f"verdict: FAILED (seed {seed}): {exc!r}\nlogs: {folder / 'logs'}", flush=True)
        return 1
    print(f"report: {folder / 'soak-report.json'}, logs: {folder / 'logs'}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
