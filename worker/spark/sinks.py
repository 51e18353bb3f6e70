"""Where a batch's output goes, written so each batch appears once, whole, or not at all.

The Parquet sink stages a batch's file, the worker commits a record of it together with the
batch's state (fenced), then the file is renamed into place. A crash between the commit and
the rename leaves the record, and the next worker to start finishes the rename; a crash
before the commit leaves only a staged file, never visible, and the batch is redone.
Spark and most Parquet readers skip paths starting with ``_``, such as the staging folder.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from keyq.broker.errors import ConfigurationError

log = logging.getLogger("keyq.worker.sink")
STAGING = "_staging"
ORPHAN_AGE_S = 3600.0


class Sink(Protocol):
    def stage(self, table: pa.Table, batch_id: str) -> str:
        """Write the output where nobody reads it yet; returns what to record."""
        ...

    def publish(self, batch_id: str, staged: str) -> None:
        """Make a committed batch's output visible (idempotent)."""
        ...

    def discard(self, staged: str) -> None: ...

    def describe(self) -> str: ...


class ParquetSink:
    """One Parquet file per batch under ``directory``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._staging = self.directory / STAGING
        try:
            self._staging.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigurationError(f"cannot create sink folder {self.directory}: {exc}") from None

    def describe(self) -> str:
        return f"parquet:{self.directory}"

    def final_path(self, batch_id: str) -> Path:
        return self.directory / f"part-{batch_id}.parquet"

    def stage(self, table: pa.Table, batch_id: str) -> str:
        staged = self._staging / f"{batch_id}.parquet"
        partial = staged.with_suffix(".partial")
        pq.write_table(table, partial)
        os.replace(partial, staged)
        return staged.name

    def publish(self, batch_id: str, staged: str) -> None:
        source = self._staging / staged
        if source.exists():
            os.replace(source, self.final_path(batch_id))

    def discard(self, staged: str) -> None:
        (self._staging / staged).unlink(missing_ok=True)

    def sweep_orphans(self, pending: set[str], older_than_s: float = ORPHAN_AGE_S) -> int:
        """Delete staged files no commit refers to, once they are old enough to be dead."""
        removed = 0
        cutoff = time.time() - older_than_s
        for path in self._staging.iterdir():
            if path.name in pending:
                continue
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed


def open_sink(spec: str | None) -> ParquetSink | None:
    """``parquet:/path`` (or a bare path) -> a sink; ``None``/``none`` -> no sink."""
    if spec is None or spec.strip().lower() in ("", "none"):
        return None
    kind, sep, target = spec.partition(":")
    if not sep:
        kind, target = "parquet", spec
    if kind != "parquet" or not target:
        raise ConfigurationError(f"sink {spec!r} must be parquet:/path/to/folder or none")
    return ParquetSink(target)
