"""What a batch's failure means: one event's fault (named, so it can be isolated), the
pipeline's, or Spark itself being gone (never blamed on the events); and the control-flow
signals that stop a batch early and hand it back to the worker."""

from __future__ import annotations

from keyq.broker.errors import KeyqError, PipelineError, SparkUnavailable
from keyq.worker.spark.fold import failing_event, without_event_token


class EventFailed(PipelineError):
    """The pipeline failed on one event, which the failure names: (key, producer, seq)."""

    def __init__(self, reason: str, event: tuple[str, str, int]) -> None:
        super().__init__(reason)
        self.event = event


class Stale(Exception):
    """Deliveries of a consumer that is gone (its channel closed, so the broker has them
    back): hand the batch back, the worker drops those and keeps the rest."""


class Interrupted(Exception):
    """Shutdown came during a retry's backoff: stop and hand the batch back."""


def describe_failure(exc: BaseException) -> str:
    """A one-line reason for a failure, good enough for a dead-letter header."""
    text = without_event_token(str(exc))
    marker = "FoldFailed: "
    if marker in text:
        return text[text.index(marker) + len(marker) :].splitlines()[0].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # Spark's Python errors end with the Python exception's own line.
    for line in reversed(lines):
        if ": " in line and not line.startswith(("at ", "File ")):
            return f"pipeline failed: {line}"[:1000]
    return f"pipeline failed: {type(exc).__name__}: {lines[0] if lines else ''}"[:1000]


_SPARK_DOWN_SIGNS = (
    "Py4JNetworkError",
    "Connection refused",
    "SparkContext was shut down",
    "Cannot call methods on a stopped SparkContext",
    "StatusCode.UNAVAILABLE",
    "Answer from Java side is empty",
)


def spark_unavailable(exc: BaseException) -> bool:
    """Whether a failure is Spark itself being gone, rather than the pipeline failing on
    these events: such batches wait and retry, and are never dead-lettered."""
    text = f"{type(exc).__name__}: {exc}"
    return any(sign in text for sign in _SPARK_DOWN_SIGNS)


def pipeline_failure(exc: Exception) -> KeyqError:
    """What a pipeline run's exception (other than a ``PipelineError``) is raised as: only a
    ``PipelineError`` is retried and isolated; Spark gone, or code it cannot import (the
    deployment's fault, not the events'), makes the batch wait instead."""
    if isinstance(exc, KeyqError):
        return PipelineError(str(exc))
    if spark_unavailable(exc):
        return SparkUnavailable(f"Spark is unavailable: {describe_failure(exc)}")
    if "No module named" in str(exc):
        return SparkUnavailable(f"Spark cannot import the pipeline's code: {describe_failure(exc)}")
    named = failing_event(str(exc))
    if named is not None:
        return EventFailed(describe_failure(exc), named)
    return PipelineError(describe_failure(exc))
