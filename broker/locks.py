"""Fenced queue locks in Redis.

A worker owns a queue while its lock ``owner|token`` lives. The token comes from a per-queue
counter that only grows, so a worker that was paused past its ttl holds a stale token: its
renewals fail and, above all, its commits are refused by ``commit`` (check-token-and-write in
one script), so it can never overwrite the work of the queue's newer owner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis
from keyq.broker.redis_keys import StreamKeys

_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return false
end
local token = redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
redis.call('SET', KEYS[1], ARGV[2] .. '|' .. token, 'PX', ARGV[3])
return token
"""

_RENEW = """
local alive = {}
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[i + 1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[1])
    alive[i] = 1
  else
    alive[i] = 0
  end
end
return alive
"""

_RELEASE = """
local released = 0
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[i] then
    redis.call('DEL', KEYS[i])
    released = released + 1
  end
end
return released
"""

# KEYS[1] = target hash, KEYS[2..] = lock keys; ARGV = per lock: expected value, n, n pairs.
_COMMIT = """
local ok = {}
local at = 1
for i = 2, #KEYS do
  local expected = ARGV[at]
  local n = tonumber(ARGV[at + 1])
  at = at + 2
  if redis.call('GET', KEYS[i]) == expected then
    for j = 0, n - 1 do
      redis.call('HSET', KEYS[1], ARGV[at + 2 * j], ARGV[at + 2 * j + 1])
    end
    ok[i - 1] = 1
  else
    ok[i - 1] = 0
  end
  at = at + 2 * n
end
return ok
"""


@dataclass(frozen=True)
class Lease:
    """Proof of holding a queue: the owner and the fencing token issued to it."""

    queue: str
    owner: str
    token: int

    @property
    def value(self) -> str:
        return f"{self.owner}|{self.token}"


def _parse_lease(queue: str, value: str) -> Lease:
    owner, _, token = value.rpartition("|")
    return Lease(queue=queue, owner=owner, token=int(token))


class FencedLocks:
    """Locks over one stream's queues, each with a monotonically increasing fencing token."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self._client = client
        self._keys = StreamKeys(stream)
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._commit = client.register_script(_COMMIT)

    def acquire(self, queue: str, owner: str, ttl_ms: int) -> Lease | None:
        """Take the queue's lock if nobody holds it; None if someone does."""
        if "|" in owner:
            raise ValueError("lock owner ids must not contain '|'")
        token = self._acquire(
            keys=[self._keys.lock(queue), self._keys.fences], args=[queue, owner, ttl_ms]
        )
        return None if token is None else Lease(queue=queue, owner=owner, token=int(token))

    def renew(self, leases: Sequence[Lease], ttl_ms: int) -> dict[str, bool]:
        """Extend every lease in one round trip; maps queue -> still held."""
        if not leases:
            return {}
        alive = self._renew(
            keys=[self._keys.lock(lease.queue) for lease in leases],
            args=[ttl_ms, *(lease.value for lease in leases)],
        )
        return {lease.queue: bool(flag) for lease, flag in zip(leases, alive, strict=True)}

    def release(self, leases: Sequence[Lease]) -> int:
        """Drop the leases that are still ours (never someone else's); returns how many."""
        if not leases:
            return 0
        released = self._release(
            keys=[self._keys.lock(lease.queue) for lease in leases],
            args=[lease.value for lease in leases],
        )
        return int(released)

    def holder(self, queue: str) -> Lease | None:
        """Who holds ``queue`` now, if anyone."""
        return self.holders([queue])[queue]

    def holders(self, queues: Sequence[str]) -> dict[str, Lease | None]:
        """Holders of many queues in one round trip."""
        if not queues:
            return {}
        raws = self._client.mget([self._keys.lock(queue) for queue in queues])
        return {
            queue: None if raw is None else _parse_lease(queue, str(raw))
            for queue, raw in zip(queues, raws, strict=True)
        }

    def commit(
        self, target_hash: str, writes: Mapping[Lease, Mapping[str, str]]
    ) -> dict[str, bool]:
        """Write hash fields for each lease only if that lease is still current.

        All checks and writes happen in one script, so no other owner can slip in between
        the check and the write. Returns queue -> committed.
        """
        if not writes:
            return {}
        leases = list(writes)
        args: list[str | int] = []
        for lease in leases:
            fields = writes[lease]
            args.extend((lease.value, len(fields)))
            for field, value in fields.items():
                args.extend((field, value))
        done = self._commit(
            keys=[target_hash, *(self._keys.lock(lease.queue) for lease in leases)], args=args
        )
        return {lease.queue: bool(flag) for lease, flag in zip(leases, done, strict=True)}
