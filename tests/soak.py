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
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
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
from tests.helpers import drain
from tests.redis_topologies import RedisClusterServers, redis_topologies_available
from tests.servers import PrivateRabbit, PrivateRedis, private_servers_available
from tests.workers import JanitorProcess, WorkerProcess, run_keyq

# One stream per mode; worker faults aim at one of them.
MODES = ("key", "bucket", "auto")
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


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after faults begin
    kind: str
    stream: str  # "key", "bucket" or "auto": which workers it aims at (promote: "auto")
    seconds: float  # how long a pause or a delay lasts
    pick: float  # which worker, as a fraction of the live ones (promote: how many keys)

    def describe(self) -> str:
        return f"t={self.at:6.1f}s {self.kind:<16} {self.stream:<6} {self.seconds:.1f}s"


# How long the drain may go on before the soak describes the queues of keys still short.
STALL_DESCRIBED_AFTER_S = 60.0


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
        faults.append(
            Fault(round(rng.uniform(0.55, 0.75) * seconds, 1), "restart_rabbitmq", "", 0.0, 0.0)
        )
    faults.append(Fault(round(rng.uniform(0.1, 0.3) * seconds, 1), "promote", "auto", 0.0, 0.5))
    at = rng.uniform(1.0, mean_gap)
    while at < seconds:
        kind = rng.choice(ROUTINE_FAULTS)
        stream = rng.choice(MODES)
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
    begin, end = 0.1 * seconds, 0.8 * seconds
    slot = (end - begin) / count
    faults = []
    for index, kind in enumerate(kinds[:count]):
        at = begin + slot * (index + rng.uniform(0.0, 0.5))
        down = (
            round(rng.uniform(1.0, longest_down), 1)
            if kind in ("stop_leader", "kill_node")
            else 0.0
        )
        faults.append(Fault(round(at, 1), kind, "", down, rng.random()))
    return faults


PUBLISH_TIMEOUT_S = 5.0  # then the event is not accepted, and the publisher goes on


class Publisher(threading.Thread):
    """Publishes numbered events to Zipf-skewed keys, new keys appearing as it goes, and
    records every event the producer accepted (an accepted event must be applied once)."""

    def __init__(
        self,
        producer: Producer,
        seed: int,
        rate: float,
        stop: threading.Event,
        max_keys: int | None = None,
    ) -> None:
        super().__init__(name=f"publisher-{producer.stream}", daemon=True)
        self.max_keys = max_keys  # no new keys past this many (None: no bound)
        self.producer = producer
        self.rng = random.Random(seed)
        self.rate = rate
        self.stop_event = stop
        self.keys: list[str] = []
        # The keys of the last events accepted, newest last (the promote fault copies it).
        self.recent: deque[str] = deque(maxlen=RECENT_KEYS)
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
        started = time.monotonic()
        sent = 0
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
                except PublishTimeout:
                    # Not accepted (a queue the broker keeps refusing, say): nothing to check.
                    self.timed_out += 1
                    continue
                if poison:
                    self.poisoned.add((key, n))
                else:
                    numbers.append(n)
                self.recent.append(key)
                sent += 1
                pause = started + sent / self.rate - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
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


