"""The worker's Spark: one session per process, batches in through Arrow, results out.

``local[*]`` by default; a cluster master or a Spark Connect remote from the settings, so a
deployment that outgrows one machine points its workers at a cluster without code changes.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
from keyq.broker.errors import ConfigurationError
from keyq.worker.config import WorkerSettings
from keyq.worker.decoding import Event
from keyq.worker.fold import STATE_SCHEMA_DDL, make_folder
from pyspark.sql import SparkSession

log = logging.getLogger("keyq.worker.spark")

BATCH_COLUMNS = (
    "stream",
    "queue",
    "key",
    "seq",
    "producer",
    "message_id",
    "published_at",
    "redelivered",
    "payload",
)
BATCH_SCHEMA_DDL = (
    "stream string, queue string, key string, seq long, producer string, message_id string, "
    "published_at timestamp, redelivered boolean, payload string"
)
_ARROW_SCHEMA = pa.schema(
    [
        ("stream", pa.string()),
        ("queue", pa.string()),
        ("key", pa.string()),
        ("seq", pa.int64()),
        ("producer", pa.string()),
        ("message_id", pa.string()),
        ("published_at", pa.timestamp("ms", tz="UTC")),
        ("redelivered", pa.bool_()),
        ("payload", pa.string()),
    ]
)


def batch_table(stream: str, events: Sequence[Event]) -> pa.Table:
    """The batch as an Arrow table with the pipeline contract's columns, in arrival order."""
    return pa.table(
        [
            pa.array([stream] * len(events), pa.string()),
            pa.array([e.delivery.queue for e in events], pa.string()),
            pa.array([e.key for e in events], pa.string()),
            pa.array([e.seq for e in events], pa.int64()),
            pa.array([e.producer for e in events], pa.string()),
            pa.array([e.delivery.message_id for e in events], pa.string()),
            pa.array([e.published_at_ms for e in events], pa.timestamp("ms", tz="UTC")),
            pa.array([e.delivery.redelivered for e in events], pa.bool_()),
            pa.array([e.payload for e in events], pa.string()),
        ],
        schema=_ARROW_SCHEMA,
    )


class SparkEngine:
    """Owns the SparkSession of a worker process."""

    def __init__(self, settings: WorkerSettings, app_name: str) -> None:
        self._settings = settings
        self._app_name = app_name
        self._session: Any = None

    @property
    def session(self) -> Any:
        if self._session is None:
            raise RuntimeError("the Spark engine is not started")
        return self._session

    def start(self) -> float:
        """Create the session and run a first small job (so the first batch is not slow);
        returns the seconds it took."""
        started = time.monotonic()
        settings = self._settings
        builder: Any = SparkSession.builder.appName(self._app_name)
        # Spark's Python workers must run an interpreter that has keyq and the pipeline; for
        # a local master (or a local Spark Connect server) that is this one. A cluster's
        # executors need keyq installed and PYSPARK_PYTHON set on their side.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        if settings.spark_remote:
            builder = builder.remote(settings.spark_remote)
        else:
            builder = (
                builder.master(settings.spark_master)
                .config("spark.ui.enabled", "false")
                .config("spark.ui.showConsoleProgress", "false")
                .config("spark.sql.execution.arrow.pyspark.enabled", "true")
                .config("spark.python.worker.reuse", "true")
                .config("spark.driver.extraJavaOptions", settings.spark_driver_java_options)
            )
        builder = builder.config(
            "spark.sql.shuffle.partitions", str(settings.spark_shuffle_partitions)
        ).config("spark.sql.session.timeZone", "UTC")
        try:
            self._session = builder.getOrCreate()
        except Exception as exc:  # noqa: BLE001 - Spark fails in many ways; all are config
            where = settings.spark_remote or settings.spark_master
            raise ConfigurationError(f"cannot start Spark ({where}): {exc}") from None
        if not settings.spark_remote:
            self._session.sparkContext.setLogLevel("ERROR")
        self._warm_up()
        elapsed = time.monotonic() - started
        log.info("spark ready in %.1fs (%s)", elapsed, self.describe())
        return elapsed

    def describe(self) -> str:
        return self._settings.spark_remote or self._settings.spark_master

    def _warm_up(self) -> None:
        """Run the same shape of job a batch runs (shuffle by key, Arrow fold), so the first
        real batch does not pay for starting Spark's Python workers."""
        rows = 64
        table = pa.table(
            {
                "key": [f"k{i % 8}" for i in range(rows)],
                "payload": ["{}"] * rows,
                "producer": ["warmup"] * rows,
                "seq": list(range(rows)),
                "_arrival": list(range(rows)),
            }
        )
        frame = self.session.createDataFrame(
            table, schema="key string, payload string, producer string, seq long, _arrival long"
        )
        partitions = self._settings.spark_shuffle_partitions
        spread = frame.coalesce(1) if partitions == 1 else frame.repartition(partitions, "key")
        spread.mapInArrow(make_folder(_keep_state, {}), STATE_SCHEMA_DDL).toArrow()

    def dataframe(self, table: pa.Table) -> Any:
        return self.session.createDataFrame(table, schema=BATCH_SCHEMA_DDL)

    def stop(self) -> None:
        if self._session is not None:
            try:
                self._session.stop()
            except Exception:
                log.debug("spark stop failed", exc_info=True)
            self._session = None


def _keep_state(state: Any, event: Any) -> Any:
    del event
    return state
