"""The keyed fold that runs inside Spark: each key's events, in arrival order, through a
plain Python reducer, starting from the key's committed state.

Spark only has to bring each key's rows into one partition (no sort): the fold groups them by
key and orders them by their arrival number itself, which is cheaper for micro-batches.

This module is shipped to Spark's Python workers, so it imports nothing heavier than pyarrow
and orjson, and the reducer must be importable there (a module-level function).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pyarrow as pa

Reducer = Callable[[Any, Any], Any]
# Turns a body that is not JSON (Avro, Protobuf, MessagePack…) into what the reducer gets;
# what it raises dead-letters the event with its error as the reason.
Decoder = Callable[[bytes], Any]

STATE_COLUMNS = ("key", "state", "applied")
STATE_SCHEMA_DDL = "key string, state string, applied long"


class FoldFailed(Exception):
    """The reducer raised (or returned something that is not JSON) on one event."""


_TOKEN = re.compile(r" \[keyq-event ([0-9a-f]+) ([A-Za-z0-9_.:-]+) (\d+)\]")


def event_token(key: str, producer: str | None, seq: int | None) -> str:
    """A machine-readable tail naming the failing event, so the worker can dead-letter that
    event without bisecting the batch (events without an SDK identity have none)."""
    if producer is None or seq is None:
        return ""
    return f" [keyq-event {key.encode('utf-8').hex()} {producer} {seq}]"


def failing_event(text: str) -> tuple[str, str, int] | None:
    """(key, producer, seq) named by a fold failure's text, if it names one."""
    found = _last_token(text)
    if found is None:
        return None
    return bytes.fromhex(found.group(1)).decode("utf-8"), found.group(2), int(found.group(3))


def without_event_token(text: str) -> str:
    found = _last_token(text)
    return text if found is None else text[: found.start()] + text[found.end() :]


def _last_token(text: str) -> re.Match[str] | None:
    """The token is appended last: a key that itself looks like one cannot pose as it."""
    found = None
    for found in _TOKEN.finditer(text):  # noqa: B007 - the last one is wanted
        pass
    return found


# arrival, payload, body, content type, producer, seq
Row = tuple[int, str | None, bytes | None, str | None, str | None, int | None]
JSON_TYPE = "application/json"


def labelled_json(content_type: str | None) -> bool:
    """A body labelled JSON, or not labelled at all (as other clients send JSON)."""
    return not content_type or content_type.split(";", 1)[0].strip().lower() == JSON_TYPE


def make_folder(
    reducer: Reducer, prior: dict[str, str], decoder: Decoder | None = None
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function over rows ``key, payload, body, content_type, producer, seq,
    _arrival``
    (each key's rows all in one partition, in any order), yielding one row per key: the key,
    its new state as JSON, and how many events were applied to it. Each key's events are
    folded in ``_arrival`` order, starting from its ``prior`` state. The reducer gets a JSON
    event as its JSON; any other as ``decoder(body)`` if a decoder is given, else as bytes."""

    def event_of(
        key: str, payload: str | None, body: bytes | None, content_type: str | None, token: str
    ) -> Any:
        if payload is not None and (decoder is None or labelled_json(content_type)):
            return orjson.loads(payload)
        if decoder is None:
            return body
        try:
            return decoder(body if body is not None else b"")
        except Exception as exc:  # noqa: BLE001 - what a decoder raises rejects the event
            raise FoldFailed(
                f"the decoder rejected the payload of key {key!r}: "
                f"{type(exc).__name__}: {exc}{token}"
            ) from None

    def fold(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        keys: list[str] = []
        states: list[str] = []
        counts: list[int] = []
        for key, rows in _rows_by_key(batches).items():
            rows.sort(key=_arrival_of)
            raw = prior.get(key)
            state: Any = None if raw is None else orjson.loads(raw)
            for _arrival, payload, body, content_type, producer, seq in rows:
                token = event_token(key, producer, seq)
                event = event_of(key, payload, body, content_type, token)
                try:
                    state = reducer(state, event)
                except Exception as exc:  # noqa: BLE001 - any reducer error fails the event
                    raise FoldFailed(
                        f"fold of key {key!r} failed on the event from producer {producer} "
                        f"seq {seq}: {type(exc).__name__}: {exc}{token}"
                    ) from None
            keys.append(key)
            states.append(_encoded(key, state))
            counts.append(len(rows))
        yield pa.RecordBatch.from_arrays(
            [
                pa.array(keys, pa.string()),
                pa.array(states, pa.string()),
                pa.array(counts, pa.int64()),
            ],
            names=list(STATE_COLUMNS),
        )

    return fold


def _rows_by_key(batches: Iterator[pa.RecordBatch]) -> dict[str, list[Row]]:
    """A partition's rows, by key, in the order they came (not yet arrival order)."""
    by_key: dict[str, list[Row]] = {}
    for batch in batches:
        columns = batch.to_pydict()
        absent = [None] * batch.num_rows
        for key, payload, body, content_type, producer, seq, arrival in zip(
            columns["key"],
            columns["payload"],
            columns.get("body") or absent,
            columns.get("content_type") or absent,
            columns["producer"],
            columns["seq"],
            columns["_arrival"],
            strict=True,
        ):
            by_key.setdefault(key, []).append((arrival, payload, body, content_type, producer, seq))
    return by_key


def _encoded(key: str, state: Any) -> str:
    try:
        return orjson.dumps(state).decode()
    except (orjson.JSONEncodeError, TypeError) as exc:
        raise FoldFailed(f"state of key {key!r} is not JSON: {exc}") from None


def _arrival_of(row: Row) -> int:
    return row[0]
