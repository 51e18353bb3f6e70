"""The queue registry: which keyed queues exist and when each was last active.

Producers register a queue when they declare it and touch it while they publish; workers touch
queues they consume; the janitor reads idle entries and removes them only if nobody touched them
since it looked, so a producer re-declaring a queue never loses its registration to a janitor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import redis

from keyq.broker.clock import now_ms
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.redis_topology import is_cluster

# Remove a registry entry only if its activity time is still the one the janitor read.
_FORGET_IF_UNCHANGED = """
local removed = 0
for i = 1, #ARGV, 2 do
  local queue = ARGV[i]
  local seen = ARGV[i + 1]
  local score = redis.call('ZSCORE', KEYS[1], queue)
  if score and tonumber(score) == tonumber(seen) then
    redis.call('ZREM', KEYS[1], queue)
    redis.call('HDEL', KEYS[2], queue)
    removed = removed + 1
  end
end
return removed
"""


class QueueRegistry:
    """Registry of one stream's queues in Redis."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self._client = client
        self._keys = StreamKeys(stream)
        self._forget = client.register_script(_FORGET_IF_UNCHANGED)

    def register(self, queues: Mapping[str, str | None], *, announce: bool = True) -> None:
        """Record queues as active now (with their original keys, if any) and announce them."""
        if not queues:
            return
        stamp = now_ms()
        pipe = self._client.pipeline(transaction=False)
        # GT adds new members and moves existing ones forward only.
        pipe.zadd(self._keys.registry, dict.fromkeys(queues, stamp), gt=True)
        named: dict[Any, Any] = {queue: key for queue, key in queues.items() if key is not None}
        if named:
            pipe.hset(self._keys.queue_keys, mapping=named)
        news = "\n".join(queues) if announce else None  # one message, a queue per line
        if news is not None and not is_cluster(self._client):
            pipe.publish(self._keys.announcements, news)
            news = None
        pipe.execute()
        if news is not None:
            self._client.publish(self._keys.announcements, news)  # a cluster refuses it piped

    def touch(self, queues: Iterable[str], at_ms: int | None = None) -> None:
        """Move queues' last activity forward (never back, never creating an entry)."""
        stamped = dict.fromkeys(queues, at_ms if at_ms is not None else now_ms())
        if stamped:
            self._client.zadd(self._keys.registry, stamped, xx=True, gt=True)

    def queues(self) -> dict[str, int]:
        """Every registered queue with its last activity in ms."""
        pairs = cast(
            list[tuple[str, float]],
            self._client.zrange(self._keys.registry, 0, -1, withscores=True),
        )
        return {str(queue): int(score) for queue, score in pairs}

    def idle_since(self, cutoff_ms: int, limit: int = 1000) -> dict[str, int]:
        """Queues whose last activity is at or before ``cutoff_ms``, oldest first."""
        pairs = cast(
            list[tuple[str, float]],
            self._client.zrangebyscore(
                self._keys.registry, "-inf", cutoff_ms, start=0, num=limit, withscores=True
            ),
        )
        return {str(queue): int(score) for queue, score in pairs}

    def forget_if_unchanged(self, seen: Mapping[str, int]) -> int:
        """Remove entries whose activity is still what was seen; returns how many went."""
        if not seen:
            return 0
        args: list[str | int] = []
        for queue, stamp in seen.items():
            args.extend((queue, stamp))
        removed = self._forget(keys=[self._keys.registry, self._keys.queue_keys], args=args)
        return int(removed)

    def original_keys(self, queues: Iterable[str]) -> dict[str, str | None]:
        """The original key of each key-mode queue (None for bucket queues or unknown)."""
        names = list(queues)
        if not names:
            return {}
        values = self._client.hmget(self._keys.queue_keys, names)
        return {
            name: (None if value is None else str(value))
            for name, value in zip(names, values, strict=True)
        }

    def count(self) -> int:
        return int(self._client.zcard(self._keys.registry))
