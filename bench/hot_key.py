"""A hot, slow key and its bucket's neighbours: how long the neighbours wait, per stream mode.

Each round runs one stream of its own in one mode (``--modes``; they take turns, in reverse
order every other round, ``--rounds`` of each) with ``--workers`` ``keyq worker`` processes
running ``bench.pipelines:slow_count``: each key's state is the count of its events applied,
and an event of a key starting with ``slow.`` costs 1 ms (a sleep in the reducer). After an
untimed warm-up on other keys, one process publishes, paced, for ``--seconds``:

* the HOT key ``slow.hot`` at ``--hot-rate`` events/s (2,000: twice what its 1 ms step can
  apply, so its backlog grows whatever the mode);
* ``--neighbours`` keys at ``--neighbour-rate`` events/s each, chosen so that each hashes to
  the hot key's bucket (``keyq.broker.hashing.bucket_of`` over ``--buckets``): in bucket
  mode they share its queue, in key mode each has a queue of its own, in auto mode they
  share it until the workers promote the hot key to a queue of its own.

Latency is publish → state committed. Each event's publish time (``time.monotonic()`` just
before ``Producer.publish``) is noted by key and number; a poller reads every key's committed
count from Redis every ``--poll-ms`` (one MGET). A key's events are applied in order, so when
a key's count reaches n its events up to the nth are committed: each newly covered event's
latency is the poll's time (after the read) less its publish time, an overestimate by at most
a poll interval and a Redis round trip. After publishing the round waits up to
``--drain-timeout`` seconds for every neighbour event; one still uncommitted then counts with
its wait so far (a lower bound) and is reported as ``censored``.

Per round: neighbours' p50/p95/p99/max (also p99 by 10-second window of publish time), the hot
key's own latency of what got committed, its lag (age of its oldest uncommitted event) and
backlog at the end of publishing and at most while publishing, how late the publisher ran,
which worker held which queue when publishing ended, and, in auto mode, the hot key's route.
Summary: each mode's medians over its rounds. Each round's queues and Redis keys are removed
after it.

Progress on stderr; one JSON object on stdout (and ``--out``).

Usage: ``python -m bench.hot_key [--modes bucket,auto,key] [--rounds R] [--seconds S]
[--hot-rate N] [--neighbours N] [--workers W] [--out FILE]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis

from bench.common import (
    Cleanup,
    emit,
    log,
    machine_info,
    measure_then_clean,
    median,
    non_negative,
    positive,
)
from bench.e2e import WorkerProcess
from bench.pipelines import SLOW_PREFIX, SLOW_STEP_S
from keyq import Producer
from keyq.broker.connections import open_redis
from keyq.broker.hashing import bucket_of
from keyq.broker.locks import FencedLocks
from keyq.broker.naming import Mode
from keyq.broker.routes import RouteBook
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import StreamConfig, ensure_stream_config
from keyq.demo.proof import percentile
from keyq.worker.batch.state_store import StateStore

PIPELINE = "bench.pipelines:slow_count"
HOT_KEY = f"{SLOW_PREFIX}hot"
MODES = ("key", "bucket", "auto")
WINDOW_S = 10.0
PAD = "x" * 100


def neighbour_keys(count: int, buckets: int) -> list[str]:
    """The first ``count`` keys ``nb-<i>`` in the hot key's bucket."""
    wanted = bucket_of(HOT_KEY, buckets)
    found: list[str] = []
    index = 0
    while len(found) < count:
        key = f"nb-{index}"
        if bucket_of(key, buckets) == wanted:
            found.append(key)
        index += 1
    return found


def schedule(
    seconds: float, hot_rate: float, neighbours: Sequence[str], neighbour_rate: float
) -> list[tuple[float, str]]:
    """(seconds from the start, key) of every event, in time order: the hot key's evenly
    spaced, each neighbour's too, their phases spread over a neighbour's interval."""
    plan = [(n / hot_rate, HOT_KEY) for n in range(int(seconds * hot_rate))]
    interval = 1 / neighbour_rate
    for index, key in enumerate(neighbours):
        phase = interval * index / len(neighbours)
        plan.extend((phase + n * interval, key) for n in range(int(seconds * neighbour_rate)))
    plan.sort()
    return plan


