"""Pipelines the benchmarks run workers with: as little work per event as keyq allows, so the
figures measure keyq (transport, batching, Spark, commits) rather than user code."""

from __future__ import annotations

from typing import Any


def count_event(state: Any, event: Any) -> Any:
    del event
    return (state or 0) + 1


def count(df: Any, ctx: Any) -> Any:
    """Keyed state = number of events applied to the key."""
    return ctx.state.fold(df, count_event)


def ordered_count_event(state: Any, event: Any) -> Any:
    count, last, violations = state or (0, 0, 0)
    n = int(event["n"])
    return (count + 1, max(last, n), violations + (1 if n < last else 0))


def ordered_count(df: Any, ctx: Any) -> Any:
    """Keyed state = [events applied, highest ``n`` seen, events that came after a higher n]."""
    return ctx.state.fold(df, ordered_count_event)
