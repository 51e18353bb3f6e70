"""The keyed fold that runs inside Spark: each key's events, in arrival order, through a
plain Python reducer, starting from the key's committed state.

This module is shipped to Spark's Python workers, so it imports nothing heavier than pyarrow
and orjson, and the reducer must be importable there (a module-level function).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pyarrow as pa

Reducer = Callable[[Any, Any], Any]

STATE_COLUMNS = ("key", "state", "applied")
STATE_SCHEMA_DDL = "key string, state string, applied long"


class FoldFailed(Exception):
    """The reducer raised (or returned something that is not JSON) on one event."""


def make_folder(
    reducer: Reducer, prior: dict[str, str]
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function over rows sorted by (key, arrival), yielding one row per key:
    the key, its new state as JSON, and how many events were applied to it."""

    def fold(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        keys: list[str] = []
        states: list[str] = []
        counts: list[int] = []
        current: str | None = None
        state: Any = None
        applied = 0

        def finish() -> None:
            if current is None:
                return
            try:
                encoded = orjson.dumps(state).decode()
            except (orjson.JSONEncodeError, TypeError) as exc:
                raise FoldFailed(f"state of key {current!r} is not JSON: {exc}") from None
            keys.append(current)
            states.append(encoded)
            counts.append(applied)

        for batch in batches:
            columns = batch.to_pydict()
            for key, payload, producer, seq in zip(
                columns["key"],
                columns["payload"],
                columns["producer"],
                columns["seq"],
                strict=True,
            ):
                if key != current:
                    finish()
                    current = key
                    raw = prior.get(key)
                    state = None if raw is None else orjson.loads(raw)
                    applied = 0
                try:
                    state = reducer(state, orjson.loads(payload))
                except Exception as exc:  # noqa: BLE001 - any reducer error fails the event
                    raise FoldFailed(
                        f"fold of key {key!r} failed on the event from producer {producer} "
                        f"seq {seq}: {type(exc).__name__}: {exc}"
                    ) from None
                applied += 1
        finish()
        yield pa.RecordBatch.from_arrays(
            [
                pa.array(keys, pa.string()),
                pa.array(states, pa.string()),
                pa.array(counts, pa.int64()),
            ],
            names=list(STATE_COLUMNS),
        )

    return fold
