"""A batch's commit, fenced by its queues' locks: marks, key states and the record of its
staged output in one write; then the output is published (or discarded if the commit was
refused). Output of a commit the Redis replicas did not confirm waits for a later,
replicated commit to prove it reached them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from keyq.broker.errors import CommitNotReplicated, CommitRefused, KeysStopped
from keyq.broker.locks import Lease
from keyq.worker.batch.marks import KeyMarks
from keyq.worker.batch.state_store import StateStore
from keyq.worker.batch.stats import BatchStats
from keyq.worker.spark.sinks import ParquetSink


class FencedCommit:
    """Commits for one worker; used only by the batch loop's thread."""

    def __init__(self, *, store: StateStore, sink: ParquetSink | None, stats: BatchStats) -> None:
        self._store = store
        self._sink = sink
        self._stats = stats
        # Staged output of commits not yet confirmed by the Redis replicas, by batch id.
        self._unreplicated_output: dict[str, str] = {}

    def stage(self, batch_id: str, output: Any) -> str | None:
        """Write ``output`` (an Arrow table, or None) aside until its commit; where to."""
        if self._sink is not None and output is not None and output.num_rows:
            return self._sink.stage(output, batch_id)
        return None

    def commit(
        self,
        batch_id: str,
        leases: Mapping[str, Lease],
        marks: Mapping[str, KeyMarks],
        states: Mapping[str, str],
        staged: str | None,
        *,
        guards: Sequence[tuple[str, str]] = (),
        extra: Mapping[str, Mapping[str, str]] | None = None,
        expiries: Mapping[str, int] | None = None,
    ) -> None:
        """Commit, then publish the output. Raises ``CommitRefused`` (nothing written) if a
        lock moved on, ``KeysStopped`` (nothing written) if a field of ``guards`` exists,
        ``CommitNotReplicated`` if the replicas did not confirm in time."""
        try:
            lost = self._write(
                batch_id,
                leases,
                marks,
                states,
                staged,
                guards=guards,
                extra=extra,
                expiries=expiries,
            )
        except KeysStopped:
            if staged is not None and self._sink is not None:
                self._sink.discard(staged)
            raise
        if lost:
            if staged is not None and self._sink is not None:
                self._sink.discard(staged)
            raise CommitRefused(f"batch {batch_id}: locks moved on", lost)
        if staged is not None and self._sink is not None:
            self._sink.publish(batch_id, staged)
            self._store.forget_sink_record(batch_id)
        self._publish_replicated_output()

    def _write(
        self,
        batch_id: str,
        leases: Mapping[str, Lease],
        marks: Mapping[str, KeyMarks],
        states: Mapping[str, str],
        staged: str | None,
        *,
        guards: Sequence[tuple[str, str]],
        extra: Mapping[str, Mapping[str, str]] | None,
        expiries: Mapping[str, int] | None,
    ) -> frozenset[str]:
        record = None if staged is None else (batch_id, staged)
        try:
            return self._store.commit(
                list(leases.values()),
                marks,
                states,
                record,
                guards=guards,
                extra=extra,
                expiries=expiries,
            )
        except CommitNotReplicated:
            if staged is not None:
                # Committed on the primary only: visible once a later commit proves it
                # replicated, or dropped if a failover took its record (the batch is redone).
                self._unreplicated_output[batch_id] = staged
            self._stats.commits_unreplicated += 1
            raise

    def _publish_replicated_output(self) -> None:
        """Output of batches whose commit was not confirmed by the replicas: a replicated
        commit since proves their record reached them too, if it survived on the primary."""
        if not self._unreplicated_output or self._sink is None:
            self._unreplicated_output.clear()
            return
        pending = self._store.pending_sink_records()
        for batch_id, staged in self._unreplicated_output.items():
            if pending.get(batch_id) == staged:
                self._sink.publish(batch_id, staged)
                self._store.forget_sink_record(batch_id)
            else:
                self._sink.discard(staged)  # the commit was lost with a primary: redone
        self._unreplicated_output.clear()