def stalled_events(
    verdicts: list[KeyVerdict],
    queue_of: Callable[[str], str],
    unconfirmed_by_queue: dict[str, int],
) -> int:
    """Unapplied events that are unconfirmed, not lost: a queue's unconfirmed events are the last
    of its keys, so its keys' unapplied tails are stalled up to its unconfirmed count only."""
    tails: dict[str, int] = {}
    for verdict in verdicts:
        queue = queue_of(verdict.key)
        tails[queue] = tails.get(queue, 0) + verdict.unapplied_tail
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
    # Queues the broker said held messages when the janitor deleted them: where a confirmed
    # event can vanish.
    janitor_deleted_holding: list[str] = field(default_factory=list)
    janitor_alive: bool = True
    workers_crashed: list[str] = field(default_factory=list)
    faults_applied: dict[str, int] = field(default_factory=dict)
    # Events unconfirmed when the final flush gave up, per mode (and queue); at most that many
    # of the keys' unapplied last events are stalled, any more are lost.
    unconfirmed: dict[str, int] = field(default_factory=dict)
    unconfirmed_by_queue: dict[str, dict[str, int]] = field(default_factory=dict)
    stalled: int = 0
    # The figures per mode, to tell which stream a bad one comes from.
    by_mode: dict[str, dict[str, int]] = field(default_factory=dict)
    # The auto stream's route counts at the end (promoted:<why>, demoted), the keys still
    # promoted then, and what the operator promotions did.
    route_counts: dict[str, int] = field(default_factory=dict)
    promoted_while_faulting: int = 0  # before the last fault was over (from the route log)
    demoted_while_faulting: int = 0
    still_promoted: int = 0
    operator_promotions: dict[str, int] = field(default_factory=dict)

    @property
    def safe(self) -> bool:
        """Nothing lost, reordered or applied twice; every dead letter as planted."""
        return (
            self.janitor_alive
            and not self.workers_crashed
            and self.lost == 0
            and self.reordered == 0
            and self.applied_twice == 0
            and self.unexpected == 0
            and self.dead_letters_missing == 0
            and self.dead_letters_unplanted == 0
        )

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
    def exercised(self) -> bool:
        """Keys of the auto stream were promoted and demoted: its moves were tried."""
        return self.promotions > 0 and self.demotions > 0

    @property
    def passed(self) -> bool:
        """Clean, with the auto stream's moves exercised."""
        return self.clean and self.exercised

    def text(self) -> str:
        return json.dumps(asdict(self), indent=2, ensure_ascii=False)

    def outcome(self) -> str:
        if self.clean and not self.exercised:
            return "CLEAN BUT NOT EXERCISED (no promotion or no demotion in the auto stream)"
        if self.clean:
            return "CLEAN"
        if self.safe:
            return "SAFE BUT STALLED (nothing lost, reordered or repeated; some never confirmed)"
        return "NOT CLEAN"

    def verdict(self) -> str:
        """The outcome in a few lines, for a person reading the end of a run."""
        return "\n".join(
            [
                f"verdict: {self.outcome()} (seed {self.seed}, {self.seconds:g}s of faults)",
                f"  events: {self.events_accepted} accepted, {self.events_applied} applied, "
                f"{self.keys} keys",
                f"  lost {self.lost}, reordered {self.reordered}, "
                f"applied twice {self.applied_twice}, unexpected {self.unexpected}",
                *(
                    f"    {mode}: {json.dumps(figures, sort_keys=True)}"
                    for mode, figures in self.by_mode.items()
                ),
                f"  never confirmed: {json.dumps(self.unconfirmed, sort_keys=True)}, "
                f"{self.stalled} events stalled at the end of their keys",
                f"  dead letters: {self.dead_letters_planted} planted, "
                f"{self.dead_letters_found} found, {self.dead_letters_missing} missing, "
                f"{self.dead_letters_unplanted} unplanted, {self.dead_letter_copies} extra copies",
                *(
                    f"    unplanted: {json.dumps(letter, ensure_ascii=False)}"
                    for letter in self.unplanted_letters
                ),
                f"  faults applied: {json.dumps(self.faults_applied, sort_keys=True)}",
                f"  auto mode: {self.promotions} promotions, {self.demotions} demotions "
                f"({json.dumps(self.route_counts, sort_keys=True)}; "
                f"{self.promoted_while_faulting} and {self.demoted_while_faulting} while "
                f"faulting), {self.still_promoted} keys still promoted; operator promotions: "
                f"{json.dumps(self.operator_promotions, sort_keys=True)}",
                f"  drained in {self.drain_seconds}s; janitor deleted {self.janitor_deleted} "
                f"queues ({len(self.janitor_deleted_holding)} holding messages), "
                f"{'alive' if self.janitor_alive else 'DEAD'}; "
                f"workers crashed: {len(self.workers_crashed)}",
            ]
        )


def judge_key(stream: str, key: str, accepted: list[int], seen: list[int]) -> KeyVerdict:
    """Compare what a key's producer had accepted with what its state says was applied."""
    copies = Counter(seen)
    firsts = list(dict.fromkeys(seen))
    reordered = sum(1 for before, after in itertools.pairwise(firsts) if after < before)
    expected = set(accepted)
    tail = 0
    for n in reversed(accepted):
        if n in copies:
            break
        tail += 1
    return KeyVerdict(
        stream=stream,
        key=key,
        accepted=len(accepted),
        applied=len(seen),
        lost=len(expected - copies.keys()),
        reordered=reordered,
        applied_twice=sum(count - 1 for count in copies.values()),
        unexpected=len(copies.keys() - expected),
        unapplied_tail=tail,
    )


class SoakRedis:
    """The soak's own Redis: one server behind a fault proxy, restarted with kill -9."""

    def __init__(self, folder: Path) -> None:
        self.server = PrivateRedis(folder / "redis")
        self.proxy: FaultProxy | None = None

    def start(self) -> None:
        self.server.start()
        self.proxy = FaultProxy("127.0.0.1", self.server.port).start()

    @property
    def client_url(self) -> str:
        """For producers, workers and the janitor: through the proxy."""
        assert self.proxy is not None
        return self.proxy.url_for(self.server.url)

    @property
    def direct_url(self) -> str:
        return self.server.url

    def fail(self, note: Callable[[str], None]) -> tuple[Callable[[], None], str]:
        """Announce the Redis fault; the action to run in the background, and its end."""
        note("Redis: kill -9 and start again (AOF, fsync always)")
        return self.server.restart, "Redis: back"

    def cut(self) -> str:
        assert self.proxy is not None
        open_now = self.proxy.connections
        self.proxy.cut()
        return f"cut all Redis connections ({open_now} open)"

    def set_delay(self, seconds: float) -> None:
        assert self.proxy is not None
        self.proxy.set_delay(seconds)

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.server.stop()


