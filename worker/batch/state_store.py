"""Keyed state and exactly-once marks in Redis, committed together and fenced.

A batch commits all its keys' new states and marks, and its sink output's record, through
``FencedLocks.commit``: one script that first checks every lock the batch relied on; if any
moved on (the worker was paused past its ttl, say), nothing is written, so a zombie can never
overwrite the work of a queue's newer owner. All keys of a stream share one hash tag, so this
works on Redis Cluster.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson
import redis

from keyq.broker.locks import FencedLocks, Lease
from keyq.broker.redis_keys import StreamKeys
from keyq.worker.batch.marks import KeyMarks


class StateStore:
    """One stream's keyed state (user JSON per key) and dedup marks."""

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        *,
        replicas: int = 0,
        replica_timeout_ms: int = 2000,
    ) -> None:
        self._client = client
        self.client = client  # for what commits with the state (``keyq.worker.batch.dedupe_ids``)
        self._keys = StreamKeys(stream)
        self._locks = FencedLocks(client, stream)
        self.replicas = replicas  # each commit waits for this many replicas (``WAIT``)
        self._replica_timeout_ms = replica_timeout_ms

    def marks(self, keys: Iterable[str]) -> dict[str, KeyMarks]:
        names = list(dict.fromkeys(keys))
        if not names:
            return {}
        raws = self._client.hmget(self._keys.marks, names)
        return {name: KeyMarks.from_json(raw) for name, raw in zip(names, raws, strict=True)}

    def states(self, keys: Iterable[str]) -> dict[str, str]:
        """Current state JSON of the keys that have one."""
        names = list(dict.fromkeys(keys))
        if not names:
            return {}
        raws = self._client.hmget(self._keys.state, names)
        return {name: str(raw) for name, raw in zip(names, raws, strict=True) if raw is not None}

    def get(self, key: str) -> Any | None:
        """A key's state as Python data, or None if it has none."""
        raw = self._client.hget(self._keys.state, key)
        return None if raw is None else orjson.loads(raw)

    def get_marks(self, key: str) -> KeyMarks:
        return KeyMarks.from_json(self._client.hget(self._keys.marks, key))

    def commit(
        self,
        leases: Sequence[Lease],
        marks: Mapping[str, KeyMarks],
        states: Mapping[str, str],
        sink_record: tuple[str, str] | None = None,
        *,
        guards: Sequence[tuple[str, str]] = (),
        extra: Mapping[str, Mapping[str, str]] | None = None,
        expiries: Mapping[str, int] | None = None,
    ) -> frozenset[str]:
        """Write everything if every lease is current (``FencedLocks.commit``); returns the
        queues whose lease is not (and then nothing was written). Raises
        ``CommitNotReplicated`` when the replicas required did not confirm it in time, and
        ``KeysStopped`` (nothing written) when a field of ``guards`` exists. ``extra``: more
        hashes to write with it (``expiries``: their ttls in ms)."""
        writes: dict[str, dict[str, str]] = {
            self._keys.marks: {key: mark.to_json() for key, mark in marks.items()},
            self._keys.state: dict(states),
        }
        if sink_record is not None:
            token, record = sink_record
            writes[self._keys.sink_pending] = {token: record}
        for target, fields in (extra or {}).items():
            writes[target] = dict(fields)
        return self._locks.commit(
            leases,
            writes,
            replicas=self.replicas,
            replica_timeout_ms=self._replica_timeout_ms,
            guards=guards,
            expiries=expiries,
        )

    def pending_sink_records(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in self._client.hgetall(self._keys.sink_pending).items()}

    def forget_sink_record(self, token: str) -> None:
        self._client.hdel(self._keys.sink_pending, token)
