"""``keyq console`` at scale: what its pages cost with 100,000 queues and 10,000 dead letters.

Declares ``--queues`` key-mode queues of one stream on a private RabbitMQ node (never the
machine's) and registers them in the Redis of ``KEYQ_REDIS_URL``, as ``bench.status`` does;
puts a message in the first ``--filled`` of them, ``--letters`` real dead letters (published
to the stream's classic dead-letter queue and indexed, as ``bench.dlq`` does) over the first
``--letter-keys`` keys, a few live worker heartbeats, a parked key with state and the
janitor's figures record. Then starts ``keyq console`` as a process against that node and
Redis and times, over ``--rounds`` rounds after one warm-up, the overview (page and
fragment), one key's page (a key with a queue, messages, state, dead letters, parked) and two
pages of dead letters (the first, and ``--far-page``).

Baselines, the same run: ``collect_status`` (what ``keyq status --json`` reads, with the
management API's listing) against the overview, and ``inspect_key`` in process (an
``OperatorContext`` each call, as the console opens one per request) against the key page.
Targets: the overview in under 2 s and a key's page in under 0.5 s, at p95. The node goes
away at the end and the stream's Redis keys are deleted.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pika

from bench.common import (
    declare_queues,
    emit,
    log,
    machine_info,
    positive,
    ratio,
    stream_redis_keys,
)
from bench.dlq import fill
from keyq.broker.clock import now_ms
from keyq.broker.connections import open_redis
from keyq.broker.envelope import HEADER_KEY, HEADER_PUBLISHED_AT
from keyq.broker.key_control import KeyControl, ParkedKey
from keyq.broker.management import queue_figures
from keyq.broker.membership import Membership
from keyq.broker.naming import key_queue_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import Settings, load_settings
from keyq.broker.stream_figures import FiguresRecord, StreamFigures
from keyq.broker.streams import ensure_stream_config
from keyq.broker.worker_report import WorkerReport
from keyq.console.overview import Overview
from keyq.ops import status as status_module
from keyq.ops.context import OperatorContext
from keyq.ops.inspection import inspect_key
from keyq.ops.status import collect_status
from tests.servers import PrivateRabbit, free_port

REPO = Path(__file__).resolve().parent.parent
DECLARE_CONNECTIONS = 4
REGISTER_CHUNK = 10_000
WORKERS = 3
SHOWN_KEY = "key-7"
OVERVIEW_TARGET_S = 2.0
KEY_PAGE_TARGET_S = 0.5
HEALTH_TIMEOUT_S = 60.0
STATUS_LISTING_TIMEOUT_S = 120.0


def key_of(n: int) -> str:
    return f"key-{n}"  # the keys bench.dlq.fill dead-letters


def spread(samples: Sequence[float]) -> dict[str, Any]:
    """Median, p95 (nearest rank), min and max, in seconds."""
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, round(0.95 * len(ordered) + 0.5) - 1))
    return {
        "median_s": round(statistics.median(ordered), 4),
        "p95_s": round(ordered[rank], 4),
        "min_s": round(ordered[0], 4),
        "max_s": round(ordered[-1], 4),
        "rounds": len(ordered),
    }


# ---------------------------------------------------------------------------------- set-up
def declare_and_register(settings: Settings, client: Any, stream: str, count: int) -> None:
    keys = [key_of(n) for n in range(count)]
    names = [key_queue_name(stream, key) for key in keys]
    started = time.perf_counter()
    parts = [names[i::DECLARE_CONNECTIONS] for i in range(DECLARE_CONNECTIONS)]
    with ThreadPoolExecutor(DECLARE_CONNECTIONS) as pool:
        list(pool.map(lambda part: declare_queues(settings, part), parts))
    registry = QueueRegistry(client, stream)
    for start in range(0, count, REGISTER_CHUNK):
        chunk = dict(
            zip(
                names[start : start + REGISTER_CHUNK],
                keys[start : start + REGISTER_CHUNK],
                strict=True,
            )
        )
        registry.register(chunk, announce=False)
    log(f"declared and registered {count:,} queues in {time.perf_counter() - started:.0f} s")


def put_messages(settings: Settings, stream: str, filled: int, extra: int) -> int:
    """One event in each of the first ``filled`` queues, ``extra`` more in the shown key's."""
    connection = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    channel = connection.channel()
    channel.confirm_delivery()
    sent = 0
    counts = {key_of(n): 1 for n in range(filled)}
    counts[SHOWN_KEY] = counts.get(SHOWN_KEY, 0) + extra
    for key, times in counts.items():
        for seq in range(times):
            headers = {HEADER_KEY: key, HEADER_PUBLISHED_AT: now_ms() - 60_000}
            properties = pika.BasicProperties(
                content_type="application/json", delivery_mode=2, headers=headers
            )
            body = orjson.dumps({"key": key, "seq": seq + 1})
            channel.basic_publish("", key_queue_name(stream, key), body, properties)
            sent += 1
    connection.close()
    return sent


