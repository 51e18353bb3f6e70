"""What operators and the poison policy set on keys: paused, parked, and the queues a key's
events wait in aside, in Redis.

A key that is paused or parked is *stopped*: nothing of it is applied. Its events do not stay
in its own queue (in bucket mode that queue is shared with other keys, which must flow): the
worker holding that queue moves them, confirmed, to the tail of the key's *aside* list of
queues, then acks them. When the key is no longer stopped, that worker drains the aside
queues head first, and only once the last is empty and deleted are the key's events in its
own queue applied directly again. A redrive puts the key's dead letters in a queue of its own
at the head of that list, so they are applied before everything that waited behind them.

Only the holder of the key's queue starts or drops from the list, under its fenced lease,
so moving and draining never race; a redrive only puts a queue at the head.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import orjson
import redis

from keyq.broker.clock import now_ms
from keyq.broker.errors import KeysStopped
from keyq.broker.locks import Lease
from keyq.broker.naming import base_queue_name, key_queue_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.routes import Route
from keyq.broker.text import as_text

# KEYS = aside hash, lock key, queue keys, routes; ARGV = key, lease value, queue, the leased
# queue if it is the key's own (else ''). Sets the key's aside list to [queue] when it is
# empty; returns the list (JSON) as it is after, false if the lease is not current, or
# 'routed' when the leased queue is a bucket whose key was promoted meanwhile (auto mode: only
# its own queue's holder may start its list now). The key's own queue is recorded as the key's,
# so that no janitor retires it while events wait aside, whatever registered it
# (``broker.retirement``).
_SET_ASIDE_TAIL = """
if redis.call('GET', KEYS[2]) ~= ARGV[2] then
  return false
end
if ARGV[4] == '' and redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1 then
  return 'routed'
end
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[3], ARGV[4], ARGV[1])
end
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw then
  local queues = cjson.decode(raw)
  if #queues > 0 then
    return raw
  end
end
local fresh = cjson.encode({ARGV[3]})
redis.call('HSET', KEYS[1], ARGV[1], fresh)
return fresh
"""

# KEYS = aside hash, lock key; ARGV = key, lease value, queue. Drops ``queue`` from the key's
# list (the head it was when drained, unless a redrive put another ahead since). Returns the
# list after (JSON, "[]" when empty), false if the lease is not current.
_DROP_ASIDE = """
if redis.call('GET', KEYS[2]) ~= ARGV[2] then
  return false
end
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then
  return '[]'
end
local queues = cjson.decode(raw)
for i = #queues, 1, -1 do
  if queues[i] == ARGV[3] then
    table.remove(queues, i)
  end
end
if #queues == 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return '[]'
end
local after = cjson.encode(queues)
redis.call('HSET', KEYS[1], ARGV[1], after)
return after
"""

# KEYS = aside hash, parked hash; ARGV = key, queue. Puts ``queue`` at the head of the key's
# list (once) and unparks the key, in one step: the redrive's point of no return.
_PUT_AHEAD_AND_UNPARK = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
local queues = {}
if raw then
  queues = cjson.decode(raw)
end
for _, name in ipairs(queues) do
  if name == ARGV[2] then
    redis.call('HDEL', KEYS[2], ARGV[1])
    return 0
  end
end
table.insert(queues, 1, ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(queues))
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""


@dataclass(frozen=True)
class ParkedKey:
    """Where a key stopped: the poison event it was parked at."""

    at_ms: int
    reason: str
    producer: str | None
    seq: int | None

    def to_json(self) -> str:
        return orjson.dumps(
            {"at": self.at_ms, "reason": self.reason, "producer": self.producer, "seq": self.seq}
        ).decode()

    @classmethod
    def from_json(cls, raw: str | bytes) -> ParkedKey:
        data = orjson.loads(raw)
        seq = data.get("seq")
        return cls(
            at_ms=int(data.get("at", 0)),
            reason=str(data.get("reason", "")),
            producer=data.get("producer"),
            seq=None if seq is None else int(seq),
        )


@dataclass(frozen=True)
class KeyStatus:
    """What holds one key back, as the worker holding its queue must honour it."""

    paused_since_ms: int | None = None
    parked: ParkedKey | None = None
    aside: tuple[str, ...] = ()
    route: Route | None = None  # auto mode: the key's queue of its own (``broker.routes``)

    @property
    def stopped(self) -> bool:
        """Nothing of the key may be applied."""
        return self.paused_since_ms is not None or self.parked is not None

    @property
    def diverted(self) -> bool:
        """The key's events in its own queue must go aside (to the tail) rather than apply."""
        return self.stopped or bool(self.aside)


FLOWING = KeyStatus()


