"""Every benchmark in one run, one JSON file: ``python -m bench [--out FILE] [--only NAME ...]``.

Runs ``bench.producer``, ``bench.e2e``, ``bench.janitor``, ``bench.peers`` and
``bench.sequencing`` one after the other (each in its own process, as a user would run it),
collects their JSON under their names, and adds ``table``: the figures of BENCHMARKS.md side
by side, keyq against its baselines. The table is also printed as Markdown on stderr.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.common import emit, log, machine_info

BENCHMARKS = ("producer", "e2e", "janitor", "peers", "sequencing")
REPO = Path(__file__).resolve().parent.parent


def run_one(name: str, folder: Path) -> dict[str, Any]:
    out = folder / f"{name}.json"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--out", str(out)],
        stdout=subprocess.DEVNULL,
        cwd=REPO,
        check=False,
    )
    result: dict[str, Any] = orjson.loads(out.read_bytes()) if out.exists() else {}
    result["exit_code"] = done.returncode
    result["wall_seconds"] = round(time.monotonic() - started, 1)
    return result


def dig(data: dict[str, Any], *path: str) -> Any:
    for step in path:
        if not isinstance(data, dict):
            return None
        data = data.get(step)  # type: ignore[assignment]
    return data


def order_and_copies(failover: Any) -> str | None:
    if not isinstance(failover, dict):
        return None
    return f"{failover.get('order_violations')} / {failover.get('duplicates')}"


def share_of(scale_out: Any) -> str | None:
    if not isinstance(scale_out, dict):
        return None
    return f"{scale_out.get('queues_active_on_new_consumer')} of {scale_out.get('queues')}"


def table(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows: figure, unit, keyq, raw pika, shared queue, consistent-hash + SAC, source."""
    p, e, j, s = (results.get(name, {}) for name in BENCHMARKS)
    rows = [
        (
            "publish rate",
            "events/s",
            dig(p, "variants", "keyq", "median"),
            dig(p, "variants", "raw_pika_unconfirmed", "median"),
            None,
            None,
            "producer",
        ),
        (
            "end to end, flat out",
            "events/s",
            dig(s, "keyq", "throughput", "events_per_s"),
            dig(e, "raw_pika_unconfirmed_events_per_s"),
            dig(s, "shared_queue", "throughput", "events_per_s"),
            dig(s, "chash_sac", "throughput", "events_per_s"),
            "peers (raw: e2e, publish only)",
        ),
        (
            "end to end, keyq e2e benchmark",
            "events/s",
            dig(e, "e2e_events_per_s"),
            dig(e, "raw_pika_unconfirmed_events_per_s"),
            None,
            None,
            "e2e",
        ),
    ]
    for share in ("p50", "p99"):
        rows.append(
            (
                f"latency {share} at the paced rate",
                "s",
                dig(s, "keyq", "latency", "latency_s", share),
                None,
                dig(s, "shared_queue", "latency", "latency_s", share),
                dig(s, "chash_sac", "latency", "latency_s", share),
                "peers",
            )
        )
    rows += [
        (
            "per-key order violations (flat out)",
            "events",
            dig(s, "keyq", "throughput", "order_violations"),
            None,
            dig(s, "shared_queue", "throughput", "order_violations"),
            dig(s, "chash_sac", "throughput", "order_violations"),
            "peers",
        ),
        (
            "failover after kill -9 (keyq: median of 10)",
            "s",
            dig(e, "failover_s", "median"),
            None,
            dig(s, "shared_queue", "failover", "failover_s"),
            dig(s, "chash_sac", "failover", "failover_s"),
            "e2e / peers",
        ),
        (
            "order violations / duplicates after that kill",
            "events",
            None,
            None,
            order_and_copies(dig(s, "shared_queue", "failover")),
            order_and_copies(dig(s, "chash_sac", "failover")),
            "peers (keyq: the soak)",
        ),
        (
            "new consumer: time to its fair share / queues it gets",
            "s / queues",
            dig(e, "rebalance_to_fair_share_s", "median"),
            None,
            share_of(dig(s, "shared_queue", "scale_out")),
            share_of(dig(s, "chash_sac", "scale_out")),
            "e2e / peers",
        ),
        (
            "new keys (a queue each)",
            "keys/s",
            dig(p, "variants", "new_keys", "median"),
            dig(p, "variants", "raw_pika_new_queues", "median"),
            None,
            None,
            "producer",
        ),
        (
            "reclaim idle queues",
            "deletes/s",
            dig(j, "janitor_deletes_per_s"),
            dig(j, "raw_pika_deletes_per_s"),
            None,
            None,
            "janitor",
        ),
        (
            "broker memory per used queue",
            "bytes",
            dig(j, "broker_memory_per_queue_bytes"),
            None,
            None,
            None,
            "janitor",
        ),
        (
            "Spark time per 5,000-event batch (median)",
            "s",
            dig(e, "spark_batch_5000_s", "median"),
            None,
            None,
            None,
            "e2e",
        ),
    ]
    names = ("figure", "unit", "keyq", "raw_pika", "shared_queue", "chash_sac", "benchmark")
    return [dict(zip(names, row, strict=True)) for row in rows]


def markdown(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "—"
        if isinstance(value, float):
            return f"{value:,.3f}" if value < 10 else f"{value:,.0f}"
        if isinstance(value, int):
            return f"{value:,}"
        return str(value)

    head = "| figure | unit | keyq | raw pika | shared queue | consistent-hash + SAC | from |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append("| " + " | ".join(cell(value) for value in row.values()) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "all.json")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="keyq-bench-all-"))
    results: dict[str, dict[str, Any]] = {}
    for name in args.only:
        log(f"== bench.{name}")
        results[name] = run_one(name, folder)
        log(f"== bench.{name}: exit {results[name]['exit_code']}")
    if set(args.only) != set(BENCHMARKS) and args.out.exists():
        # A partial run refreshes its benchmarks in the existing file and keeps the others.
        earlier = orjson.loads(args.out.read_bytes())
        results = {
            **{name: earlier[name] for name in BENCHMARKS if name in earlier},
            **results,
        }
    rows = table(results)
    print(markdown(rows), file=sys.stderr)
    emit({"benchmark": "all", "machine": machine_info(), "table": rows, **results}, args.out)
    return 0 if all(results[name]["exit_code"] == 0 for name in args.only) else 1


if __name__ == "__main__":
    sys.exit(main())