class SoakRedisCluster:
    """A Redis Cluster of the soak's own, whose fault kills the key stream's primary with -9.
    Cluster clients follow the nodes' own addresses, so there is no proxy and no delay fault."""

    def __init__(self, folder: Path, stream: str) -> None:
        self.cluster = RedisClusterServers(folder / "redis-cluster")
        self.slot_key = StreamKeys(stream).config
        self.started = False

    def start(self) -> None:
        self.cluster.__enter__()
        self.started = True

    @property
    def client_url(self) -> str:
        return self.cluster.url

    @property
    def direct_url(self) -> str:
        return self.cluster.url

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

    def set_delay(self, seconds: float) -> None:
        """No proxy in front of a cluster: Redis is not delayed."""

    def stop(self) -> None:
        if self.started:
            self.cluster.close()


def applied_by_key(client: redis.Redis, stream: str, producer_id: str) -> dict[str, list[int]]:
    """Read every key's state straight from Redis: the numbers the fold saw, in order."""
    raw: dict[str, str] = client.hgetall(StreamKeys(stream).state)  # type: ignore[assignment]
    found: dict[str, list[int]] = {}
    for key, value in raw.items():
        state = json.loads(value)
        found[key] = [int(n) for n in state["seen"].get(producer_id, [])]
    return found