def draw_things(client: Any, settings: Settings, stream: str, letters: int, ready: int) -> None:
    """A parked key with state, live workers, the janitor's figures: something to draw."""
    keys = StreamKeys(stream)
    parked = ParkedKey(at_ms=now_ms(), reason="poison: bench", producer="bench", seq=3)
    KeyControl(client, stream).park(SHOWN_KEY, parked)
    client.hset(keys.state, SHOWN_KEY, orjson.dumps({"total": 42, "seen": 2}))
    heartbeat(client, settings, stream)
    figures = StreamFigures(
        dead_letters=letters,
        ready_events=ready,
        oldest_event_age_s=60.0,
        parked_keys=1,
        paused_keys=0,
        live_workers=WORKERS,
    )
    FiguresRecord(client, stream).write(figures, "bench-janitor", ttl_s=3600)


def heartbeat(client: Any, settings: Settings, stream: str) -> None:
    membership = Membership(client, stream, settings.member_ttl_ms)
    for n in range(WORKERS):
        worker = f"bench-worker-{n}"
        report = WorkerReport(worker, stream, ready=True, held=100 + n, batches=10, events=1000)
        membership.heartbeat(worker, report.to_dict())


# ------------------------------------------------------------------------------ the console
def start_console(
    settings: Settings, folder: Path, stream: str
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = dict(os.environ)
    env.update(KEYQ_AMQP_URL=settings.amqp_url, KEYQ_REDIS_URL=settings.redis_url)
    if settings.management_url:
        env["KEYQ_MANAGEMENT_URL"] = settings.management_url
    env.pop("KEYQ_CONSOLE_TOKEN", None)
    env.pop("KEYQ_CONSOLE_BASIC_AUTH", None)
    logfile = (folder / "console.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "keyq",
            "console",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--stream",
            stream,
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env=env,
        stdout=logfile,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the console exited: {(folder / 'console.log').read_text()}")
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("the console did not answer /healthz")
        time.sleep(0.2)


def stop_console(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def pages(stream: str, far_page: int) -> dict[str, tuple[str, str]]:
    """Name -> (path, a text the page must hold)."""
    return {
        "overview": ("/", stream),
        "overview_fragment": ("/fragments/overview", stream),
        "key_page": (f"/streams/{stream}/key?key={SHOWN_KEY}", "poison: bench"),
        "dead_letters_first": (f"/streams/{stream}/dead-letters", "key-0"),
        "dead_letters_far": (f"/streams/{stream}/dead-letters?page={far_page}", "key-"),
    }


def time_pages(
    base: str,
    wanted: dict[str, tuple[str, str]],
    rounds: int,
    refresh: Callable[[], None],
    beside: Callable[[], object],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each page once to warm up, then ``rounds`` rounds of all, interleaved; ``beside`` (the
    key page's baseline) is timed in each round too, so both see the same broker."""
    samples: dict[str, list[float]] = {name: [] for name in wanted}
    figures: dict[str, Any] = {}
    besides: list[float] = []
    beside()
    with httpx.Client(base_url=base, timeout=60) as http:
        for name, (path, must) in wanted.items():
            started = time.perf_counter()
            answer = http.get(path)
            first = time.perf_counter() - started
            if answer.status_code != 200 or must not in answer.text:
                raise RuntimeError(f"{path}: {answer.status_code}, {answer.text[:500]}")
            figures[name] = {"path": path, "first_s": round(first, 4), "bytes": len(answer.content)}
        for _ in range(rounds):
            refresh()
            for name, (path, _must) in wanted.items():
                started = time.perf_counter()
                answer = http.get(path)
                samples[name].append(time.perf_counter() - started)
                answer.raise_for_status()
            started = time.perf_counter()
            beside()
            besides.append(time.perf_counter() - started)
    for name, taken in samples.items():
        figures[name] |= spread(taken)
    return figures, spread(besides)


def settle(management_url: str, tries: int = 3) -> float:
    """Wait until the management API lists every queue within the status listing's timeout
    (the node is busy for a while after 100,000 declares); the last listing's seconds."""
    took = 0.0
    for _ in range(tries):
        started = time.perf_counter()
        try:
            queue_figures(management_url, "/", 120)
        except Exception as exc:  # noqa: BLE001 - any failure: wait and ask again
            log(f"listing failed: {type(exc).__name__}")
        took = time.perf_counter() - started
        log(f"the management API's listing alone: {took:.1f} s")
        if took < status_module.LISTING_TIMEOUT_S / 2:
            break
        time.sleep(10)
    return took


# -------------------------------------------------------------------------------- baselines
def time_status(settings: Settings, stream: str, rounds: int) -> tuple[dict[str, Any], int]:
    """``collect_status`` with the management API; its listing given up to
    ``STATUS_LISTING_TIMEOUT_S`` (not 30 s) so that a busy node is not timed by declares."""
    taken, queues = [], 0
    status_module.LISTING_TIMEOUT_S = STATUS_LISTING_TIMEOUT_S
    fallbacks = _Counter()
    status_module.log.addHandler(fallbacks)
    try:
        for _ in range(rounds):
            started = time.perf_counter()
            status = collect_status(settings, stream)
            taken.append(time.perf_counter() - started)
            queues = int(status["totals"]["queues"])
    finally:
        status_module.log.removeHandler(fallbacks)
    return spread(taken) | {"rounds_by_declaring": fallbacks.count}, queues


class _Counter(logging.Handler):
    """Counts the rounds whose listing failed and that declared every queue instead."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "by declaring instead" in record.getMessage()


def inspect_once(settings: Settings, stream: str) -> dict[str, Any]:
    with OperatorContext(stream, settings) as ctx:
        return inspect_key(ctx, SHOWN_KEY)


def time_inspect(
    settings: Settings, stream: str, rounds: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    picture = inspect_once(settings, stream)  # warm-up, as the console's first request
    taken = []
    for _ in range(rounds):
        started = time.perf_counter()
        inspect_once(settings, stream)
        taken.append(time.perf_counter() - started)
    return spread(taken), picture


def profile(settings: Settings, client: Any, stream: str) -> None:
    """Where the overview's read and a key's picture spend their time, on stderr."""
    overview = Overview(client, settings.member_ttl_ms, [stream])
    for label, call in (
        ("Overview.read", overview.read),
        ("inspect_key", lambda: inspect_once(settings, stream)),
    ):
        profiler = cProfile.Profile()
        profiler.runcall(call)
        log(f"profile of {label}:")
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(25)


# ------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.console", description=__doc__)
    parser.add_argument("--queues", type=positive, default=100_000)
    parser.add_argument("--filled", type=positive, default=1_000)
    parser.add_argument("--letters", type=positive, default=10_000)
    parser.add_argument("--letter-keys", type=positive, default=1_000)
    parser.add_argument("--rounds", type=positive, default=20)
    parser.add_argument("--status-rounds", type=positive, default=3)
    parser.add_argument("--far-page", type=positive, default=150)
    parser.add_argument("--profile", action="store_true", help="profile the reads in process")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.letters % args.letter_keys or args.letter_keys > args.queues:
        parser.error("--letters must be a multiple of --letter-keys, at most --queues keys")
    base: Settings = load_settings()
    params = {k: v for k, v in vars(args).items() if k not in ("out", "profile")}
    result: dict[str, Any] = {"benchmark": "console", "machine": machine_info(), "params": params}
    stream = f"bench-console-{uuid.uuid4().hex[:6]}"
    client = open_redis(base)
    console: subprocess.Popen[bytes] | None = None
    with tempfile.TemporaryDirectory(prefix="keyq-bench-console-") as name:
        folder = Path(name)
        rabbit = PrivateRabbit(folder / "rabbit", management=True).start()
        try:
            settings: Settings = load_settings(
                redis_url=base.redis_url,
                amqp_url=rabbit.url,
                management_url=rabbit.management_url,
            )
            ensure_stream_config(client, stream, "key", None, "classic")
            declare_and_register(settings, client, stream, args.queues)
            ready = put_messages(settings, stream, args.filled, extra=4)
            started = time.perf_counter()
            per_key = args.letters // args.letter_keys
            letters = fill(settings, stream, args.letter_keys, per_key, "poison: bench")
            took = time.perf_counter() - started
            log(f"{ready} events waiting, {letters} dead letters in {took:.1f} s")
            draw_things(client, settings, stream, letters, ready)
            time.sleep(10)  # every queue's figures reach the management API
            if args.profile:
                profile(settings, client, stream)
            result["listing_alone_s"] = round(settle(rabbit.management_url or ""), 2)
            console, address = start_console(settings, folder, stream)
            log(f"console at {address}; timing {args.rounds} rounds")
            result["pages"], inspected = time_pages(
                address,
                pages(stream, args.far_page),
                args.rounds,
                lambda: heartbeat(client, settings, stream),
                lambda: inspect_once(settings, stream),
            )
            for page, figures in result["pages"].items():
                log(f"{page}: median {figures['median_s']:.3f} s, p95 {figures['p95_s']:.3f} s")
            stop_console(console)
            console = None
            heartbeat(client, settings, stream)
            status, reported = time_status(settings, stream, args.status_rounds)
            log(f"baseline collect_status: median {status['median_s']:.2f} s ({reported} queues)")
            log(f"baseline inspect_key: median {inspected['median_s']:.3f} s")
            picture = inspect_once(settings, stream)
        finally:
            if console is not None:
                stop_console(console)
            rabbit.stop()
            leftovers = stream_redis_keys(client, stream)
            for start in range(0, len(leftovers), 1000):
                client.delete(*leftovers[start : start + 1000])
            client.close()
    shown = result["pages"]
    result["baseline"] = {
        "collect_status_management_api": status | {"listing_timeout_s": STATUS_LISTING_TIMEOUT_S},
        "inspect_key_in_process_same_rounds": inspected,
    }
    result["queues_reported_by_status"] = reported
    result["key_picture"] = {
        "depth": picture["queue"]["depth"],
        "dead_letters_total": picture["dead_letters_total"],
        "parked": picture["parked"] is not None,
        "state": picture["state"] is not None,
        "oldest_waiting_age_ms": picture["oldest_waiting"]["age_ms"],
    }
    result["ratios"] = {
        "overview_vs_collect_status": ratio(shown["overview"]["median_s"], status["median_s"]),
        "fragment_vs_collect_status": ratio(
            shown["overview_fragment"]["median_s"], status["median_s"]
        ),
        "key_page_vs_inspect_key": ratio(shown["key_page"]["median_s"], inspected["median_s"]),
    }
    result["targets_met"] = {
        "overview_p95_under_2s": shown["overview"]["p95_s"] < OVERVIEW_TARGET_S,
        "overview_fragment_p95_under_2s": shown["overview_fragment"]["p95_s"] < OVERVIEW_TARGET_S,
        "key_page_p95_under_0_5s": shown["key_page"]["p95_s"] < KEY_PAGE_TARGET_S,
    }
    emit(result, args.out)
    return 0 if all(result["targets_met"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
