"""Idempotent publishing across producer restarts: an event that carries a dedupe id
(``publish(..., dedupe_id=...)``) is applied to its key once, whichever producer sent it, as
long as the id is remembered.

Ids are kept per key in hashes of one time bucket each, a window long (the stream's
``dedupe_window_s``), written with the batch's fenced commit and expiring two windows after
their last write. An id is looked up in the current bucket and the one before, so it is
remembered at least one window and at most two. Each id costs its bytes plus about 40 in
Redis, for as long as it is remembered.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import redis

from keyq.broker.envelope import HEADER_DEDUPE_ID
from keyq.broker.naming import key_digest
from keyq.broker.redis_keys import StreamKeys
from keyq.worker.batch.decoding import Event


def dedupe_id_of(event: Event) -> str | None:
    value = event.delivery.headers.get(HEADER_DEDUPE_ID)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


@dataclass
class Deduped:
    """A run's events once repeated dedupe ids are taken out, and what to remember."""

    events: list[Event]
    skipped: list[Event] = field(default_factory=list)
    writes: dict[str, dict[str, str]] = field(default_factory=dict)
    expiries: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class AppliedIds:
    """The dedupe ids of a run's events already applied to their keys, as read before the
    run is admitted (in the window's bucket and the one before)."""

    bucket: int = 0
    window_s: int = 1
    by_key: Mapping[str, frozenset[str]] = field(default_factory=dict)


class DedupeIds:
    """The dedupe ids applied to one stream's keys."""

    def __init__(
        self, client: redis.Redis, stream: str, clock: Callable[[], float] = time.time
    ) -> None:
        self._client = client
        self._clock = clock
        self.keys = StreamKeys(stream)

    def applied(self, events: Iterable[Event], window_s: int) -> AppliedIds:
        """Which of ``events``' dedupe ids were applied to their keys already: one round
        trip, none when no event carries an id."""
        wanted: dict[str, set[str]] = {}
        for event in events:
            dedupe_id = dedupe_id_of(event)
            if dedupe_id is not None:
                wanted.setdefault(event.key, set()).add(dedupe_id)
        bucket = int(self._clock() // window_s)
        if not wanted:
            return AppliedIds(bucket, window_s)
        keys = list(wanted)
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            ids = sorted(wanted[key])
            digest = key_digest(key)
            pipe.hmget(self.keys.dedupe_ids(digest, bucket), ids)
            pipe.hmget(self.keys.dedupe_ids(digest, bucket - 1), ids)
        answers = pipe.execute()
        applied: dict[str, frozenset[str]] = {}
        for index, key in enumerate(keys):
            ids = sorted(wanted[key])
            now, before = answers[2 * index], answers[2 * index + 1]
            applied[key] = frozenset(
                dedupe_id
                for dedupe_id, a, b in zip(ids, now, before, strict=True)
                if a is not None or b is not None
            )
        return AppliedIds(bucket, window_s, applied)


def take_out_repeats(events: Iterable[Event], applied: AppliedIds, keys: StreamKeys) -> Deduped:
    """``events`` (in apply order) without those whose dedupe id was applied to their key
    already, or comes earlier in the run; and the ids to remember with the commit. Pure."""
    kept: list[Event] = []
    result = Deduped(kept)
    seen: dict[str, set[str]] = {}
    for event in events:
        dedupe_id = dedupe_id_of(event)
        if dedupe_id is None:
            kept.append(event)
            continue
        known = seen.setdefault(event.key, set(applied.by_key.get(event.key, ())))
        if dedupe_id in known:
            result.skipped.append(event)
            continue
        known.add(dedupe_id)
        kept.append(event)
        target = keys.dedupe_ids(key_digest(event.key), applied.bucket)
        result.writes.setdefault(target, {})[dedupe_id] = f"{event.producer}:{event.seq}"
        result.expiries[target] = 2 * applied.window_s * 1000
    return result