@dataclass
class Ledger:
    """Publish times by key (the nth event's at index n-1), and latencies as they are seen
    committed: (publish time from the start, latency) per key."""

    started: float
    sent: dict[str, list[float]]
    applied: dict[str, int]
    latencies: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    hot_lag: list[tuple[float, float, int]] = field(default_factory=list)  # (at, lag_s, backlog)

    def observe(self, counts: dict[str, int], now: float) -> None:
        for key, count in counts.items():
            sent = self.sent[key]
            done = min(count, len(sent))
            seen = self.latencies.setdefault(key, [])
            for n in range(self.applied[key], done):
                seen.append((sent[n] - self.started, now - sent[n]))
            self.applied[key] = max(self.applied[key], done)

    def hot_state(self, now: float) -> tuple[float, int]:
        """The hot key's lag (age of its oldest uncommitted event, 0 if none) and backlog."""
        sent = self.sent[HOT_KEY]
        done = self.applied[HOT_KEY]
        backlog = len(sent) - done
        return (now - sent[done] if backlog > 0 else 0.0), backlog


class Poller(threading.Thread):
    """Reads every key's committed count every ``poll_s`` into the ledger."""

    def __init__(self, store: StateStore, ledger: Ledger, poll_s: float) -> None:
        super().__init__(daemon=True)
        self._store, self._ledger, self._poll_s = store, ledger, poll_s
        self._keys = sorted(ledger.sent)
        self.stop = threading.Event()
        self.polls = 0

    def poll(self) -> None:
        raw = self._store.states(self._keys)
        now = time.monotonic()
        self._ledger.observe({key: int(value) for key, value in raw.items()}, now)
        self.polls += 1

    def run(self) -> None:
        last_lag = 0.0
        while not self.stop.is_set():
            self.poll()
            now = time.monotonic()
            if now - last_lag >= 1.0:
                lag, backlog = self._ledger.hot_state(now)
                self._ledger.hot_lag.append((now - self._ledger.started, lag, backlog))
                last_lag = now
            self.stop.wait(self._poll_s)


def publish_paced(
    producer: Producer, plan: Sequence[tuple[float, str]], ledger: Ledger
) -> dict[str, float]:
    """Publish ``plan`` on time (from ``ledger.started``), noting each publish time; how late
    the publisher ran (seconds behind its schedule: max and at the end)."""
    started = ledger.started
    sent = ledger.sent
    numbers = dict.fromkeys(sent, 0)
    publish = producer.publish
    behind_max = 0.0
    behind = 0.0
    for at, key in plan:
        ahead = started + at - time.monotonic()
        if ahead > 0.002:
            time.sleep(ahead)
        now = time.monotonic()
        behind = max(0.0, now - started - at)
        behind_max = max(behind_max, behind)
        numbers[key] += 1
        sent[key].append(now)
        publish(key, {"key": key, "n": numbers[key], "pad": PAD})
    producer.flush(timeout=120)
    return {
        "behind_max_s": round(behind_max, 3),
        "behind_end_s": round(behind, 3),
        # Auto mode: events sent to the bucket because a switch to the own queue was put off.
        "rerouted": producer.stats.get("rerouted", 0),
    }


def summary_ms(values: Sequence[float]) -> dict[str, float | None]:
    listed = list(values)

    def ms(value: float | None) -> float | None:
        return None if value is None else round(1000 * value, 1)

    return {
        "events": len(listed),
        "p50_ms": ms(percentile(listed, 0.50)),
        "p95_ms": ms(percentile(listed, 0.95)),
        "p99_ms": ms(percentile(listed, 0.99)),
        "max_ms": ms(max(listed) if listed else None),
    }


