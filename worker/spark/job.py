"""The pipeline run on one batch's events as a Spark job: its new key states, and its
output as Arrow when a sink wants it. A failure comes out as a ``PipelineError`` (retried,
then isolated) or as Spark being unavailable (``keyq.worker.batch.failures``)."""

from __future__ import annotations

from typing import Any

from keyq.broker.errors import PipelineError
from keyq.worker.batch.decoding import Event
from keyq.worker.batch.failures import pipeline_failure
from keyq.worker.batch.state_store import StateStore
from keyq.worker.pipeline import BatchContext, KeyedState, Pipeline
from keyq.worker.spark.engine import SparkEngine, batch_table


class PipelineJob:
    """Runs a worker's pipeline; used only by the batch loop's thread."""

    def __init__(
        self,
        *,
        stream: str,
        worker_id: str,
        engine: SparkEngine,
        pipeline: Pipeline,
        store: StateStore,
        partitions: int,
        wants_output: bool,
    ) -> None:
        self._stream = stream
        self._worker_id = worker_id
        self._engine = engine
        self._pipeline = pipeline
        self._store = store
        self._partitions = partitions
        self._wants_output = wants_output

    def run(
        self, batch_id: str, events: list[Event], keys: list[str], queues: list[str], attempt: int
    ) -> tuple[dict[str, str], Any]:
        """The new state of each key folded, and the output table (None if there is none,
        or nothing wants it)."""
        state = KeyedState(self._store, keys, self._partitions)
        try:
            folded, table = self._evaluate(batch_id, events, state, queues, attempt)
        except PipelineError:
            raise
        except Exception as exc:
            raise pipeline_failure(exc) from exc
        return _states(folded), table

    def _evaluate(
        self,
        batch_id: str,
        events: list[Event],
        state: KeyedState,
        queues: list[str],
        attempt: int,
    ) -> tuple[Any, Any]:
        frame = self._engine.dataframe(batch_table(self._stream, events))
        context = BatchContext(
            batch_id=batch_id,
            worker_id=self._worker_id,
            stream=self._stream,
            spark=self._engine.session,
            state=state,
            queues=queues,
            attempt=attempt,
        )
        output = self._pipeline(frame, context)
        folded = state.folded.toArrow() if state.folded is not None else None
        if output is None or not self._wants_output:
            return folded, None
        if output is state.folded:
            return folded, folded
        return folded, output.toArrow()


def _states(folded: Any) -> dict[str, str]:
    if folded is None:
        return {}
    columns = folded.to_pydict()
    return dict(zip(columns["key"], columns["state"], strict=True))