class KeyControl:
    """The paused, parked and aside state of one stream's keys."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self._client = client
        self._keys = StreamKeys(stream)
        self._set_tail = client.register_script(_SET_ASIDE_TAIL)
        self._drop = client.register_script(_DROP_ASIDE)
        self._put_ahead = client.register_script(_PUT_AHEAD_AND_UNPARK)

    # ---- pause ----------------------------------------------------------------------------

    def pause(self, keys: Iterable[str]) -> list[str]:
        """Pause ``keys``; returns those that were not paused already."""
        names = list(dict.fromkeys(keys))
        if not names:
            return []
        stamp = now_ms()
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.hsetnx(self._keys.paused_keys, name, stamp)
        added = pipe.execute()
        return [name for name, new in zip(names, added, strict=True) if new]

    def resume(self, keys: Iterable[str]) -> list[str]:
        """Resume ``keys``; returns those that were paused."""
        names = list(dict.fromkeys(keys))
        if not names:
            return []
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.hdel(self._keys.paused_keys, name)
        removed = pipe.execute()
        return [name for name, gone in zip(names, removed, strict=True) if gone]

    def paused(self) -> dict[str, int]:
        """Paused key -> since when (ms since epoch)."""
        raw = self._client.hgetall(self._keys.paused_keys)
        return {as_text(k): int(v) for k, v in raw.items()}

    # ---- park -----------------------------------------------------------------------------

    def park(self, key: str, where: ParkedKey) -> bool:
        """Park ``key`` at a poison event; the first park stands until it is lifted."""
        return bool(self._client.hsetnx(self._keys.parked_keys, key, where.to_json()))

    def unpark(self, key: str) -> bool:
        return bool(self._client.hdel(self._keys.parked_keys, key))

    def parked(self) -> dict[str, ParkedKey]:
        raw = self._client.hgetall(self._keys.parked_keys)
        return {as_text(k): ParkedKey.from_json(v) for k, v in raw.items()}

    # ---- what holds keys back -------------------------------------------------------------

    def statuses(self, keys: Iterable[str]) -> dict[str, KeyStatus]:
        """The status of each of ``keys`` that is not flowing freely (one round trip)."""
        names = list(dict.fromkeys(keys))
        if not names:
            return {}
        pipe = self._client.pipeline(transaction=False)
        pipe.hmget(self._keys.paused_keys, names)
        pipe.hmget(self._keys.parked_keys, names)
        pipe.hmget(self._keys.aside, names)
        pipe.hmget(self._keys.routes, names)
        paused, parked, aside, routes = pipe.execute()
        found: dict[str, KeyStatus] = {}
        rows = zip(names, paused, parked, aside, routes, strict=True)
        for name, since, where, queues, route in rows:
            if since is None and where is None and queues is None and route is None:
                continue
            found[name] = KeyStatus(
                paused_since_ms=None if since is None else int(since),
                parked=None if where is None else ParkedKey.from_json(where),
                aside=tuple(orjson.loads(queues)) if queues is not None else (),
                route=None if route is None else Route.from_json(route),
            )
        return found

    def status(self, key: str) -> KeyStatus:
        return self.statuses([key]).get(key, FLOWING)

    def keys_aside(self) -> dict[str, list[str]]:
        """Every key with queues aside -> those queues, head first."""
        raw = self._client.hgetall(self._keys.aside)
        return {as_text(k): list(orjson.loads(v)) for k, v in raw.items()}

    # ---- the aside list: changed by the holder of the key's queue, or put ahead by a redrive

    def set_aside_tail(self, key: str, lease: Lease, queue: str) -> list[str] | None:
        """The key's aside list, starting it with ``queue`` if it is empty; None if ``lease``
        (of the queue the key's events come from) is no longer current. Raises ``KeysStopped``
        when that queue is a bucket whose key was promoted since the batch read its status (the
        batch runs again and forwards them)."""
        stream = self._keys.stream
        own = base_queue_name(lease.queue) in {
            key_queue_name(stream, key, incarnations=quorum) for quorum in (False, True)
        }
        raw = self._set_tail(
            keys=[
                self._keys.aside,
                self._keys.lock(lease.queue),
                self._keys.queue_keys,
                self._keys.routes,
            ],
            args=[key, lease.value, queue, lease.queue if own else ""],
        )
        if raw is None:
            return None
        if as_text(raw) == "routed":
            raise KeysStopped(f"key {key!r} was promoted while its batch ran")
        return list(orjson.loads(raw))

    def drop_aside(self, key: str, lease: Lease, queue: str) -> list[str] | None:
        """Drop ``queue`` (drained and deleted) from the key's list; returns what is left, or
        None if ``lease`` is no longer current."""
        raw = self._drop(
            keys=[self._keys.aside, self._keys.lock(lease.queue)],
            args=[key, lease.value, queue],
        )
        return None if raw is None else list(orjson.loads(raw))

    def put_ahead_and_unpark(self, key: str, queue: str) -> bool:
        """Put ``queue`` at the head of the key's list and unpark the key, in one step; False
        if it was there already (a redrive run again)."""
        keys = [self._keys.aside, self._keys.parked_keys]
        return bool(self._put_ahead(keys=keys, args=[key, queue]))
