"""A backlog in one queue: how fast one worker drains it, widened to a batch or held to its
prefetch.

Each round publishes ``--events`` events of one key (key mode, the SDK, flat out) to a stream
of its own while no worker runs, then starts one ``keyq worker`` process
(``bench.pipelines:ordered_count``) and times from its first claim round (Spark up) until the
key's committed count reaches ``--events``. The rounds take turns between:

* ``widened``: the worker's defaults (``KEYQ_BATCH_MAX_EVENTS`` 5,000, ``KEYQ_PREFETCH``
  1,000): the queue's consumer is widened to a batch once it shows full
  (``keyq.worker.holding.prefetch_fit``);
* ``held``: the baseline, widening off (``KEYQ_PREFETCH_WIDEN_EVENTS=0``): each batch takes
  at most a prefetch of the queue.

Per round: seconds to drain, events/s, batches, and the committed state's order check (a
later event applied before an earlier one counts as a violation). Summary: each variant's
median events/s and the ratio widened / held.

Progress on stderr; one JSON object on stdout (and ``--out``).

Usage: ``python -m bench.backlog [--events N] [--rounds R] [--out FILE]``
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    Cleanup,
    emit,
    log,
    machine_info,
    measure_then_clean,
    median,
    positive,
    ratio,
)
from bench.e2e import WorkerProcess
from keyq import Producer
from keyq.broker.connections import open_redis
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import ensure_stream_config
from keyq.worker.batch.state_store import StateStore

PIPELINE = "bench.pipelines:ordered_count"
STOPPED = re.compile(r"stopped after (\d+) batches")
KEY = "backlog"
PREFETCH = 1000  # the worker's default KEYQ_PREFETCH, set for both variants
VARIANTS = {
    "widened": {"KEYQ_PREFETCH": str(PREFETCH)},
    "held": {"KEYQ_PREFETCH": str(PREFETCH), "KEYQ_PREFETCH_WIDEN_EVENTS": "0"},
}


def run_round(
    settings: Settings, variant: str, events: int, cleanup: Cleanup, folder: Path
) -> dict[str, Any]:
    stream = f"bench-backlog-{variant}-{uuid.uuid4().hex[:6]}"
    cleanup.add_stream(stream)
    client = open_redis(settings)
    worker: WorkerProcess | None = None
    try:
        ensure_stream_config(client, stream, "key", None)
        with Producer(stream, mode="key", settings=settings) as producer:
            for n in range(1, events + 1):
                producer.publish(KEY, {"n": n})
            producer.flush(timeout=300)
        worker = WorkerProcess(stream, 0, folder, PIPELINE, mode="key", env=VARIANTS[variant])
        ready = worker.wait_ready()
        store = StateStore(client, stream)
        state = store.get(KEY)
        while state is None or state[0] < events:
            if time.monotonic() - ready > 600:
                raise RuntimeError(f"{variant}: the backlog was not drained within 600 s")
            time.sleep(0.02)
            state = store.get(KEY)
        seconds = time.monotonic() - ready
        worker.stop()  # its last words say how many batches it ran
        applied, _last, violations = state
        log(f"{variant}: {events:,} events drained in {seconds:.2f} s")
        return {
            "variant": variant,
            "seconds": round(seconds, 3),
            "events_per_s": round(events / seconds),
            "applied": applied,
            "order_violations": violations,
            "batches": batches_of(worker.log_path),
        }
    finally:
        if worker is not None:
            worker.stop()
        client.close()


def batches_of(log_path: Path) -> int | None:
    """The batches a stopped worker ran, from its last words."""
    found = STOPPED.findall(log_path.read_text(errors="replace"))
    return int(found[-1]) if found else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--events", type=positive, default=30_000)
    parser.add_argument("--rounds", type=positive, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    settings = load_settings()
    cleanup = Cleanup(settings)
    rounds: list[dict[str, Any]] = []
    errors: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="keyq-bench-backlog-"))

    def measure() -> None:
        for number in range(args.rounds):
            order = list(VARIANTS) if number % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                try:
                    rounds.append(run_round(settings, variant, args.events, cleanup, folder))
                except RuntimeError as exc:  # a worker that did not start or drain: reported
                    errors.append(f"{variant}: {exc}")

    measure_then_clean(measure, cleanup, errors)
    medians = {
        variant: median([r["events_per_s"] for r in rounds if r["variant"] == variant])
        for variant in VARIANTS
    }
    result = {
        "benchmark": "backlog",
        "machine": machine_info(),
        "events": args.events,
        "rounds": rounds,
        "median_events_per_s": medians,
        "widened_over_held": ratio(medians["widened"], medians["held"]),
        "ok": not errors
        and all(r["order_violations"] == 0 and r["applied"] == args.events for r in rounds),
        "errors": errors,
        "logs": str(folder),
    }
    emit(result, args.out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
