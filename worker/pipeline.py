"""The pipeline contract: ``function(df, ctx) -> DataFrame | None``.

``df`` holds one micro-batch with the columns of ``BATCH_COLUMNS``, each key's events in
order (by seq per producer, see ``keyq.worker.batch.sequencing``); events already applied are not
in it. ``ctx`` carries the batch id, the worker
id, the SparkSession and ``ctx.state``, the exactly-once keyed state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention

from keyq.broker.errors import PipelineError
from keyq.worker.batch.state_store import StateStore
from keyq.worker.spark.fold import STATE_SCHEMA_DDL, Decoder, Reducer, make_folder

Pipeline = Callable[[Any, "BatchContext"], Any]


class KeyedState:
    """Per-key state that survives batches, failovers and restarts.

    ``fold(df, reducer, decoder=None)`` runs ``reducer(state, event) -> state`` over each
    key's events in arrival order, in Spark, starting from the key's committed state (None for
    a new key), and
    returns a DataFrame of ``key, state (JSON), applied``. The worker commits those states
    with the batch, fenced by the queues' locks, so each event changes state exactly once.
    """

    def __init__(self, store: StateStore, keys: Sequence[str], partitions: int) -> None:
        self._store = store
        self._keys = keys
        self._partitions = partitions
        self.folded: Any = None

    def fold(self, df: Any, reducer: Reducer, decoder: Decoder | None = None) -> Any:
        """Fold ``df`` (the batch, or a filter/select of it: arrival order must survive).
        The reducer gets a JSON event as its JSON, any other as ``decoder(body)`` when a
        decoder is given (an event it rejects is dead-lettered with its error), else as
        bytes."""
        if self.folded is not None:
            raise PipelineError("ctx.state.fold may be called once per batch")
        prior = self._store.states(self._keys)
        self.folded = fold_frame(df, make_folder(reducer, prior, decoder), self._partitions)
        return self.folded

    def get(self, key: str) -> Any | None:
        """The committed state of ``key`` (before this batch)."""
        return self._store.get(key)


def fold_frame(df: Any, folder: Any, partitions: int) -> Any:
    """``df``'s events through ``folder`` (``make_folder``), each key's in one partition, in
    arrival order: the Spark side of ``KeyedState.fold``."""
    present = set(df.columns)
    body = F.col("body") if "body" in present else F.lit(None).cast("binary")
    kind = F.col("content_type") if "content_type" in present else F.lit(None).cast("string")
    # One select, the arrival number in it: each DataFrame step costs the driver a plan.
    numbered = df.select(
        "key",
        "payload",
        body.alias("body"),
        kind.alias("content_type"),
        "producer",
        "seq",
        F.monotonically_increasing_id().alias("_arrival"),
    )
    # One partition: no shuffle at all (a narrow coalesce keeps every key together).
    together = numbered.coalesce(1) if partitions == 1 else numbered.repartition(partitions, "key")
    return together.mapInArrow(folder, STATE_SCHEMA_DDL)


@dataclass
class BatchContext:
    """What a pipeline knows about the batch it is given."""

    batch_id: str
    worker_id: str
    stream: str
    spark: Any
    state: KeyedState
    queues: Sequence[str]
    attempt: int = 1
    extras: dict[str, Any] = field(default_factory=dict)
