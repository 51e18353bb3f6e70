"""Auto mode's routes: which keys have a queue of their own, in Redis.

In auto mode a key's events go to its hash bucket. A key is *promoted* when it needs a queue of
its own (it is hot, backs up its bucket, is held back, or an operator asks): from then on
producers publish its events to that queue once they have read the route
(``keyq.producer.route_follow``), the holder of its bucket *forwards* those that still reach
the bucket, confirmed, to the key's own queue, and the holder of that queue applies them by
their seqs. A key is *demoted* by the janitor once its own queue has drained, stayed idle and
been deleted: its bucket's holder applies it again.

One applier per key at a time. A move opens when the key is promoted; the holder of its
bucket *closes* it between two of its batches, under its fenced lease, so every batch of the
bucket that read the key's status before the promotion has committed by then. The own queue's
holder applies nothing of the key while its move is open. After the close the key's events
reach it only through its own queue: published there, or forwarded there in the bucket's
order. A demotion comes after the own queue was deleted empty and unused under the retirement
fence (whose leases of an own queue also need its route): nothing of the key waits there or is
being applied from there, and no producer sends there again.

Every route change is fenced in one script, epochs only grow, and the stream keeps counts and
a short log of them for ``keyq inspect``, ``keyq status`` and the metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import orjson
import redis

from keyq.broker.clock import now_ms
from keyq.broker.locks import Lease
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.streams import StreamConfig
from keyq.broker.text import as_text

LOG_KEPT = 1000
FORWARDED_TTL_MS = 86_400_000

# Why a key was promoted (``Route.why``).
WHY_RATE = "rate"
WHY_BACKLOG = "backlog"
WHY_STOPPED = "stopped"
WHY_RATE_LIMITED = "rate-limited"
WHY_OPERATOR = "operator"
PROMOTION_REASONS = (WHY_RATE, WHY_BACKLOG, WHY_STOPPED, WHY_RATE_LIMITED, WHY_OPERATOR)

# KEYS = routes, moves, epoch, counts, log, aside; ARGV = key, own queue, bucket queue, why,
# now, log kept. Promotes the key unless it is promoted already (its route is returned as it
# is) or its events wait aside in its bucket (false: only the bucket's holder drains those).
_PROMOTE = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if current then
  return current
end
if redis.call('HEXISTS', KEYS[6], ARGV[1]) == 1 then
  return false
end
local epoch = redis.call('INCR', KEYS[3])
local route = cjson.encode({e = epoch, q = ARGV[2], b = ARGV[3], open = 1, at = tonumber(ARGV[5]),
  why = ARGV[4]})
redis.call('HSET', KEYS[1], ARGV[1], route)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('HINCRBY', KEYS[4], 'promoted:' .. ARGV[4], 1)
redis.call('LPUSH', KEYS[5], cjson.encode({what = 'promoted', key = ARGV[1], e = epoch,
  why = ARGV[4], at = tonumber(ARGV[5])}))
redis.call('LTRIM', KEYS[5], 0, tonumber(ARGV[6]) - 1)
return route
"""

# KEYS = routes, moves, log, the bucket's lock; ARGV = key, epoch, lease value, now. Closes
# the key's move of that epoch, fenced by the bucket's lock: 1 closed, 0 nothing open to close,
# false when the lease is no longer current.
_CLOSE = """
if redis.call('GET', KEYS[4]) ~= ARGV[3] then
  return false
end
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then
  redis.call('HDEL', KEYS[2], ARGV[1])
  return 0
end
local route = cjson.decode(raw)
if tostring(route.e) ~= ARGV[2] or route.open ~= 1 then
  return 0
end
route.open = 0
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(route))
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('LPUSH', KEYS[3], cjson.encode({what = 'closed', key = ARGV[1], e = route.e,
  at = tonumber(ARGV[4])}))
return 1
"""

