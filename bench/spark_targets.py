"""Spark time per 5,000-event batch: in the worker's process, on a standalone cluster, and
through Spark Connect.

``python -m bench.spark_targets [--repeats 9] [--out FILE]`` starts a standalone master with
one worker (1 core) and a Spark Connect server on loopback (tests/spark_cluster.py), then, for
each Spark in a process of its own, runs the worker's batch step on 5,000 events over 200
keys: the batch as Arrow into a DataFrame, the keyed fold (``bench.pipelines:count``) from the
keys' committed states, the folded states back as Arrow. ``local[1]``, the worker's own
Spark, is the baseline measured in the same run. Prints JSON: the median seconds per batch of
each, and each one's ratio to local; and each one's first batch after the engine's warm-up
(``keyq.worker.spark.warm_up``) against its median.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa

from bench.common import emit, median, ratio

BATCH = 5000
KEYS = 200
ON_LOOPBACK = "spark.driver.host=127.0.0.1,spark.driver.bindAddress=127.0.0.1"


def _table() -> pa.Table:
    from keyq.worker.spark.engine import _ARROW_SCHEMA
    from keyq.worker.spark.warm_up import synthetic_batch

    return synthetic_batch(BATCH, KEYS, _ARROW_SCHEMA, key_prefix="key-")


def measure(target: dict[str, str], repeats: int) -> dict[str, Any]:
    """In this process: start the Spark named by ``target`` and time ``repeats`` batches."""
    from bench.pipelines import count
    from keyq.broker.connections import open_redis
    from keyq.broker.settings import load_settings
    from keyq.worker.batch.state_store import StateStore
    from keyq.worker.config import WorkerSettings
    from keyq.worker.pipeline import BatchContext, KeyedState
    from keyq.worker.spark.engine import SparkEngine

    settings = load_settings(WorkerSettings, **target)
    engine = SparkEngine(settings, "keyq-bench-spark")
    started = time.monotonic()
    engine.start()
    engine.ship(["bench.pipelines", "keyq.worker.spark.fold"])
    start_seconds = time.monotonic() - started
    stream = f"bench-spark-{uuid.uuid4().hex[:8]}"
    store = StateStore(open_redis(settings), stream)  # no state yet: nothing to clean up
    keys = [f"key-{i}" for i in range(KEYS)]
    seconds = []
    first = None
    table = _table()
    try:
        for round_ in range(repeats + 1):
            began = time.perf_counter()
            frame = engine.dataframe(table)
            state = KeyedState(store, keys, settings.spark_shuffle_partitions)
            context = BatchContext(
                batch_id=f"b{round_}",
                worker_id="bench",
                stream=stream,
                spark=engine.session,
                state=state,
                queues=[],
            )
            count(frame, context)
            folded = state.folded.toArrow()
            assert folded.num_rows == KEYS, folded.num_rows
            if round_:
                seconds.append(time.perf_counter() - began)
            else:  # after the engine's warm-up: what a worker's first batch costs
                first = round(time.perf_counter() - began, 3)
    finally:
        engine.stop()
    return {
        "start_seconds": round(start_seconds, 2),
        "first_batch_seconds": first,
        "batch_seconds": seconds,
    }


def _run_child(name: str, target: dict[str, str], repeats: int) -> dict[str, Any]:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "bench.spark_targets"),
            *("--child", json.dumps(target), "--repeats", str(repeats)),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(json.loads(args.child), args.repeats)))
        return

    from tests.spark_cluster import SparkConnectServer, SparkStandalone

    with tempfile.TemporaryDirectory(prefix="keyq-bench-spark-") as folder:
        with SparkStandalone(Path(folder) / "standalone") as cluster:
            standalone = _run_child(
                "standalone",
                {"spark_master": cluster.url, "spark_conf": ON_LOOPBACK},
                args.repeats,
            )
        local = _run_child("local", {"spark_master": "local[1]"}, args.repeats)
        with SparkConnectServer(Path(folder) / "connect") as server:
            connect = _run_child("connect", {"spark_remote": server.url}, args.repeats)
    runs = {"local[1]": local, "standalone": standalone, "connect": connect}
    medians = {name: median(run["batch_seconds"]) for name, run in runs.items()}
    emit(
        {
            "benchmark": "spark_targets",
            "batch_events": BATCH,
            "keys": KEYS,
            "repeats": args.repeats,
            "median_batch_seconds": {k: round(v or 0, 3) for k, v in medians.items()},
            "ratio_to_local": {name: ratio(medians[name], medians["local[1]"]) for name in runs},
            "start_seconds": {name: run["start_seconds"] for name, run in runs.items()},
            # A worker's first batch, after the engine's warm-up, against the median batch.
            "first_batch_seconds": {name: run["first_batch_seconds"] for name, run in runs.items()},
            "first_to_median": {
                name: ratio(run["first_batch_seconds"], medians[name]) for name, run in runs.items()
            },
        },
        args.out,
    )


if __name__ == "__main__":
    main()