def read_dead_letters(amqp_url: str, stream: str) -> list[tuple[str, str, bytes]]:
    """(key, reason, body) of every message in the stream's dead-letter queue, left in place."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        # Not acked: closing the connection puts every letter back.
        landed = drain(connection.channel(), dead_letter_queue_name(stream), ack=False)
    finally:
        connection.close()
    letters = []
    for letter in landed:
        reason = letter.headers.get(HEADER_DEAD_REASON, "")
        text = reason.decode() if isinstance(reason, bytes) else str(reason)
        letters.append((letter.key, text, letter.body))
    return letters


class Soak:
    """One soak run: its servers, proxies, processes, producers and fault schedule (with
    ``cluster`` a RabbitMQ cluster, with ``redis_cluster`` a Redis Cluster, of its own)."""

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
        self.folder = folder
        self.seed = seed
        self.seconds = seconds
        self.rate = rate
        self.janitor_catch_up = janitor_catch_up
        self.progress_every = progress_every  # seconds between progress notes, or none
        self.schedule = fault_schedule(seed, seconds, cluster=cluster)
        self.report = SoakReport(seed, seconds, [fault.describe() for fault in self.schedule])
        self.last_verdicts: list[KeyVerdict] = []
        self.rng = random.Random(seed + 1)
        tag = f"{seed % 100000:05d}"
        self.streams = {mode: f"soak-{mode}-{tag}" for mode in MODES}
        self.redis: SoakRedis | SoakRedisCluster = (
            SoakRedisCluster(folder, self.streams["key"]) if redis_cluster else SoakRedis(folder)
        )
        # One broker, or a cluster (created here, started in start()).
        self.cluster = RabbitCluster(folder / "cluster") if cluster else None
        self.rabbit = None if cluster else PrivateRabbit(folder / "rabbitmq")
        # On a cluster, workers log each consumer they open and close (its queue, epoch and
        # consumer tag): a consumer the broker lists on a stuck queue is then traced to one.
        cluster_env = {"KEYQ_QUEUE_TYPE": "quorum", "KEYQ_WORKER_LOG_LEVEL": "debug"}
        self.worker_env = {**WORKER_ENV, **(cluster_env if cluster else {})}
        self.log_dir = folder / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers: dict[str, list[WorkerProcess]] = {mode: [] for mode in MODES}
        self.promotions: list[threading.Thread] = []  # operator promotions under way
        self.promoted: Counter[str] = Counter()  # what they did
        self.retired: list[WorkerProcess] = []
        self.killed: list[WorkerProcess] = []
        self.pending: list[tuple[float, str, Any]] = []  # (due, what, target) to undo a fault
        self.stop_publishing = threading.Event()
        self.publishers: dict[str, Publisher] = {}
        self.producers: dict[str, Producer] = {}
        self.janitor: JanitorProcess | None = None
        self.amqp_proxy: FaultProxy | None = None
        self.started = 0.0
        self.restarts: list[threading.Thread] = []
        self.restart_errors: list[str] = []
        self.node_faults: list[Fault] = []  # due, waiting for the node fault before to end
        self.node_thread: threading.Thread | None = None
        self.node_in_fault: str | None = None  # the node a node fault is taking down
        self.applied: Counter[str] = Counter()
        self.faults_over_ms = 0  # wall clock, ms: when the last fault was over

    def note(self, line: str) -> None:
        stamp = time.monotonic() - self.started if self.started else 0.0
        entry = f"[{stamp:7.1f}s] {line}"
        self.report.done.append(entry)
        print(entry, flush=True)

    def start(self) -> None:
        print(f"soak seed={self.seed} seconds={self.seconds}", flush=True)
        for line in self.report.schedule:
            print(f"  planned {line}", flush=True)
        self.redis.start()
        if self.cluster is not None:
            began = time.monotonic()
            nodes = ", ".join(self.cluster.start().nodes)
            print(f"cluster up in {time.monotonic() - began:.1f}s: {nodes}", flush=True)
            # Comma-separated: each connection a client opens takes the next node.
            amqp_url = ",".join(self.cluster.proxied_urls)
            direct_amqp_url = self.cluster.urls[0]
            queue_type: str | None = "quorum"
        else:
            assert self.rabbit is not None
            self.rabbit.start()
            self.amqp_proxy = FaultProxy("127.0.0.1", self.rabbit.port).start()
            amqp_url = self.amqp_proxy.url_for(self.rabbit.url)
            direct_amqp_url = self.rabbit.url
            queue_type = None
        self.client_settings: Settings = load_settings(
            amqp_url=amqp_url,
            redis_url=self.redis.client_url,
            reconnect_timeout=600,
            publish_timeout=600,
            queue_type=queue_type,
        )
        self.direct_settings: Settings = load_settings(
            amqp_url=direct_amqp_url, redis_url=self.redis.direct_url
        )
        for index, (mode, stream) in enumerate(self.streams.items()):
            producer = Producer(
                stream,
                mode=mode,
                buckets=BUCKETS if mode in ("bucket", "auto") else None,
                settings=self.client_settings,
                producer_id=f"soak-{mode}",
            )
            self.producers[mode] = producer
            max_keys = CLUSTER_MAX_KEYS if self.cluster is not None else None
            seed = self.seed * 10 + index
            self.publishers[mode] = Publisher(
                producer, seed, self.rate, self.stop_publishing, max_keys
            )
        # DEBUG: a line per queue deleted, to follow a lost event to its queue.
        options = ["--idle-ttl", "1", "--log-level", "DEBUG"]
        env = {"KEYQ_RECONNECT_TIMEOUT": "600"}
        self.janitor = JanitorProcess(self.client_settings, self.log_dir, *options, env=env)
        for mode in self.streams:
            self.add_worker(mode)
        self.add_worker("key")
        self.add_worker("auto")  # a key's bucket and its own queue may have different holders
        for process in [w for mode in self.streams for w in self.alive(mode)]:
            process.wait_ready(180)
        for publisher in self.publishers.values():
            publisher.start()
        self.plant_undecodable()

    def plant_undecodable(self) -> None:
        """Publish payloads no worker can decode straight into bucket queues (buckets are
        never deleted, so nothing races these)."""
        producer = self.producers["bucket"]
        for index in range(len(UNDECODABLE)):  # the producer declares the bucket queues
            producer.publish(f"planted-{index}", {"producer": "planter", "n": 1})
        producer.flush(60)
        config = producer.config
        connection = pika.BlockingConnection(pika.URLParameters(self.direct_settings.amqp_url))
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            for index, body in enumerate(UNDECODABLE):
                queue = config.queue_for(f"planted-{index}")
                channel.queue_declare(queue, passive=True)
                properties = pika.BasicProperties(delivery_mode=2, message_id=f"planted-{index}")
                channel.basic_publish("", queue, body, properties, mandatory=True)
        finally:
            connection.close()
        self.report.dead_letters_planted += len(UNDECODABLE)

    def alive(self, mode: str) -> list[WorkerProcess]:
        return [w for w in self.workers[mode] if w.process.poll() is None]

    def add_worker(self, mode: str) -> WorkerProcess:
        process = WorkerProcess(
            self.client_settings,
            self.streams[mode],
            self.log_dir,
            pipeline="tests.pipelines:ledger",
            env={**self.worker_env, **(AUTO_WORKER_ENV if mode == "auto" else {})},
        )
        self.workers[mode].append(process)
        return process

    def pick(self, fault: Fault, *, running_only: bool = True) -> WorkerProcess | None:
        paused = {id(target) for _, what, target in self.pending if what == "resume"}
        leaving = {id(target) for target in self.retired}
        candidates = [
            w
            for w in self.alive(fault.stream)
            if id(w) not in leaving and (not running_only or id(w) not in paused)
        ]
        if not candidates:
            return None
        return candidates[min(int(fault.pick * len(candidates)), len(candidates) - 1)]

    def amqp_proxies(self) -> list[FaultProxy]:
        """The proxies every AMQP client connection goes through: the broker's, or one per
        cluster node."""
        if self.cluster is not None:
            return [self.cluster.proxy(node) for node in self.cluster.nodes]
        assert self.amqp_proxy is not None
        return [self.amqp_proxy]

    def apply(self, fault: Fault) -> None:
        amqp_proxies = self.amqp_proxies()
        kind = fault.kind
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
            open_now = sum(proxy.connections for proxy in amqp_proxies)
            self.note(f"cut all AMQP connections ({open_now} open)")
            for proxy in amqp_proxies:
                proxy.cut()
        elif kind == "cut_redis":
            self.note(self.redis.cut())
        elif kind == "delay":
            delay = round(0.05 + fault.pick * 0.25, 3)
            self.note(f"delay every byte by {delay * 1000:.0f} ms for {fault.seconds}s")
            for proxy in amqp_proxies:
                proxy.set_delay(delay)
            self.redis.set_delay(delay)
            self.pending.append((time.monotonic() + fault.seconds, "undelay", None))
        elif kind == "add":
            if len(self.alive(fault.stream)) >= MAX_WORKERS_PER_STREAM:
                return
            process = self.add_worker(fault.stream)
            self.note(f"add worker {process.worker_id} to {fault.stream}")
        elif kind == "kill":
            target = self.pick(fault)
            if target is None:
                return
            target.kill()
            self.killed.append(target)
            self.note(f"kill -9 {target.worker_id} ({fault.stream}); supervisor restarts it")
            self.add_worker(fault.stream)
        elif kind == "pause":
            target = self.pick(fault)
            if target is None:
                return
            target.pause()
            self.note(f"SIGSTOP {target.worker_id} ({fault.stream}) for {fault.seconds}s")
            self.pending.append((time.monotonic() + fault.seconds, "resume", target))
        elif kind == "remove":
            target = self.pick(fault)
            if target is None or len(self.alive(fault.stream)) <= 1:
                return
            self.note(f"SIGTERM {target.worker_id} ({fault.stream})")
            target.process.send_signal(15)
            self.retired.append(target)
        elif kind == "promote" and not self.promote_recent(fault):
            return  # nothing published yet
        self.applied[kind] += 1
        self.report.faults_applied = dict(sorted(self.applied.items()))

    def promote_recent(self, fault: Fault) -> bool:
        """An operator promotes a few keys of the auto stream among those published last, in the
        background; False when nothing was published yet."""
        recent = list(dict.fromkeys(reversed(self.publishers["auto"].recent)))
        if not recent:
            return False
        count = min(len(recent), 1 + int(fault.pick * PROMOTED_AT_MOST))
        keys = self.rng.sample(recent, count)
        self.note(f"operator: keyq key promote {' '.join(repr(k) for k in keys)} (auto)")
        self.promotions.append(threading.Thread(target=self.run_promote, args=(keys,), daemon=True))
        self.promotions[-1].start()
        return True

    def run_promote(self, keys: list[str]) -> None:
        """``keyq key promote`` until it answers (a server down or cut fails it: an operator
        runs it again a little later), :data:`PROMOTE_ATTEMPTS` times at most."""
        for attempt in range(1, PROMOTE_ATTEMPTS + 1):
            if self.promote_once(keys, last=attempt == PROMOTE_ATTEMPTS):
                return
            time.sleep(PROMOTE_RETRY_S)

    def promote_once(self, keys: list[str], *, last: bool) -> bool:
        """One ``keyq key promote`` (exit 0 promoted, 1 refused); False when it failed
        otherwise (noted, and counted as failed on the ``last`` attempt)."""
        command = ["key", "promote", *keys, "--stream", self.streams["auto"], "--json"]
        try:
            done = run_keyq(self.client_settings, *command, timeout=PROMOTE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - reported by the soak
            self.promoted["failed"] += len(keys) if last else 0
            self.note(f"operator: promote {keys} failed: {exc!r}")
            return False
        rows: list[dict[str, Any]] = []
        refused: list[str] = []
        with contextlib.suppress(ValueError, TypeError, KeyError):
            answer = json.loads(done.stdout)
            rows, refused = answer["promoted"], answer["refused"]
        if done.returncode not in (0, 1) or len(rows) + len(refused) != len(keys):
            self.promoted["failed"] += len(keys) if last else 0
            output = (done.stderr or done.stdout).strip().splitlines()[-3:]
            self.note(f"operator: promote {keys} failed (exit {done.returncode}): {output}")
            return False
        for row in rows:
            self.promoted["already" if row["already"] else "promoted"] += 1
        self.promoted["refused"] += len(refused)
        self.note(
            "operator: "
            + "; ".join(
                f"{row['key']!r} {'already ' if row['already'] else ''}promoted to "
                f"{row['queue']} (epoch {row['epoch']}, move {row['move']}, why {row['why']})"
                for row in rows
            )
            + (f"; refused {refused}" if refused else "")
        )
        return True

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
        busy = self.node_in_fault
        up = [n for n in self.cluster.nodes if self.cluster.is_up(n) and n != busy]
        node = up[min(int(fault.pick * len(up)), len(up) - 1)]
        open_now = self.cluster.proxy(node).connections
        self.note(f"node {node}: cut its {open_now} client connections")
        self.cluster.cut(node)

    def start_node_fault(self) -> None:
        """Start the next due node fault in the background, unless the one before is still
        going on: node faults take turns, so at most one node is ever down."""
        if not self.node_faults or (self.node_thread is not None and self.node_thread.is_alive()):
            return
        fault = self.node_faults.pop(0)
        late = time.monotonic() - self.started - fault.at
        self.node_thread = threading.Thread(
            target=self.run_node_fault, args=(fault, late), name=f"soak-{fault.kind}", daemon=True
        )
        self.node_thread.start()

    def pick_node(self, fault: Fault) -> str:
        assert self.cluster is not None
        nodes = self.cluster.nodes
        return nodes[min(int(fault.pick * len(nodes)), len(nodes) - 1)]

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
            return self.pick_node(fault), "no queue yet"
        node, count = leaders.most_common(1)[0]
        return node, f"leads {count} of the streams' {sum(leaders.values())} queues"

    def run_node_fault(self, fault: Fault, late: float) -> None:
        """One node fault from start to end: the node is back and every replica online."""
        cluster = self.cluster
        assert cluster is not None
        kind = fault.kind
        waited = f" ({late:.1f}s late: the node fault before it was not over)" if late > 1 else ""
        try:
            if kind == "stop_leader":
                node, leads = self.busiest_node(fault)
                self.node_in_fault = node
                self.note(f"node {node}: stop, gracefully ({leads}){waited}")
                taken = cluster.stop(node)
            else:
                node = self.node_in_fault = self.pick_node(fault)
                if kind == "kill_node":
                    self.note(f"node {node}: kill -9{waited}")
                    taken = cluster.kill(node)
                else:
                    self.note(f"node {node}: restart (stop and start){waited}")
                    taken = 0.0
            self.applied[kind] += 1
            self.report.faults_applied = dict(sorted(self.applied.items()))
            if kind == "restart_node":
                back = cluster.restart(node)
                self.note(f"node {node}: back, restarted in {back:.1f}s")
            else:
                self.note(f"node {node}: down in {taken:.1f}s, stays down {fault.seconds}s")
                time.sleep(fault.seconds)
                back = cluster.restart(node)
                self.note(f"node {node}: back, started again in {back:.1f}s")
            self.await_replicas()
        except BaseException as exc:  # noqa: BLE001 - reported by the soak
            self.restart_errors.append(f"{kind}: {exc!r}")
            self.note(f"node fault {kind} failed: {exc!r}")
        finally:
            self.node_in_fault = None

    def await_replicas(self) -> None:
        """Before the next node fault, every replica online again; past the timeout the soak
        says which queues are short (see RabbitCluster.await_replicas) and goes on."""
        assert self.cluster is not None
        began = time.monotonic()
        try:
            self.cluster.await_replicas("keyq.", timeout=REPLICAS_TIMEOUT_S)
        except ClusterError as exc:
            self.note(f"going on with quorum queues short of a replica: {exc}")
            return
        self.note(f"every quorum replica online ({time.monotonic() - began:.1f}s)")

    def restore_nodes(self) -> None:
        """Every node running and every replica online, whatever a node fault left (each node
        fault ends with its node back and every replica online, so normally nothing)."""
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
                for proxy in self.amqp_proxies():
                    proxy.set_delay(0)
                self.redis.set_delay(0)
                self.note("delay off")
        self.pending = keep

    def progress(self) -> None:
        """A note of what the producers have done so far (with ``progress_every``)."""
        self.note(
            "progress: "
            + "; ".join(
                f"{mode} {publisher.total} accepted, {self.producers[mode].stats}"
                for mode, publisher in self.publishers.items()
            )
        )

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
            for mode, publisher in self.publishers.items():
                if publisher.error is not None:
                    raise AssertionError(f"publisher {mode} failed: {publisher.error!r}")
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
        self.stop_publishing.set()
        for mode, publisher in self.publishers.items():
            publisher.join(60)
            if publisher.error is not None:
                raise AssertionError(f"publisher {mode} failed: {publisher.error!r}")
        for mode, producer in self.producers.items():
            try:
                producer.flush(300)
            except PublishTimeout as exc:
                # Checked all the same: the events that were confirmed must all be there.
                self.report.unconfirmed[mode] = producer.unconfirmed
                self.report.unconfirmed_by_queue[mode] = producer.unconfirmed_by_queue
                self.note(f"{mode}: {exc}; checking the rest")
            self.report.producer_stats[mode] = {
                **producer.stats,
                "publish_timeouts": self.publishers[mode].timed_out,
            }
        for mode in self.streams:
            if not self.alive(mode):
                self.add_worker(mode)
        self.note(
            "publishing done: "
            + ", ".join(f"{mode} {p.total} events" for mode, p in self.publishers.items())
        )
        begun = time.monotonic()
        client = open_redis(self.direct_settings)
        try:
            deadline = begun + drain_timeout
            described = False
            while True:
                self.check(client)
                if not described and time.monotonic() - begun > STALL_DESCRIBED_AFTER_S:
                    # A stall may clear before the drain ends: describe it while it lasts.
                    described = True
                    self.note(
                        f"still draining: {self.report.lost} events missing "
                        f"({json.dumps({m: f['lost'] for m, f in self.report.by_mode.items()})}), "
                        f"{self.report.stalled} stalled, "
                        f"{self.report.dead_letters_missing} dead letters missing"
                    )
                    self.describe_bad_queues(self.last_verdicts)
                settled = self.report.stalled == sum(self.report.unconfirmed.values())
                if (
                    self.report.lost == 0 and settled and self.report.dead_letters_missing == 0
                ) or (time.monotonic() > deadline):
                    break
                time.sleep(1.0)
            self.report.drain_seconds = round(time.monotonic() - begun, 1)
            # The janitor backs off up to 30 s while RabbitMQ is away; once every key-mode
            # queue is drained and idle it must delete some, and a delete that took events
            # with it would show in the check below. Likewise an idle own queue of the auto
            # stream: its key is demoted (if none was during the run, one is now).
            book = RouteBook(client, self.streams["auto"])
            deadline = time.monotonic() + self.janitor_catch_up
            while time.monotonic() < deadline:
                with contextlib.suppress(redis.exceptions.RedisError):
                    self.report.route_counts = book.counts()
                if self.janitor_deletions() > 0 and (
                    self.report.demotions > 0 or self.report.promotions == 0
                ):
                    break
                time.sleep(1.0)
            time.sleep(2.0)  # a late duplicate would show now
            self.check(client)
            self.describe_bad_queues(self.last_verdicts)
            self.report.route_counts = dict(sorted(book.counts().items()))
            self.report.still_promoted = book.count()
            changes = Counter(
                str(row.get("what"))
                for row in book.history(limit=LOG_KEPT)
                if int(str(row.get("at", 0))) <= self.faults_over_ms
            )
            self.report.promoted_while_faulting = changes["promoted"]
            self.report.demoted_while_faulting = changes["demoted"]
        finally:
            client.close()
        self.note(f"checked after {self.report.drain_seconds}s of draining")
        self.check_daemons()
        return self.report

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
        report = self.report
        verdicts: list[KeyVerdict] = []
        report.stalled = 0
        report.by_mode = {}
        for mode, publisher in self.publishers.items():
            stream = self.streams[mode]
            applied = applied_by_key(client, stream, publisher.producer.producer_id)
            judged = [
                judge_key(stream, key, accepted, applied.get(key, []))
                for key, accepted in publisher.accepted.items()
            ]
            judged += [
                judge_key(stream, key, [], applied[key])
                for key in applied.keys() - publisher.accepted.keys()
            ]
            stalled = stalled_events(
                judged,
                publisher.producer.config.queue_for,
                report.unconfirmed_by_queue.get(mode, {}),
            )
            report.stalled += stalled
            report.by_mode[mode] = {
                "accepted": sum(v.accepted for v in judged),
                "applied": sum(v.applied for v in judged),
                "lost": sum(v.lost for v in judged) - stalled,
                "stalled": stalled,
                "reordered": sum(v.reordered for v in judged),
                "applied_twice": sum(v.applied_twice for v in judged),
                "unexpected": sum(v.unexpected for v in judged),
            }
            verdicts += judged
        report.keys = len(verdicts)
        report.events_accepted = sum(v.accepted for v in verdicts)
        report.events_applied = sum(v.applied for v in verdicts)
        report.lost = sum(v.lost for v in verdicts) - report.stalled
        report.reordered = sum(v.reordered for v in verdicts)
        report.applied_twice = sum(v.applied_twice for v in verdicts)
        report.unexpected = sum(v.unexpected for v in verdicts)
        report.bad_keys = [
            asdict(v) for v in verdicts if v.lost or v.reordered or v.applied_twice or v.unexpected
        ][:20]
        self.last_verdicts = verdicts
        self.check_dead_letters()

    def describe_bad_queues(self, verdicts: list[KeyVerdict]) -> None:
        """On a cluster, print what the broker holds in each key-mode queue of a key judged
        bad, and its consumers, before the cluster is torn down."""
        cluster = self.cluster
        wanted = {
            key_queue_name(v.stream, v.key, incarnations=True): v.key
            for v in verdicts
            if (v.lost or v.unapplied_tail) and v.stream == self.streams.get("key")
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
            for row in consumers:
                print(f"consumer {row}", flush=True)
            columns = ("pid", "consumer_count", "messages_unacknowledged")
            channels = {str(row.get("pid")): row for row in listing("list_channels", *columns)}
        except Exception as exc:  # noqa: BLE001
            print(f"could not list consumers or channels: {str(exc)[:300]}", flush=True)
            return
        for row in consumers:
            channel = channels.get(str(row.get("channel_pid")))
            print(
                f"consumer {row.get('consumer_tag')}: "
                + (f"open channel {channel}" if channel else "a channel no node lists"),
                flush=True,
            )

    def check_dead_letters(self) -> None:
        report = self.report
        planted_poison = {
            (self.streams[mode], key, n)
            for mode, publisher in self.publishers.items()
            for key, n in publisher.poisoned
        }
        planted_bodies = Counter(UNDECODABLE)
        found_poison: Counter[tuple[str, str, int]] = Counter()
        found_bodies: Counter[bytes] = Counter()
        reasons: Counter[str] = Counter()
        unplanted = 0
        for stream in self.streams.values():
            for key, reason, body in read_dead_letters(self.direct_settings.amqp_url, stream):
                reasons[reason.split(":")[0][:60]] += 1
                try:
                    event = json.loads(body)
                except ValueError:
                    event = None
                if isinstance(event, dict) and event.get("poison") and "planted poison" in reason:
                    found_poison[(stream, key, int(event["n"]))] += 1
                elif body in planted_bodies:
                    found_bodies[body] += 1
                else:
                    unplanted += 1
                    report.unplanted_letters.append(
                        {
                            "stream": stream,
                            "key": key,
                            "reason": reason[:300],
                            "body": body[:200].decode("utf-8", "replace"),
                        }
                    )
        report.dead_letters_planted = len(planted_poison) + len(UNDECODABLE)
        report.dead_letters_found = len(found_poison) + len(found_bodies)
        report.dead_letters_missing = len(planted_poison - found_poison.keys()) + len(
            planted_bodies.keys() - found_bodies.keys()
        )
        report.dead_letters_unplanted = unplanted + len(found_poison.keys() - planted_poison)
        report.unplanted_letters += [
            {"stream": stream, "key": key, "reason": "planted poison", "body": f"n={n}"}
            for stream, key, n in sorted(found_poison.keys() - planted_poison)
        ]
        report.dead_letter_copies = (
            sum(found_poison.values()) + sum(found_bodies.values()) - (report.dead_letters_found)
        )
        report.dead_letter_reasons = dict(reasons)

    def close(self) -> None:
        self.stop_publishing.set()
        for publisher in self.publishers.values():
            publisher.join(5)
        for producer in self.producers.values():
            with contextlib.suppress(Exception):
                producer.close(5)
        for process in [w for ws in self.workers.values() for w in ws] + self.retired:
            process.close()
        if self.janitor is not None:
            self.janitor.close()
        if self.amqp_proxy is not None:
            self.amqp_proxy.stop()
        if self.rabbit is not None:
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


@contextlib.contextmanager
def soak_run(folder: Path, seed: int, seconds: float, **options: Any) -> Iterator[Soak]:
    soak = Soak(folder, seed, seconds, **options)
    try:
        soak.start()
        yield soak
    finally:
        soak.close()


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
    try:
        with soak_run(
            folder,
            seed,
            args.seconds,
            rate=args.rate,
            cluster=args.cluster,
            redis_cluster=args.redis_cluster,
            janitor_catch_up=args.janitor_catch_up,
            progress_every=args.progress or None,
        ) as soak:
            soak.run_faults()
            report = soak.finish(drain_timeout=args.drain_timeout)
    except Exception as exc:  # noqa: BLE001 - the run failed before a verdict: say so
        print(f"verdict: FAILED (seed {seed}): {exc!r}", flush=True)
        print(f"logs: {folder / 'logs'}", flush=True)
        return 1
    (folder / "soak-report.json").write_text(report.text())
    print(report.text())
    print(f"report: {folder / 'soak-report.json'}, logs: {folder / 'logs'}")
    print(report.verdict(), flush=True)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
