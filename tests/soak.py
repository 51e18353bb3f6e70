"""The combined-fault soak: every fault at once, on real processes and connections.

Two producers publish keyed events (one stream per mode) through fault proxies to a private
RabbitMQ and a private Redis that this soak started and may restart. Worker and janitor
processes run against the same proxies. On a seeded schedule, workers are killed (-9), paused
(SIGSTOP past their lock ttl), added and removed (SIGTERM); connections are cut and slowed;
Redis is killed and restarted once and RabbitMQ stopped and started once. A few poison events
and undecodable payloads are planted. Afterwards an independent checker compares, key by key,
what each worker fold recorded as applied with what the producers had accepted, and reads the
dead-letter queues.

Run longer by hand: ``KEYQ_SOAK_SECONDS=600 KEYQ_SOAK_SEED=7 .venv/bin/pytest -m soak -s``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pika
import redis

from keyq import Producer
from keyq.broker.envelope import HEADER_DEAD_REASON
from keyq.broker.naming import dead_letter_queue_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.settings import load_settings
from tests.faults import FaultProxy
from tests.helpers import drain
from tests.servers import PrivateRabbit, PrivateRedis
from tests.workers import JanitorProcess, WorkerProcess

ROUTINE_FAULTS = ("kill", "pause", "add", "remove", "cut_amqp", "cut_redis", "delay")
MAX_WORKERS_PER_STREAM = 3
BUCKETS = 8
# Lock and membership ttls of the soak's workers: a pause longer than this makes a zombie.
WORKER_ENV = {"KEYQ_LOCK_TTL_MS": "2000", "KEYQ_MEMBER_TTL_MS": "2000"}
# Each poison event costs its worker retries (seconds of Spark jobs) before it is isolated: a few.
POISON_AT = frozenset({200, 1200})
UNDECODABLE = (b"\xff\xfe\x00 not utf-8", b"{not json", b'{"valid": "json", "but": "no key"}')
JANITOR_CATCH_UP_S = 90.0  # at most this long after draining for a first janitor delete


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after faults begin
    kind: str
    stream: str  # "key" or "bucket": which workers it aims at
    seconds: float  # how long a pause or a delay lasts
    pick: float  # which worker, as a fraction of the live ones

    def describe(self) -> str:
        return f"t={self.at:6.1f}s {self.kind:<16} {self.stream:<6} {self.seconds:.1f}s"


def fault_schedule(seed: int, seconds: float, mean_gap: float = 4.0) -> list[Fault]:
    """The faults of one run; the same seed and length always give the same schedule."""
    rng = random.Random(seed)
    faults = [
        Fault(round(rng.uniform(0.25, 0.45) * seconds, 1), "restart_redis", "", 0.0, 0.0),
        Fault(round(rng.uniform(0.55, 0.75) * seconds, 1), "restart_rabbitmq", "", 0.0, 0.0),
    ]
    at = rng.uniform(1.0, mean_gap)
    while at < seconds:
        faults.append(
            Fault(
                round(at, 1),
                rng.choice(ROUTINE_FAULTS),
                rng.choice(("key", "bucket")),
                round(rng.uniform(1.0, 6.0), 1),
                rng.random(),
            )
        )
        at += rng.expovariate(1.0 / mean_gap)
    return sorted(faults, key=lambda fault: fault.at)


class Publisher(threading.Thread):
    """Publishes numbered events to Zipf-skewed keys, new keys appearing as it goes, and
    records every event the producer accepted (an accepted event must be applied once)."""

    def __init__(
        self,
        producer: Producer,
        seed: int,
        rate: float,
        poison_at: frozenset[int],
        stop: threading.Event,
    ) -> None:
        super().__init__(name=f"publisher-{producer.stream}", daemon=True)
        self.producer = producer
        self.rng = random.Random(seed)
        self.rate = rate
        self.poison_at = poison_at  # which of the events sent are poison
        self.stop_event = stop
        self.keys: list[str] = []
        self.accepted: dict[str, list[int]] = {}
        self.poisoned: set[tuple[str, int]] = set()
        self.error: BaseException | None = None

    def _next_key(self) -> str:
        if not self.keys or self.rng.random() < 0.05:
            index = len(self.keys)
            # Keys of several kinds: plain, Unicode, with spaces and dots.
            name = self.rng.choice(("order-{}", "ключ-{}", "dev ice.{}", "账户/{}"))
            self.keys.append(name.format(index))
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
                poison = sent in self.poison_at
                event = {"producer": self.producer.producer_id, "n": n, "poison": poison}
                self.producer.publish(key, event)
                if poison:
                    self.poisoned.add((key, n))
                else:
                    numbers.append(n)
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
    bad_keys: list[dict[str, Any]] = field(default_factory=list)
    producer_stats: dict[str, dict[str, int]] = field(default_factory=dict)
    drain_seconds: float = 0.0
    janitor_deleted: int = 0
    janitor_alive: bool = True
    workers_crashed: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
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

    def text(self) -> str:
        return json.dumps(asdict(self), indent=2, ensure_ascii=False)


def judge_key(stream: str, key: str, accepted: list[int], seen: list[int]) -> KeyVerdict:
    """Compare what a key's producer had accepted with what its state says was applied."""
    copies = Counter(seen)
    firsts = list(dict.fromkeys(seen))
    reordered = sum(1 for before, after in itertools.pairwise(firsts) if after < before)
    expected = set(accepted)
    return KeyVerdict(
        stream=stream,
        key=key,
        accepted=len(accepted),
        applied=len(seen),
        lost=len(expected - copies.keys()),
        reordered=reordered,
        applied_twice=sum(count - 1 for count in copies.values()),
        unexpected=len(copies.keys() - expected),
    )