# KEYS[1] = the key's forwarded hash; ARGV = ttl ms, then producer, seq pairs. Keeps, per
# producer, the highest seq forwarded.
_NOTE_FORWARDED = """
for i = 2, #ARGV, 2 do
  local seq = tonumber(ARGV[i + 1])
  if seq > (tonumber(redis.call('HGET', KEYS[1], ARGV[i])) or 0) then
    redis.call('HSET', KEYS[1], ARGV[i], seq)
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""

# KEYS = routes, moves, counts, log, aside, forwarded; ARGV = key, own queue, now, log kept.
# Demotes the key if its route names that own queue, its move is closed and nothing of it waits
# aside (whose only drainer is the holder of that queue): 1 demoted, 0 refused or not promoted.
_DEMOTE = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then
  return 0
end
local route = cjson.decode(raw)
if route.q ~= ARGV[2] or route.open == 1 or redis.call('HEXISTS', KEYS[5], ARGV[1]) == 1 then
  return 0
end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[6])
redis.call('HINCRBY', KEYS[3], 'demoted', 1)
redis.call('LPUSH', KEYS[4], cjson.encode({what = 'demoted', key = ARGV[1], e = route.e,
  at = tonumber(ARGV[3])}))
redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[4]) - 1)
return 1
"""


@dataclass(frozen=True)
class Route:
    """A promoted key's route: its own queue, since which epoch, and whether its move is open."""

    epoch: int
    queue: str  # the key's own queue (base name)
    bucket: str  # the bucket queue producers publish the key's events to
    open: bool  # its bucket's holder has not closed the move yet
    at_ms: int
    why: str

    @classmethod
    def from_json(cls, raw: str | bytes) -> Route:
        data = orjson.loads(raw)
        return cls(
            epoch=int(data["e"]),
            queue=str(data["q"]),
            bucket=str(data["b"]),
            open=int(data.get("open", 0)) == 1,
            at_ms=int(data.get("at", 0)),
            why=str(data.get("why", "")),
        )

    def describe(self) -> dict[str, object]:
        return {
            "queue": self.queue,
            "epoch": self.epoch,
            "move": "open" if self.open else "closed",
            "since_ms": self.at_ms,
            "why": self.why,
        }


def applying_queue(config: StreamConfig, key: str, route: Route | None) -> str | None:
    """The queue whose holder applies ``key`` and drains what of it waits aside: its own
    queue once promoted, its stream's queue for it otherwise; None while it moves."""
    if route is None:
        return config.queue_for(key)
    return None if route.open else route.queue