def by_window(pairs: Sequence[tuple[float, float]], seconds: float) -> list[float | None]:
    """p99 (ms) of the latencies of events published in each ``WINDOW_S`` window."""
    windows: list[list[float]] = [[] for _ in range(max(1, int(seconds // WINDOW_S)))]
    for at, latency in pairs:
        windows[min(len(windows) - 1, int(at // WINDOW_S))].append(latency)
    return [
        None if not values else round(1000 * (percentile(values, 0.99) or 0), 1)
        for values in windows
    ]


def holders_at(
    client: redis.Redis, config: StreamConfig, neighbours: Sequence[str]
) -> dict[str, Any]:
    """Which worker holds the hot key's queues and how many neighbours' queues that worker
    holds too (their events then share its batches, and its 1 ms steps)."""
    hot_own = config.own_queue_for(HOT_KEY)
    bucket = config.queue_for(HOT_KEY)
    queues = sorted({hot_own, bucket, *(config.queue_for(key) for key in neighbours)})
    leases = FencedLocks(client, config.stream).holders(queues)

    def owner(queue: str) -> str | None:
        lease = leases.get(queue)
        return None if lease is None else lease.owner

    hot_holder = owner(hot_own) if config.holds_own_queues() else owner(bucket)
    shared = [key for key in neighbours if owner(config.queue_for(key)) == hot_holder]
    return {
        "hot_queue": hot_own if config.holds_own_queues() else bucket,
        "hot_queue_holder": hot_holder,
        "bucket_holder": owner(bucket) if config.mode.hashes else None,
        "neighbours_held_with_hot_key": len(shared),
        "shared": shared,
    }


def route_of(client: redis.Redis, stream: str) -> dict[str, Any] | None:
    """The hot key's route and the stream's route counts (auto mode)."""
    book = RouteBook(client, stream)
    route = book.route(HOT_KEY)
    return {
        "hot_key": None if route is None else route.describe(),
        "counts": book.counts(),
        "promoted": sorted(book.promoted(100)),
    }


@dataclass(frozen=True)
class Plan:
    seconds: float
    hot_rate: float
    neighbours: int
    neighbour_rate: float
    buckets: int
    workers: int
    warmup_events: int
    drain_timeout: float
    poll_s: float


def wait_counts(store: StateStore, wanted: dict[str, int], timeout: float) -> bool:
    """Poll until each key's committed count reaches ``wanted``; False on ``timeout``."""
    keys = sorted(wanted)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = store.states(keys)
        if all(int(counts.get(key, 0)) >= wanted[key] for key in keys):
            return True
        time.sleep(0.1)
    return False


def run_round(
    settings: Settings,
    mode: str,
    plan: Plan,
    client: redis.Redis,
    cleanup: Cleanup,
    folder: Path,
) -> dict[str, Any]:
    """One round on a fresh stream: workers up, warm-up, the paced load, the drain."""
    stream = f"bench-hot-{mode}-{uuid.uuid4().hex[:6]}"
    cleanup.add_stream(stream)
    hashes = Mode(mode).hashes
    buckets = plan.buckets if hashes else None
    # Recorded first: a worker given no --buckets (in auto mode) adopts the stream's count.
    config = ensure_stream_config(client, stream, mode, buckets)
    if config.holds_own_queues():  # registered when declared; named too, should it not be
        cleanup.add_queues([config.own_queue_for(HOT_KEY)])
    store = StateStore(client, stream)
    neighbours = neighbour_keys(plan.neighbours, plan.buckets)
    load = schedule(plan.seconds, plan.hot_rate, neighbours, plan.neighbour_rate)
    workers = [
        WorkerProcess(stream, plan.buckets, folder, PIPELINE, mode=mode)
        for _ in range(plan.workers)
    ]
    poller: Poller | None = None
    try:
        for worker in workers:
            worker.wait_ready()
        with Producer(stream, mode=mode, buckets=buckets, settings=settings) as producer:
            if plan.warmup_events:
                warm = [f"warm-{n % 200}" for n in range(plan.warmup_events)]
                for key in warm:
                    producer.publish(key, {"key": key, "n": 0, "pad": PAD})
                producer.flush(timeout=120)
                warm_counts: dict[str, int] = {}
                for key in warm:
                    warm_counts[key] = warm_counts.get(key, 0) + 1
                if not wait_counts(store, warm_counts, 300):
                    raise RuntimeError("the warm-up was not committed within 300 s")
                log(f"{mode}: warm-up of {plan.warmup_events:,} events committed")
            keys = [HOT_KEY, *neighbours]
            ledger = Ledger(time.monotonic(), {k: [] for k in keys}, dict.fromkeys(keys, 0))
            poller = Poller(store, ledger, plan.poll_s)
            poller.start()
            log(f"{mode}: publishing {len(load):,} events over {plan.seconds:.0f} s")
            pacing = publish_paced(producer, load, ledger)
            published_s = time.monotonic() - ledger.started
        end_of_publish = time.monotonic()
        hot_lag_end, hot_backlog_end = ledger.hot_state(end_of_publish)
        holders = holders_at(client, config, neighbours)
        shared = set(holders["shared"])
        log(
            f"{mode}: published in {published_s:.1f} s; hot key lag {hot_lag_end:.1f} s, "
            f"backlog {hot_backlog_end:,}; the hot key's holder also holds "
            f"{len(shared)} neighbours' queues"
        )
        wanted = {key: len(ledger.sent[key]) for key in neighbours}
        deadline = time.monotonic() + plan.drain_timeout
        while time.monotonic() < deadline:
            if all(ledger.applied[key] >= wanted[key] for key in neighbours):
                break
            time.sleep(0.1)
        poller.stop.set()
        poller.join(10)
        poller.poll()
        finished = time.monotonic()
        route = route_of(client, stream) if mode == "auto" else None
    finally:
        if poller is not None:
            poller.stop.set()
        for worker in workers:
            worker.stop()
    censored = [
        (sent - ledger.started, finished - sent)
        for key in neighbours
        for sent in ledger.sent[key][ledger.applied[key] :]
    ]
    neighbour_pairs = [pair for key in neighbours for pair in ledger.latencies.get(key, [])]
    all_pairs = neighbour_pairs + censored
    hot_pairs = ledger.latencies.get(HOT_KEY, [])
    lag_while_publishing = [lag for at, lag, _ in ledger.hot_lag if at <= published_s]
    backlog_while = [backlog for at, _, backlog in ledger.hot_lag if at <= published_s]
    hot_final_lag, hot_final_backlog = ledger.hot_state(finished)
    return {
        "mode": mode,
        "stream": stream,
        "buckets": buckets,
        "hot_key": HOT_KEY,
        "neighbours": len(neighbours),
        "published": {"hot": len(ledger.sent[HOT_KEY]), "neighbours": sum(wanted.values())},
        "published_s": round(published_s, 2),
        "pacing": pacing,
        "neighbour_latency": {
            **summary_ms([latency for _, latency in all_pairs]),
            "censored": len(censored),
        },
        "neighbour_p99_ms_by_10s": by_window(all_pairs, plan.seconds),
        # Split by whether the neighbour's queue was held, when publishing ended, by the
        # worker holding the hot key's queue (whose batches carry the hot key's slow steps).
        "neighbour_latency_with_hot_holder": summary_ms(
            [latency for key in shared for _, latency in ledger.latencies.get(key, [])]
        ),
        "neighbour_latency_elsewhere": summary_ms(
            [
                latency
                for key in neighbours
                if key not in shared
                for _, latency in ledger.latencies.get(key, [])
            ]
        ),
        "hot_latency_of_committed": summary_ms([latency for _, latency in hot_pairs]),
        "hot_lag_s": {
            "end_of_publish": round(hot_lag_end, 2),
            "max_while_publishing": round(max(lag_while_publishing, default=0.0), 2),
            "end_of_round": round(hot_final_lag, 2),
        },
        "hot_backlog": {
            "end_of_publish": hot_backlog_end,
            "max_while_publishing": max(backlog_while, default=0),
            "end_of_round": hot_final_backlog,
        },
        "hot_committed_per_s_while_publishing": round(
            (len(ledger.sent[HOT_KEY]) - hot_backlog_end) / published_s, 1
        ),
        "holders_end_of_publish": {k: v for k, v in holders.items() if k != "shared"},
        "route": route,
        "round_s": round(finished - ledger.started, 1),
        "polls": poller.polls,
    }


def measured_round(
    settings: Settings,
    mode: str,
    plan: Plan,
    client: redis.Redis,
    folder: Path,
    errors: list[str],
) -> dict[str, Any] | None:
    """``run_round``, then its stream's queues and keys removed whatever happened."""
    cleanup = Cleanup(settings)
    entries: list[dict[str, Any]] = []

    def measure() -> None:
        entries.append(run_round(settings, mode, plan, client, cleanup, folder))

    try:
        measure_then_clean(measure, cleanup, errors)
    except RuntimeError as exc:
        errors.append(f"{mode}: {type(exc).__name__}: {exc}")
    return entries[0] if entries else None


def summarise(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A mode's medians over its rounds."""

    def med(*path: str) -> float | None:
        values = []
        for entry in rounds:
            value: Any = entry
            for step in path:
                value = value.get(step) if isinstance(value, dict) else None
            if value is not None:
                values.append(float(value))
        found = median(values)
        return None if found is None else round(found, 3)

    return {
        "rounds": len(rounds),
        "neighbour_p50_ms": med("neighbour_latency", "p50_ms"),
        "neighbour_p99_ms": med("neighbour_latency", "p99_ms"),
        "neighbour_max_ms": med("neighbour_latency", "max_ms"),
        "neighbour_censored": med("neighbour_latency", "censored"),
        "neighbour_p99_ms_with_hot_holder": med("neighbour_latency_with_hot_holder", "p99_ms"),
        "neighbour_p99_ms_elsewhere": med("neighbour_latency_elsewhere", "p99_ms"),
        "hot_lag_end_of_publish_s": med("hot_lag_s", "end_of_publish"),
        "hot_backlog_end_of_publish": med("hot_backlog", "end_of_publish"),
        "hot_committed_per_s_while_publishing": med("hot_committed_per_s_while_publishing"),
    }


def modes_list(text: str) -> list[str]:
    """An argparse type: comma-separated modes, each once."""
    modes = [part.strip() for part in text.split(",") if part.strip()]
    wrong = [mode for mode in modes if mode not in MODES]
    if not modes or wrong or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"give distinct modes among {', '.join(MODES)}")
    return modes


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.hot_key", description=__doc__)
    parser.add_argument("--modes", type=modes_list, default=["bucket", "auto", "key"])
    parser.add_argument("--rounds", type=positive, default=2, help="rounds of each mode")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--hot-rate", type=float, default=2000.0, help="events/s")
    parser.add_argument("--neighbours", type=positive, default=50)
    parser.add_argument("--neighbour-rate", type=float, default=10.0, help="events/s each")
    parser.add_argument("--buckets", type=positive, default=16)
    parser.add_argument("--workers", type=positive, default=2)
    parser.add_argument("--warmup-events", type=non_negative, default=3000)
    parser.add_argument(
        "--drain-timeout", type=float, default=300.0, help="s to wait for neighbours after"
    )
    parser.add_argument("--poll-ms", type=positive, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    for name in ("seconds", "hot_rate", "neighbour_rate", "drain_timeout"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be more than 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    settings: Settings = load_settings()
    plan = Plan(
        args.seconds,
        args.hot_rate,
        args.neighbours,
        args.neighbour_rate,
        args.buckets,
        args.workers,
        args.warmup_events,
        args.drain_timeout,
        args.poll_ms / 1000,
    )
    params = {**vars(args), "out": str(args.out) if args.out else None}
    params |= {"pipeline": PIPELINE, "slow_step_s": SLOW_STEP_S, "hot_key": HOT_KEY}
    result: dict[str, Any] = {"benchmark": "hot_key", "machine": machine_info(), "params": params}
    errors: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="keyq-bench-hot-"))
    client = open_redis(settings)
    rounds: list[dict[str, Any]] = []
    try:
        for number in range(1, args.rounds + 1):
            order = args.modes if number % 2 else list(reversed(args.modes))
            for mode in order:
                log(f"round {number}/{args.rounds}, {mode} mode")
                entry = measured_round(settings, mode, plan, client, folder, errors)
                if entry is not None:
                    rounds.append(entry)
                    log(orjson.dumps(entry).decode())
    finally:
        client.close()
    medians = {
        mode: summarise([r for r in rounds if r["mode"] == mode])
        for mode in args.modes
        if any(r["mode"] == mode for r in rounds)
    }
    result.update(
        {"medians": medians, "rounds": rounds, "errors": errors, "worker_logs": str(folder)}
    )
    emit(result, args.out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
