"""The asyncio producer's publish rate against the threaded one, same broker, keys, payloads.

Variants, each measured ``--repeats`` times in alternating order, each on a fresh stream:

* ``threaded``: ``keyq.Producer`` in key mode; publish all from one thread, then ``flush``
  (the baseline: ``bench.producer``'s ``keyq`` variant).
* ``asyncio``: ``keyq.aio.Producer`` from one task, awaiting each ``publish``, then
  ``await flush()``; a 1 ms ticker task on the same loop records its lag meanwhile.
* ``asyncio_tasks``: the same events from ``--tasks`` tasks at once (each key's events from
  one task), as a web service's requests would publish.

After each run the queues' message counts are checked, and everything it created is deleted.
Progress goes to stderr; one JSON object to stdout.

Usage: ``python -m bench.aio_producer [--events N] [--keys K] [--payload-bytes B]
[--repeats R] [--tasks T] [--out FILE]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    Cleanup,
    emit,
    log,
    machine_info,
    mean_size,
    measure_then_clean,
    median,
    pad_for,
    padded_event,
    positive,
    publish_all,
    ratio,
    wait_for_total,
)
from keyq import Producer
from keyq.aio import Producer as AsyncProducer
from keyq.broker.naming import dead_letter_queue_name, key_queue_name
from keyq.broker.settings import Settings, load_settings

THREADED = "threaded"
ASYNCIO = "asyncio"
ASYNCIO_TASKS = "asyncio_tasks"
VARIANTS = (THREADED, ASYNCIO, ASYNCIO_TASKS)
CONFIRM_WINDOW = 10_000
FLUSH_TIMEOUT_S = 600.0

Events = list[tuple[str, dict[str, Any]]]


@dataclass
class Run:
    events: int
    keys: int
    payload_bytes: int
    repeats: int
    tasks: int
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    rates: dict[str, list[float]] = field(default_factory=dict)
    lag_ms: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def stream(self, variant: str, repeat: int) -> str:
        return f"bench-{self.run_id}-aio{VARIANTS.index(variant)}-{repeat}"


def make_events(run: Run) -> Events:
    keys = [f"key-{index:05d}" for index in range(run.keys)]
    pad = pad_for(run.payload_bytes, keys[0])
    chosen = [keys[index % len(keys)] for index in range(run.events)]
    return [(key, padded_event(index, key, pad)) for index, key in enumerate(chosen)]


class Ticker:
    """A 1 ms ticker on the loop: how late each tick wakes (the loop's lag)."""

    def __init__(self) -> None:
        self.late: list[float] = []

    async def run(self) -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(0.001)
            self.late.append(time.perf_counter() - started - 0.001)

    def figures(self) -> dict[str, float]:
        ordered = sorted(self.late) or [0.0]
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        return {"max": round(ordered[-1] * 1000, 2), "p99": round(p99 * 1000, 2)}


async def publish_async(
    settings: Settings, stream: str, events: Events, tasks: int
) -> tuple[float, dict[str, float]]:
    """Seconds from the first publish until every event is confirmed, and the loop's lag."""
    async with AsyncProducer(
        stream, mode="key", settings=settings, confirm_window=CONFIRM_WINDOW
    ) as producer:
        ticker = Ticker()
        ticking = asyncio.create_task(ticker.run())
        started = time.perf_counter()
        if tasks <= 1:
            for key, event in events:
                await producer.publish(key, event)
        else:
            by_key: dict[str, Events] = {}
            for key, event in events:
                by_key.setdefault(key, []).append((key, event))
            keys = sorted(by_key)
            shares = [[e for k in keys[n::tasks] for e in by_key[k]] for n in range(tasks)]

            async def publish_share(share: Events) -> None:
                for key, event in share:
                    await producer.publish(key, event)

            await asyncio.gather(*(publish_share(share) for share in shares))
        await producer.flush(FLUSH_TIMEOUT_S)
        elapsed = time.perf_counter() - started
        stats = producer.stats
        if stats["returned"] or stats["resent"] or stats["late_confirms"]:
            log(f"  note: keyq {stats}")
        ticking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticking
    return elapsed, ticker.figures()


def run_variant(
    run: Run, settings: Settings, cleanup: Cleanup, events: Events, variant: str, stream: str
) -> float:
    cleanup.add_stream(stream)
    queues = sorted({key_queue_name(stream, key) for key, _ in events})
    cleanup.add_queues([*queues, dead_letter_queue_name(stream)])
    if variant == THREADED:
        with Producer(stream, mode="key", settings=settings, confirm_window=CONFIRM_WINDOW) as p:
            elapsed = publish_all(p, events, FLUSH_TIMEOUT_S)
            if p.stats["returned"] or p.stats["resent"] or p.stats["late_confirms"]:
                log(f"  note: keyq {p.stats}")
    else:
        tasks = run.tasks if variant == ASYNCIO_TASKS else 1
        elapsed, lag = asyncio.run(publish_async(settings, stream, events, tasks))
        run.lag_ms.setdefault(variant, []).append(lag)
    total, missing = wait_for_total(settings, queues, len(events))
    if missing or total != len(events):
        run.errors.append(f"{variant}: {total} messages in {len(queues)} queues")
    return elapsed


def measure(run: Run, settings: Settings, cleanup: Cleanup) -> None:
    events = make_events(run)
    log(
        f"{run.events} events over {run.keys} keys, payload ~{mean_size(events[:1000]):.0f} "
        f"bytes, {run.repeats} repeats, run {run.run_id}"
    )
    for repeat in range(run.repeats):
        for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
            elapsed = run_variant(
                run, settings, cleanup, events, variant, run.stream(variant, repeat)
            )
            rate = len(events) / elapsed
            run.rates.setdefault(variant, []).append(round(rate, 1))
            lag = run.lag_ms.get(variant, [{}])[-1] if variant != THREADED else {}
            log(f"repeat {repeat + 1}/{run.repeats} {variant}: {rate:,.0f} events/s {lag}")
            cleanup.run()


def report(run: Run, machine: dict[str, Any]) -> dict[str, Any]:
    medians = {variant: median(rates) for variant, rates in run.rates.items()}
    return {
        "benchmark": "aio_producer",
        "ok": not run.errors,
        "errors": run.errors,
        "machine": {**machine, "loadavg_end": list(os.getloadavg())},
        "parameters": {
            "events": run.events,
            "keys": run.keys,
            "payload_bytes": run.payload_bytes,
            "repeats": run.repeats,
            "tasks": run.tasks,
            "confirm_window": CONFIRM_WINDOW,
            "run_id": run.run_id,
        },
        "variants": {
            variant: {
                "unit": "events/s",
                "rates": run.rates[variant],
                "median": medians[variant],
                **({"loop_lag_ms": run.lag_ms[variant]} if variant in run.lag_ms else {}),
            }
            for variant in VARIANTS
            if variant in run.rates
        },
        "ratios": {
            "asyncio/threaded": ratio(medians.get(ASYNCIO), medians.get(THREADED)),
            "asyncio_tasks/threaded": ratio(medians.get(ASYNCIO_TASKS), medians.get(THREADED)),
        },
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.aio_producer", description=__doc__)
    parser.add_argument("--events", type=positive, default=50_000, help="events per run")
    parser.add_argument("--keys", type=positive, default=100, help="distinct keys")
    parser.add_argument("--payload-bytes", type=positive, default=200, help="JSON body size")
    parser.add_argument("--repeats", type=positive, default=3, help="runs per variant")
    parser.add_argument("--tasks", type=positive, default=50, help="tasks of asyncio_tasks")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args.events, args.keys, args.payload_bytes, args.repeats, args.tasks)
    settings = load_settings()
    machine = machine_info()
    log(f"machine: {machine}")
    cleanup = Cleanup(settings)
    measure_then_clean(lambda: measure(run, settings, cleanup), cleanup, run.errors)
    emit(report(run, machine), args.out)
    for error in run.errors:
        log(f"FAILED: {error}")
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
