"""Key mode at scale: ``--keys`` keys (100,000) with Zipf traffic, three workers, the janitor.

Everything runs on a private RabbitMQ node (with the management API, for its memory and queue
count) and a private Redis (AOF, fsync always), so the figures are this run's alone:

1. **publish**: every key's first event, plus ``--extra-events`` more drawn from a Zipf law
   over the keys (rank r with weight 1/r^s), all shuffled; one producer, unpaced. Each
   event carries ``n``, its place in its key's sequence.
2. **drain**: until every event is committed. Every few seconds: queues on the broker, queues
   held, broker memory, Redis memory, and each worker's resident memory (its Python process
   and its Spark JVM); peaks are reported.
3. **check**: every key's state is read back: ``[events, highest n, n out of order]`` must be
   ``[sent, sent, 0]``.
4. **reclaim**: the janitor (``--idle-ttl``), running from the start, deletes idle queues;
   after the drain, the time until the broker holds at most 1 % of the keys' queues, and
   how many are left.

The baseline, measured in the same run, is the run's own publish rate: end to end against it.
Progress goes to stderr; one JSON object to stdout (and ``--out``).

Usage: ``python -m bench.scale [--keys N] [--extra-events M] [--workers W] [--out FILE]``.
``--rate R`` paces the producer at R events/s (with a short ``--idle-ttl``, most keys then
speak again after their queue was deleted, which is what the janitor's fence is for);
``--trace`` writes what the producer did with each queue to ``logs/producer.log``.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import tempfile
import time
import uuid
from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any

import orjson
import redis

from bench.common import emit, log, machine_info, positive, ratio
from keyq import Producer
from keyq.broker.connections import open_redis
from keyq.broker.management import get_json
from keyq.broker.membership import Membership
from keyq.broker.settings import Settings, load_settings
from keyq.demo.processes import Daemon
from keyq.worker.batch.state_store import StateStore
from tests.servers import PrivateRabbit, PrivateRedis

REPO = Path(__file__).resolve().parent.parent
PIPELINE = "bench.pipelines:ordered_count"
# Listing tens of thousands of queues costs the broker seconds of CPU: samples read only
# the node's totals (/api/overview, /api/nodes), and not often.
SAMPLE_EVERY_S = 20.0
RECLAIMED_SHARE = 0.01  # reclaimed once at most this share of the keys' queues is left
CHECK_CHUNK = 5_000
# No event committed for this long (gaps are given up after a minute): stop waiting.
STALLED_S = 180.0


def workload(keys: int, extra: int, zipf_s: float, seed: int) -> list[tuple[str, int]]:
    """(key, n) in publish order: each key once, plus ``extra`` Zipf draws, shuffled."""
    rng = random.Random(seed)
    names = [f"device-{index:06d}" for index in range(keys)]
    weights = list(accumulate(1 / (rank**zipf_s) for rank in range(1, keys + 1)))
    order = names + rng.choices(names, cum_weights=weights, k=extra)
    rng.shuffle(order)
    seen: dict[str, int] = {}
    events: list[tuple[str, int]] = []
    for key in order:
        seen[key] = seen.get(key, 0) + 1
        events.append((key, seen[key]))
    return events


def process_tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (the worker and its Spark JVM)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo.extend(children.get(current, []))
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


class Sampler:
    """Peaks of what the run costs, read every few seconds."""

    def __init__(self, settings: Settings, client: redis.Redis, stream: str) -> None:
        self._settings = settings
        self._client = client
        self._stream = stream
        self.peaks: dict[str, int] = {}
        self.samples: list[dict[str, Any]] = []
        self._next = 0.0

    def maybe(self, workers: Sequence[Daemon], started: float, force: bool = False) -> None:
        now = time.monotonic()
        if now < self._next and not force:
            return
        self._next = now + SAMPLE_EVERY_S
        api = self._settings.management_url or ""
        node = get_json(api, "/api/nodes", 30)[0]
        totals = get_json(api, "/api/overview", 30).get("object_totals", {})
        sample = {
            "at_s": round(now - started, 1),
            "broker_memory_bytes": int(node.get("mem_used", 0)),
            "broker_queues": int(totals.get("queues", 0)),
            "redis_memory_bytes": int(self._client.info("memory")["used_memory"]),
            "worker_rss_bytes": [process_tree_rss(w.process.pid) for w in workers if w.alive],
            "held": sum(
                int(str(info.get("held", 0)))
                for info in Membership(self._client, self._stream, 1000).info().values()
            ),
        }
        self.samples.append(sample)
        for name in ("broker_memory_bytes", "broker_queues", "redis_memory_bytes", "held"):
            self.peaks[name] = max(self.peaks.get(name, 0), int(sample[name]))
        for rss in sample["worker_rss_bytes"]:
            self.peaks["worker_rss_bytes"] = max(self.peaks.get("worker_rss_bytes", 0), rss)
        log(
            f"  {sample['at_s']:>6.0f} s: {sample['broker_queues']:,} queues, "
            f"{sample['held']:,} held, broker {sample['broker_memory_bytes'] / 2**20:,.0f} MiB, "
            f"redis {sample['redis_memory_bytes'] / 2**20:,.0f} MiB, workers "
            + ", ".join(f"{rss / 2**20:,.0f}" for rss in sample["worker_rss_bytes"])
            + " MiB"
        )


def committed(store: StateStore, keys: Sequence[str]) -> int:
    total = 0
    for start in range(0, len(keys), CHECK_CHUNK):
        states = store.states(keys[start : start + CHECK_CHUNK])
        total += sum(int(orjson.loads(state)[0]) for state in states.values())
    return total


def check_states(store: StateStore, expected: dict[str, int]) -> dict[str, Any]:
    keys = sorted(expected)
    wrong: dict[str, Any] = {}
    for start in range(0, len(keys), CHECK_CHUNK):
        chunk = keys[start : start + CHECK_CHUNK]
        states = store.states(chunk)
        for key in chunk:
            raw = states.get(key)
            state = None if raw is None else orjson.loads(raw)
            want = [expected[key], expected[key], 0]
            if state is None or [int(part) for part in state] != want:
                wrong[key] = {"state": state, "expected": want}
    return {
        "keys_checked": len(keys),
        "wrong": len(wrong),
        "examples": dict(list(wrong.items())[:5]),
    }


def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    rabbit = PrivateRabbit(folder / "rabbit", management=True).start()
    private_redis = PrivateRedis(folder / "redis").start()
    settings = load_settings(
        amqp_url=rabbit.url, redis_url=private_redis.url, management_url=rabbit.management_url
    )
    os.environ.update(
        KEYQ_AMQP_URL=settings.amqp_url,
        KEYQ_REDIS_URL=settings.redis_url,
        KEYQ_MANAGEMENT_URL=settings.management_url or "",
        PYTHONPATH=str(REPO),
    )
    stream = f"bench-scale-{uuid.uuid4().hex[:6]}"
    client = open_redis(settings)
    store = StateStore(client, stream)
    events = workload(args.keys, args.extra_events, args.zipf_s, args.seed)
    expected: dict[str, int] = {}
    for key, n in events:
        expected[key] = max(expected.get(key, 0), n)
    keys = sorted(expected)
    top = max(expected.values())
    log(f"{len(events):,} events over {len(keys):,} keys (the busiest has {top:,}); run {stream}")
    logs = folder / "logs"
    logs.mkdir()
    if args.trace:
        # What the producer did with each queue: declares, returns, late confirms, retirements.
        trace = logging.FileHandler(logs / "producer.log")
        trace.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        producer_log = logging.getLogger("keyq.producer")
        producer_log.addHandler(trace)
        producer_log.setLevel(logging.DEBUG)
    worker_args = ["--stream", stream, "--mode", "key", "--pipeline", PIPELINE]
    workers = [Daemon("worker", worker_args, logs) for _ in range(args.workers)]
    # From the start, as in production: idle keys' queues go while others are busy, and a key
    # that speaks again after its queue went gets it declared anew.
    janitor = Daemon("janitor", ["--stream", stream, "--idle-ttl", str(args.idle_ttl)], logs)
    sampler = Sampler(settings, client, stream)
    result: dict[str, Any] = {"stream": stream, "events": len(events), "keys": len(keys)}
    try:
        members = Membership(client, stream, ttl_ms=1)
        for worker in workers:
            while not worker.serving(members):
                if not worker.alive:
                    raise RuntimeError(f"a worker exited: see {worker.log_path}")
                time.sleep(0.2)
        log(f"{args.workers} workers serving; publishing")
        started = time.monotonic()
        with Producer(stream, mode="key", settings=settings) as producer:
            for number, (key, n) in enumerate(events, 1):
                if args.rate:
                    ahead = started + number / args.rate - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)
                producer.publish(key, {"n": n})
                if number % 20_000 == 0:
                    log(f"  published {number:,}")
                    sampler.maybe(workers, started)
            producer.flush(600)
        published_s = time.monotonic() - started
        log(f"published in {published_s:.0f} s; waiting until every event is committed")
        deadline = started + args.timeout
        done, progressed_at = 0, time.monotonic()
        while (now_done := committed(store, keys)) < len(events):
            if now_done > done:
                done, progressed_at = now_done, time.monotonic()
            if time.monotonic() > deadline or time.monotonic() - progressed_at > STALLED_S:
                # Check every key anyway: which events never came is the finding.
                result["not_committed"] = len(events) - now_done
                log(f"{len(events) - now_done} events not committed; checking every key")
                break
            sampler.maybe(workers, started)
            time.sleep(1.0)
        drained_s = time.monotonic() - started
        sampler.maybe(workers, started, force=True)
        result.update(
            publish_events_per_s=round(len(events) / published_s),
            end_to_end_events_per_s=round(len(events) / drained_s),
            end_to_end_vs_publish=ratio(published_s, drained_s),
            seconds_to_publish=round(published_s, 1),
            seconds_to_all_committed=round(drained_s, 1),
        )
        log(f"all committed after {drained_s:.0f} s; checking every key's state")
        result["check"] = check_states(store, expected)
        log(f"  {result['check']['wrong']} keys wrong of {len(keys):,}")
        reclaim_started = time.monotonic()
        left = len(keys)
        while time.monotonic() - reclaim_started < args.reclaim_timeout:
            sampler.maybe(workers, started)
            api = settings.management_url or ""
            # Every queue of the private node is this run's: the keys' and the dead letters'.
            left = (
                int(get_json(api, "/api/overview", 30).get("object_totals", {}).get("queues", 0))
                - 1
            )
            if left <= len(keys) * RECLAIMED_SHARE:
                break
            time.sleep(5.0)
        result["reclaim"] = {
            "idle_ttl_s": args.idle_ttl,
            "seconds": round(time.monotonic() - reclaim_started, 1),
            "queues_left": left,
        }
        log(f"janitor: {left:,} queues left after {result['reclaim']['seconds']} s")
        sampler.maybe(workers, started, force=True)
    finally:
        for daemon in [*workers, janitor]:
            daemon.stop()
        client.close()
        rabbit.stop()
        private_redis.stop()
    result["peaks"] = sampler.peaks
    result["samples"] = sampler.samples
    result["logs"] = str(logs)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument("--keys", type=positive, default=100_000)
    parser.add_argument("--extra-events", type=positive, default=200_000)
    parser.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent")
    parser.add_argument("--workers", type=positive, default=3)
    parser.add_argument("--idle-ttl", type=float, default=20.0, help="the janitor's, seconds")
    parser.add_argument("--timeout", type=float, default=3600.0, help="to commit everything")
    parser.add_argument("--reclaim-timeout", type=float, default=900.0)
    parser.add_argument(
        "--rate", type=float, default=0.0, help="events/s to publish at (0: unpaced)"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--trace", action="store_true", help="log the producer's queue events")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"benchmark": "scale", "machine": machine_info()}
    result["params"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    folder = Path(tempfile.mkdtemp(prefix="keyq-bench-scale-"))
    try:
        result.update(run(args, folder))
        result["ok"] = result["check"]["wrong"] == 0 and not result.get("not_committed")
    except (RuntimeError, OSError) as exc:
        result["ok"] = False
        result["error"] = str(exc)
    emit(result, args.out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