class RouteBook:
    """The routes of one auto-mode stream."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self._client = client
        self._keys = StreamKeys(stream)
        self._promote = client.register_script(_PROMOTE)
        self._close = client.register_script(_CLOSE)
        self._demote = client.register_script(_DEMOTE)
        self._note_forwarded = client.register_script(_NOTE_FORWARDED)

    def promote(self, key: str, own_queue: str, bucket: str, why: str) -> Route | None:
        """Promote ``key`` to ``own_queue`` (its base name); its route as it is after, or None
        when its events wait aside in its bucket (only that bucket's holder may drain them)."""
        keys = self._keys
        raw = self._promote(
            keys=[
                keys.routes,
                keys.moves,
                keys.route_epoch,
                keys.route_counts,
                keys.route_log,
                keys.aside,
            ],
            args=[key, own_queue, bucket, why, now_ms(), LOG_KEPT],
        )
        return None if raw is None else Route.from_json(raw)

    def close(self, key: str, epoch: int, lease: Lease) -> bool | None:
        """Close ``key``'s move of ``epoch`` under ``lease`` (of its bucket): True closed,
        False nothing open to close, None the lease is no longer current."""
        keys = self._keys
        answer = self._close(
            keys=[keys.routes, keys.moves, keys.route_log, keys.lock(lease.queue)],
            args=[key, epoch, lease.value, now_ms()],
        )
        return None if answer is None else bool(answer)

    def demote(self, key: str, own_queue: str) -> bool:
        """Demote ``key`` whose own queue (base name) was deleted; False when refused."""
        keys = self._keys
        return bool(
            self._demote(
                keys=[
                    keys.routes,
                    keys.moves,
                    keys.route_counts,
                    keys.route_log,
                    keys.aside,
                    keys.forwarded(key),
                ],
                args=[key, own_queue, now_ms(), LOG_KEPT],
            )
        )

    def note_forwarded(self, key: str, seqs: Mapping[str, int]) -> None:
        """For the holder of ``key``'s bucket: it forwarded these producers' events of the key
        up to these seqs, confirmed (kept a day, or until the key is demoted)."""
        if seqs:
            args: list[str | int] = [FORWARDED_TTL_MS]
            for producer, seq in seqs.items():
                args += [producer, seq]
            self._note_forwarded(keys=[self._keys.forwarded(key)], args=args)

    def passed(self, keys: Iterable[str], producer: str) -> dict[str, int]:
        """For a producer switching keys to their own queues: per key, the highest seq of its
        events from ``producer`` that has left the key's bucket, forwarded or applied (in the
        key's marks, ``keyq.worker.batch.marks``)."""
        names = list(dict.fromkeys(keys))
        if not names:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for key in names:
            pipe.hget(self._keys.forwarded(key), producer)
        pipe.hmget(self._keys.marks, names)
        *forwarded, marks = pipe.execute()
        passed: dict[str, int] = {}
        for key, sent, raw in zip(names, forwarded, marks, strict=True):
            applied = orjson.loads(raw).get("p", {}).get(producer, 0) if raw else 0
            passed[key] = max(int(sent or 0), int(applied))
        return passed

    def routes(self, keys: Iterable[str]) -> dict[str, Route]:
        """The route of each of ``keys`` that is promoted (one round trip)."""
        names = list(dict.fromkeys(keys))
        if not names:
            return {}
        found = self._client.hmget(self._keys.routes, names)
        return {name: Route.from_json(raw) for name, raw in zip(names, found, strict=True) if raw}

    def route(self, key: str) -> Route | None:
        return self.routes([key]).get(key)

    def open_moves(self) -> dict[str, str]:
        """Each key whose move is open -> its bucket queue."""
        return {as_text(k): as_text(v) for k, v in self._client.hgetall(self._keys.moves).items()}

    def promoted(self, limit: int = 10_000) -> dict[str, Route]:
        """Promoted keys and their routes, at most ``limit`` of them."""
        found: dict[str, Route] = {}
        for name, raw in self._client.hscan_iter(self._keys.routes, count=1000):
            found[as_text(name)] = Route.from_json(raw)
            if len(found) >= limit:
                break
        return found

    def version(self) -> tuple[int, int]:
        """Promotions and demotions so far: while it stays the same, so do the routes' keys."""
        pipe = self._client.pipeline(transaction=False)
        pipe.get(self._keys.route_epoch)
        pipe.hget(self._keys.route_counts, "demoted")
        epoch, demoted = pipe.execute()
        return int(epoch or 0), int(demoted or 0)

    def count(self) -> int:
        return int(self._client.hlen(self._keys.routes))

    def counts(self) -> dict[str, int]:
        """Promotions by why (``promoted:<why>``) and demotions (``demoted``)."""
        raw = self._client.hgetall(self._keys.route_counts)
        return {as_text(k): int(v) for k, v in raw.items()}

    def history(self, limit: int = 20, key: str | None = None) -> list[dict[str, object]]:
        """The latest route changes, newest first (of ``key`` only, if given)."""
        rows = [orjson.loads(raw) for raw in self._client.lrange(self._keys.route_log, 0, -1)]
        if key is not None:
            rows = [row for row in rows if row.get("key") == key]
        return rows[:limit]
