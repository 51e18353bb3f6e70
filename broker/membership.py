"""Worker membership: who is alive in a stream, so each can compute its fair share.

A member is alive while its heartbeat keeps its expiry in the future; a crashed worker simply
stops heartbeating and drops out after the ttl, with no cleanup needed from anyone.
"""

from __future__ import annotations

import os
import socket

import orjson
import redis

from keyq.broker.clock import now_ms
from keyq.broker.redis_keys import StreamKeys


class Membership:
    """Heartbeats of the workers of one stream."""

    def __init__(self, client: redis.Redis, stream: str, ttl_ms: int) -> None:
        self._client = client
        self._keys = StreamKeys(stream)
        self.ttl_ms = ttl_ms

    def heartbeat(self, worker_id: str, info: dict[str, object] | None = None) -> None:
        """Keep ``worker_id`` alive for another ttl; ``info`` is stored for status views."""
        pipe = self._client.pipeline(transaction=False)
        pipe.zadd(self._keys.members, {worker_id: now_ms() + self.ttl_ms})
        if info is not None:
            described = {"host": socket.gethostname(), "pid": os.getpid(), **info}
            pipe.hset(self._keys.member_info, worker_id, orjson.dumps(described).decode())
        pipe.execute()

    def leave(self, worker_id: str) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.zrem(self._keys.members, worker_id)
        pipe.hdel(self._keys.member_info, worker_id)
        pipe.execute()

    def alive(self) -> list[str]:
        """Live worker ids, sorted, so every worker computes the same ranking."""
        members = self._client.zrangebyscore(self._keys.members, now_ms(), "+inf")
        return sorted(str(member) for member in members)

    def serving(self, worker_id: str) -> bool:
        """Alive, and done with its first claim round: what "ready" means for a worker, read
        from Redis so that a supervisor, a test or the demo waits on state, not on a log."""
        pipe = self._client.pipeline(transaction=False)
        pipe.zscore(self._keys.members, worker_id)
        pipe.hget(self._keys.member_info, worker_id)
        expires, raw = pipe.execute()
        if expires is None or float(expires) < now_ms() or raw is None:
            return False
        return bool(orjson.loads(raw).get("ready"))

    def info(self) -> dict[str, dict[str, object]]:
        raw = self._client.hgetall(self._keys.member_info)
        return {str(worker): orjson.loads(value) for worker, value in raw.items()}

    def prune(self) -> list[str]:
        """Forget members whose heartbeat expired; returns who was removed."""
        cutoff = now_ms()
        expired = [str(m) for m in self._client.zrangebyscore(self._keys.members, "-inf", cutoff)]
        if expired:
            pipe = self._client.pipeline(transaction=False)
            pipe.zremrangebyscore(self._keys.members, "-inf", cutoff)
            pipe.hdel(self._keys.member_info, *expired)
            pipe.execute()
        return expired


def fair_share(queue_count: int, workers: list[str], worker_id: str) -> int:
    """How many queues ``worker_id`` should hold: an even split, remainder to the first."""
    if not workers:
        return queue_count
    ranked = sorted(workers)
    rank = ranked.index(worker_id) if worker_id in ranked else len(ranked) - 1
    base, extra = divmod(queue_count, len(ranked))
    return base + (1 if rank < extra else 0)
