"""Pipelines the benchmarks run workers with: as little work per event as keyq allows, so the
figures measure keyq (transport, batching, Spark, commits) rather than user code; except
``slow_count``, whose slow step for some keys is what ``bench.hot_key`` measures around."""

from __future__ import annotations

import time
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


# ``slow_count``: a slow step for some keys (``bench.hot_key``'s hot key).
SLOW_PREFIX = "slow."
SLOW_STEP_S = 0.001


def slow_count_event(state: Any, event: Any) -> Any:
    """``count_event``, after sleeping ``SLOW_STEP_S`` for an event whose ``key`` field starts
    with ``SLOW_PREFIX`` (the reducer sees the payload only, so events carry their key)."""
    if str(event.get("key", "")).startswith(SLOW_PREFIX):
        time.sleep(SLOW_STEP_S)
    return (state or 0) + 1


def slow_count(df: Any, ctx: Any) -> Any:
    """Keyed state = number of events applied to the key; 1 ms an event of a slow key."""
    return ctx.state.fold(df, slow_count_event)
