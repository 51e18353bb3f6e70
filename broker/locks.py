"""Fenced queue locks in Redis.

A worker owns a queue while its lock ``owner|token`` lives. The token comes from one counter
per stream that only grows, so a worker that was paused past its ttl holds a stale token: its
renewals fail and, above all, its commits are refused by ``commit`` (check-every-token-then-
write in one script), so it can never overwrite the work of the queue's newer owner.

The counter is the stream's, not the queue's: the janitor deletes idle queues and forgets them
in Redis, and a per-queue counter forgotten with its queue started again at 1, so a worker
could be issued ``owner|1`` for a queue twice, and a batch of its first holding would then
pass the fence of its second.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis

from keyq.broker.errors import CommitNotReplicated, KeysStopped
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.redis_topology import node_client

_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return false
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
return token
"""

# Many locks in one script: KEYS = the token counter, then one lock key per queue; ARGV =
# owner, ttl. Returns a token per queue, 0 where someone else holds it.
_ACQUIRE_MANY = """
local tokens = {}
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    tokens[i - 1] = 0
  else
    local token = redis.call('INCR', KEYS[1])
    redis.call('SET', KEYS[i], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
    tokens[i - 1] = token
  end
end
return tokens
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

# The fenced commit. KEYS = n lock keys, then the hashes to write. ARGV = n, the n expected
# lock values, then per hash: a field count and its field/value pairs. Writes nothing unless
# every lock still holds its expected value; returns the 1-based indexes of those that do not.
# Then n_guards, and per guard a field whose hash is the next key after the locks: if any of
# those fields exists (a key an operator paused while the batch ran), nothing is written and
# the answer is {0}. Per hash to write: a ttl in ms (0: none), a field count, the pairs.
_COMMIT = """
local n_locks = tonumber(ARGV[1])
local lost = {}
for i = 1, n_locks do
  if redis.call('GET', KEYS[i]) ~= ARGV[1 + i] then
    lost[#lost + 1] = i
  end
end
if #lost > 0 then
  return lost
end
local n_guards = tonumber(ARGV[2 + n_locks])
for g = 1, n_guards do
  if redis.call('HEXISTS', KEYS[n_locks + g], ARGV[2 + n_locks + g]) == 1 then
    return {0}
  end
end
local at = 3 + n_locks + n_guards
for h = n_locks + n_guards + 1, #KEYS do
  local ttl = tonumber(ARGV[at])
  local n_fields = tonumber(ARGV[at + 1])
  at = at + 2
  for j = 0, n_fields - 1 do
    redis.call('HSET', KEYS[h], ARGV[at + 2 * j], ARGV[at + 2 * j + 1])
  end
  if ttl > 0 and n_fields > 0 then
    redis.call('PEXPIRE', KEYS[h], ttl)
  end
  at = at + 2 * n_fields
end
return lost
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


def _check_guards(answer: Sequence[int]) -> None:
    if list(answer) == [0]:
        raise KeysStopped("a key of the batch was paused while it ran: nothing was written")


def _parse_lease(queue: str, value: str) -> Lease:
    owner, _, token = value.rpartition("|")
    return Lease(queue=queue, owner=owner, token=int(token))


class FencedLocks:
    """Locks over one stream's queues, each with a monotonically increasing fencing token."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self._client = client
        self._keys = StreamKeys(stream)
        self._acquire = client.register_script(_ACQUIRE)
        self._acquire_many = client.register_script(_ACQUIRE_MANY)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._commit = client.register_script(_COMMIT)

    def acquire(self, queue: str, owner: str, ttl_ms: int) -> Lease | None:
        """Take the queue's lock if nobody holds it; None if someone does."""
        if "|" in owner:
            raise ValueError("lock owner ids must not contain '|'")
        token = self._acquire(
            keys=[self._keys.lock(queue), self._keys.fence_tokens], args=[owner, ttl_ms]
        )
        return None if token is None else Lease(queue=queue, owner=owner, token=int(token))

    def acquire_many(self, queues: Sequence[str], owner: str, ttl_ms: int) -> list[Lease]:
        """Take every lock of ``queues`` that nobody holds, in one round trip (a claim
        round of hundreds of queues costs one script, not one call each)."""
        if "|" in owner:
            raise ValueError("lock owner ids must not contain '|'")
        if not queues:
            return []
        tokens = self._acquire_many(
            keys=[self._keys.fence_tokens, *(self._keys.lock(queue) for queue in queues)],
            args=[owner, ttl_ms],
        )
        return [
            Lease(queue=queue, owner=owner, token=int(token))
            for queue, token in zip(queues, tokens, strict=True)
            if int(token) > 0
        ]

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
        self,
        leases: Sequence[Lease],
        writes: Mapping[str, Mapping[str, str]],
        *,
        replicas: int = 0,
        replica_timeout_ms: int = 1000,
        guards: Sequence[tuple[str, str]] = (),
        expiries: Mapping[str, int] | None = None,
    ) -> frozenset[str]:
        """Write hash fields (hash key -> field -> value) only if every lease is current,
        and no field of ``guards`` (hash key, field) exists, else raise ``KeysStopped``. A
        hash in ``expiries`` (hash key -> ms) expires that long after this write.

        The one fenced commit of keyq: checks and writes happen in one script, so no other
        owner can slip in between, and a batch is committed whole or not at all. Returns the
        queues whose lease is no longer current (then nothing was written). Every key must
        share the stream's hash tag, as ``StreamKeys`` does, for Redis Cluster.

        With ``replicas``, the commit is followed by ``WAIT`` on the same connection (Redis
        replicates asynchronously: a primary that fails right after a commit can take it
        with it) and raises ``CommitNotReplicated`` when fewer replicas confirm it in time.
        The commit bumps a counter too, so a commit that writes nothing new (a batch run
        again) still proves that everything before it reached the replicas.
        """
        args: list[str | int] = [len(leases), *(lease.value for lease in leases), len(guards)]
        keys = [self._keys.lock(lease.queue) for lease in leases]
        for hash_key, field in guards:
            keys.append(hash_key)
            args.append(field)
        for target, fields in writes.items():
            keys.append(target)
            args.append((expiries or {}).get(target, 0))
            args.append(len(fields))
            for field, value in fields.items():
                args.extend((field, value))
        if replicas <= 0:
            lost = self._commit(keys=keys, args=args)
            _check_guards(lost)
            return frozenset(leases[int(index) - 1].queue for index in lost)
        pipe = node_client(self._client, self._keys.commits).pipeline(transaction=False)
        self._commit(keys=keys, args=args, client=pipe)
        pipe.incr(self._keys.commits)
        pipe.execute_command("WAIT", replicas, replica_timeout_ms)  # type: ignore[no-untyped-call]
        lost, _, confirmed = pipe.execute()
        _check_guards(lost)
        refused = frozenset(leases[int(index) - 1].queue for index in lost)
        if not refused and int(confirmed) < replicas:
            raise CommitNotReplicated(
                f"a commit reached {confirmed} of the {replicas} Redis replicas required "
                f"within {replica_timeout_ms} ms: its events are not acked yet"
            )
        return refused
