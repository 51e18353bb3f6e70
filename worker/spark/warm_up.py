"""Spark's first job, run before a worker serves, in the shape of a batch's: the batch's
columns into a DataFrame from Arrow, the keyed fold's select, one partition (or a shuffle by
key), the Arrow fold, the states back as Arrow. So the first real batch pays neither for
starting Spark's Python workers nor for the first run of those paths, and a worker that has
just started keeps up with its queues from its first batch (which is when auto mode reads
whether a hot key's bucket is current)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from keyq.worker.pipeline import fold_frame
from keyq.worker.spark.fold import make_folder

ROWS = 512
KEYS = 32


def warm_up(dataframe: Callable[[pa.Table], Any], schema: pa.Schema, partitions: int) -> None:
    """Run the batch-shaped job; ``dataframe`` makes a batch's DataFrame from an Arrow table
    of ``schema``."""
    table = synthetic_batch(ROWS, KEYS, schema)
    fold_frame(dataframe(table), make_folder(_keep_state, {}), partitions).toArrow()


def synthetic_batch(rows: int, keys: int, schema: pa.Schema, key_prefix: str = "k") -> pa.Table:
    """A batch of ``rows`` JSON events over ``keys`` keys (``<key_prefix><n>``), every column
    of ``schema`` filled: what the start-up job and ``bench.spark_targets`` run."""
    return pa.Table.from_pylist([_row(n, f"{key_prefix}{n % keys}") for n in range(rows)], schema)


def _row(number: int, key: str) -> dict[str, Any]:
    return {
        "stream": "warm-up",
        "queue": "warm-up",
        "key": key,
        "seq": number,
        "producer": "warm-up",
        "message_id": f"warm-up:{number}",
        "published_at": datetime.fromtimestamp(0, UTC),
        "redelivered": False,
        "payload": '{"n": 1}',
        "redriven": False,
        "body": b'{"n": 1}',
        "content_type": "application/json",
        "headers": [("source", "warm-up")],
    }


def _keep_state(state: Any, event: Any) -> Any:
    del event
    return state