def applied_by_key(client: redis.Redis, stream: str, producer_id: str) -> dict[str, list[int]]:
    """Read every key's state straight from Redis: the numbers the fold saw, in order."""
    raw: dict[bytes, bytes] = client.hgetall(StreamKeys(stream).state)  # type: ignore[assignment]
    found: dict[str, list[int]] = {}
    for key, value in raw.items():
        state = json.loads(value)
        found[key.decode()] = [int(n) for n in state["seen"].get(producer_id, [])]
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
    """One soak run: its servers, proxies, processes, producers and fault schedule."""

    def __init__(self, folder: Path, seed: int, seconds: float, rate: float = 60.0) -> None:
        self.folder = folder
        self.seed = seed
        self.seconds = seconds
        self.rate = rate
        self.schedule = fault_schedule(seed, seconds)
        self.report = SoakReport(seed, seconds, [fault.describe() for fault in self.schedule])
        self.rng = random.Random(seed + 1)
        tag = f"{seed % 100000:05d}"
        self.streams = {"key": f"soak-key-{tag}", "bucket": f"soak-bucket-{tag}"}
        self.redis_server = PrivateRedis(folder / "redis")
        self.rabbit = PrivateRabbit(folder / "rabbitmq")
        self.log_dir = folder / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers: dict[str, list[WorkerProcess]] = {"key": [], "bucket": []}
        self.retired: list[WorkerProcess] = []
        self.killed: list[WorkerProcess] = []
        self.pending: list[tuple[float, str, Any]] = []  # (due, what, target) to undo a fault
        self.stop_publishing = threading.Event()
        self.publishers: dict[str, Publisher] = {}
        self.producers: dict[str, Producer] = {}
        self.janitor: JanitorProcess | None = None
        self.amqp_proxy: FaultProxy | None = None
        self.redis_proxy: FaultProxy | None = None
        self.started = 0.0
        self.restarts: list[threading.Thread] = []
        self.restart_errors: list[str] = []

    # ------------------------------------------------------------------ set-up
    def note(self, line: str) -> None:
        stamp = time.monotonic() - self.started if self.started else 0.0
        entry = f"[{stamp:7.1f}s] {line}"
        self.report.done.append(entry)
        print(entry, flush=True)

    def start(self) -> None:
        print(f"soak seed={self.seed} seconds={self.seconds}", flush=True)
        for line in self.report.schedule:
            print(f"  planned {line}", flush=True)
        self.redis_server.start()
        self.rabbit.start()
        self.amqp_proxy = FaultProxy("127.0.0.1", self.rabbit.port).start()
        self.redis_proxy = FaultProxy("127.0.0.1", self.redis_server.port).start()
        self.client_settings = load_settings(
            amqp_url=self.amqp_proxy.url_for(self.rabbit.url),
            redis_url=self.redis_proxy.url_for(self.redis_server.url),
            reconnect_timeout=600,
            publish_timeout=600,
        )
        self.direct_settings = load_settings(
            amqp_url=self.rabbit.url, redis_url=self.redis_server.url
        )
        for index, (mode, stream) in enumerate(self.streams.items()):
            producer = Producer(
                stream,
                mode=mode,
                buckets=BUCKETS if mode == "bucket" else None,
                settings=self.client_settings,
                producer_id=f"soak-{mode}",
            )
            self.producers[mode] = producer
            self.publishers[mode] = Publisher(
                producer, self.seed * 10 + index, self.rate, POISON_AT, self.stop_publishing
            )
        self.janitor = JanitorProcess(
            self.client_settings,
            self.log_dir,
            "--idle-ttl",
            "1",
            env={"KEYQ_RECONNECT_TIMEOUT": "600"},
        )
        for mode in self.streams:
            self.add_worker(mode)
        self.add_worker("key")
        for process in self.alive("key") + self.alive("bucket"):
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
        connection = pika.BlockingConnection(pika.URLParameters(self.rabbit.url))
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            for index, body in enumerate(UNDECODABLE):
                queue = config.queue_for(f"planted-{index}")
                channel.queue_declare(queue, passive=True)
                channel.basic_publish(
                    "",
                    queue,
                    body,
                    pika.BasicProperties(delivery_mode=2, message_id=f"planted-{index}"),
                    mandatory=True,
                )
        finally:
            connection.close()
        self.report.dead_letters_planted += len(UNDECODABLE)

    # ---------------------------------------------------------------- processes
    def alive(self, mode: str) -> list[WorkerProcess]:
        return [w for w in self.workers[mode] if w.process.poll() is None]

    def add_worker(self, mode: str) -> WorkerProcess:
        process = WorkerProcess(
            self.client_settings,
            self.streams[mode],
            self.log_dir,
            pipeline="tests.pipelines:ledger",
            env=WORKER_ENV,
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

    # ------------------------------------------------------------------- faults
    def apply(self, fault: Fault) -> None:
        assert self.amqp_proxy is not None and self.redis_proxy is not None
        kind = fault.kind
        if kind == "restart_redis":
            self.note("Redis: kill -9 and start again (AOF, fsync always)")
            self.in_background(self.redis_server.restart, "Redis: back")
        elif kind == "restart_rabbitmq":
            self.note("RabbitMQ: stop and start again (durable queues, persistent messages)")
            self.in_background(self.rabbit.restart, "RabbitMQ: back")
        elif kind == "cut_amqp":
            self.note(f"cut all AMQP connections ({self.amqp_proxy.connections} open)")
            self.amqp_proxy.cut()
        elif kind == "cut_redis":
            self.note(f"cut all Redis connections ({self.redis_proxy.connections} open)")
            self.redis_proxy.cut()
        elif kind == "delay":
            delay = round(0.05 + fault.pick * 0.25, 3)
            self.note(f"delay every byte by {delay * 1000:.0f} ms for {fault.seconds}s")
            self.amqp_proxy.set_delay(delay)
            self.redis_proxy.set_delay(delay)
            self.pending.append((time.monotonic() + fault.seconds, "undelay", None))
        elif kind == "add":
            if len(self.alive(fault.stream)) < MAX_WORKERS_PER_STREAM:
                process = self.add_worker(fault.stream)
                self.note(f"add worker {process.worker_id} to {fault.stream}")
        elif kind == "kill":
            target = self.pick(fault)
            if target is not None:
                target.kill()
                self.killed.append(target)
                self.note(f"kill -9 {target.worker_id} ({fault.stream}); supervisor restarts it")
                self.add_worker(fault.stream)
        elif kind == "pause":
            target = self.pick(fault)
            if target is not None:
                target.pause()
                self.note(f"SIGSTOP {target.worker_id} ({fault.stream}) for {fault.seconds}s")
                self.pending.append((time.monotonic() + fault.seconds, "resume", target))
        elif kind == "remove":
            target = self.pick(fault)
            if target is not None and len(self.alive(fault.stream)) > 1:
                self.note(f"SIGTERM {target.worker_id} ({fault.stream})")
                target.process.send_signal(15)
                self.retired.append(target)

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

    def undo_due(self, now: float, *, everything: bool = False) -> None:
        assert self.amqp_proxy is not None and self.redis_proxy is not None
        keep = []
        for due, what, target in self.pending:
            if due > now and not everything:
                keep.append((due, what, target))
            elif what == "resume":
                target.resume()
                self.note(f"SIGCONT {target.worker_id}")
            else:
                self.amqp_proxy.set_delay(0)
                self.redis_proxy.set_delay(0)
                self.note("delay off")
        self.pending = keep

    def run_faults(self) -> None:
        self.started = time.monotonic()
        upcoming = list(self.schedule)
        while time.monotonic() - self.started < self.seconds or upcoming:
            now = time.monotonic()
            self.undo_due(now)
            if upcoming and now - self.started >= upcoming[0].at:
                self.apply(upcoming.pop(0))
                continue
            for mode, publisher in self.publishers.items():
                if publisher.error is not None:
                    raise AssertionError(f"publisher {mode} failed: {publisher.error!r}")
            time.sleep(0.05)
        for thread in self.restarts:
            thread.join(300)
        if self.restart_errors:
            raise AssertionError(f"a server did not restart: {self.restart_errors}")
        self.undo_due(time.monotonic(), everything=True)

    # ------------------------------------------------------------------ the end
    def finish(self, drain_timeout: float) -> SoakReport:
        self.stop_publishing.set()
        for mode, publisher in self.publishers.items():
            publisher.join(60)
            if publisher.error is not None:
                raise AssertionError(f"publisher {mode} failed: {publisher.error!r}")
        for mode, producer in self.producers.items():
            producer.flush(300)
            self.report.producer_stats[mode] = dict(producer.stats)
        for mode in self.streams:
            if not self.alive(mode):
                self.add_worker(mode)
        self.note(
            "publishing done: "
            + ", ".join(f"{mode} {p.total} events" for mode, p in self.publishers.items())
        )
        begun = time.monotonic()
        client = redis.Redis.from_url(self.direct_settings.redis_url)
        try:
            deadline = begun + drain_timeout
            while True:
                self.check(client)
                if (self.report.lost == 0 and self.report.dead_letters_missing == 0) or (
                    time.monotonic() > deadline
                ):
                    break
                time.sleep(1.0)
            self.report.drain_seconds = round(time.monotonic() - begun, 1)
            # The janitor backs off up to 30 s while RabbitMQ is away; once every key-mode
            # queue is drained and idle it must delete some, and a delete that took events
            # with it would show in the check below.
            deadline = time.monotonic() + JANITOR_CATCH_UP_S
            while self.janitor_deletions() == 0 and time.monotonic() < deadline:
                time.sleep(1.0)
            time.sleep(2.0)  # a late duplicate would show now
            self.check(client)
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

    def janitor_deletions(self) -> int:
        """Queues the janitor has deleted so far, from the tallies it logs per pass."""
        assert self.janitor is not None
        return sum(int(n) for n in re.findall(r"'deleted': (\d+)", self.janitor.log()))

    def check(self, client: redis.Redis) -> None:
        report = self.report
        verdicts: list[KeyVerdict] = []
        for mode, publisher in self.publishers.items():
            stream = self.streams[mode]
            applied = applied_by_key(client, stream, publisher.producer.producer_id)
            for key, accepted in publisher.accepted.items():
                verdicts.append(judge_key(stream, key, accepted, applied.get(key, [])))
            for key in applied.keys() - publisher.accepted.keys():
                verdicts.append(judge_key(stream, key, [], applied[key]))
        report.keys = len(verdicts)
        report.events_accepted = sum(v.accepted for v in verdicts)
        report.events_applied = sum(v.applied for v in verdicts)
        report.lost = sum(v.lost for v in verdicts)
        report.reordered = sum(v.reordered for v in verdicts)
        report.applied_twice = sum(v.applied_twice for v in verdicts)
        report.unexpected = sum(v.unexpected for v in verdicts)
        report.bad_keys = [
            asdict(v) for v in verdicts if v.lost or v.reordered or v.applied_twice or v.unexpected
        ][:20]
        self.check_dead_letters()

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
            for key, reason, body in read_dead_letters(self.rabbit.url, stream):
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
        report.dead_letters_planted = len(planted_poison) + len(UNDECODABLE)
        report.dead_letters_found = len(found_poison) + len(found_bodies)
        report.dead_letters_missing = len(planted_poison - found_poison.keys()) + len(
            planted_bodies.keys() - found_bodies.keys()
        )
        report.dead_letters_unplanted = unplanted + len(found_poison.keys() - planted_poison)
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
        for proxy in (self.amqp_proxy, self.redis_proxy):
            if proxy is not None:
                proxy.stop()
        self.rabbit.stop()
        self.redis_server.stop()


@contextlib.contextmanager
def soak_run(folder: Path, seed: int, seconds: float, rate: float = 60.0) -> Iterator[Soak]:
    soak = Soak(folder, seed, seconds, rate)
    try:
        soak.start()
        yield soak
    finally:
        soak.close()
