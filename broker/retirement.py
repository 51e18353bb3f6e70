"""The retirement fence: how a queue is deleted without losing an event routed to it.

RabbitMQ confirms a message routed to a queue that is deleted before the message reaches it
(rabbitmq-server#4746), so ``queue.delete(if_empty)`` alone can lose confirmed events. Deleters
therefore first *mark* the queue as retiring in Redis and wait a grace period; producers only
publish to a queue while they hold a *lease* on it: a check, at most ``publish_lease_ms`` old,
that no mark existed (the same script touches the queue's activity). A producer that sees a
mark holds that queue's events until the mark is gone, then declares the queue again. Since the
grace period is longer than the lease, by the time the deleter deletes, no producer can still
be publishing on a lease taken before the mark.

In auto mode a producer publishes a promoted key's events straight to its own queue
(``broker.routes``); such a lease is also refused once the key's route is gone, so a producer
that read the route before a demotion sends nothing there after it: the janitor demotes a key
before it lifts its own queue's mark.

Marks and leases are per *base* queue name. A lease also names the queue's current
incarnation (``naming.incarnation_name``): a deleter that deleted a quorum queue moves it to
the next one before lifting its mark, so a producer declares it again under a name never used.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import redis

from keyq.broker.clock import now_ms
from keyq.broker.naming import INCARNATION_MARK, base_queue_name, incarnation_of
from keyq.broker.redis_keys import StreamKeys

# A lease's answer for a promoted key's own queue whose key has no route any more.
UNROUTED = -2

# A queue published to after this long without activity is noted as woken (see
# ``StreamKeys.woken``); while a producer publishes, its leases touch the queue more often.
WOKEN_AFTER_QUIET_MS = 5000

# KEYS[1] = registry, KEYS[2] = incarnations, KEYS[3] = woken, KEYS[4] = routes, KEYS[5..] =
# retirement marks; ARGV[1] = now, ARGV[2] = quiet ms, ARGV[3] = announcements channel, then
# the n base queue names, then n routed keys ('' for a queue that needs no route). Each result:
# -1 (marked), -2 (its key has no route now) or the incarnation. A registered queue whose
# activity is older than the quiet time is noted as woken: it may have no worker, and now it
# has events.
# Woken queues are also announced, one message a call, so that workers waiting for their
# next tick claim them at once; the sorted set stays the record a worker reads every tick.
_LEASE = """
local granted = {}
local woken = {}
local now = tonumber(ARGV[1])
local n = #KEYS - 4
for i = 1, n do
  local base = ARGV[3 + i]
  local routed = ARGV[3 + n + i]
  if redis.call('EXISTS', KEYS[4 + i]) == 1 then
    granted[i] = -1
  elseif routed ~= '' and redis.call('HEXISTS', KEYS[4], routed) == 0 then
    granted[i] = -2
  else
    local incarnation = tonumber(redis.call('HGET', KEYS[2], base)) or 0
    local name = base
    if incarnation > 0 then name = base .. 'INCARNATION_MARK' .. incarnation end
    local before = redis.call('ZSCORE', KEYS[1], name)
    redis.call('ZADD', KEYS[1], 'XX', 'GT', now, name)
    if before and tonumber(before) < now - tonumber(ARGV[2]) then
      redis.call('ZADD', KEYS[3], now, name)
      woken[#woken + 1] = name
    end
    granted[i] = incarnation
  end
end
if #woken > 0 then
  redis.call('PUBLISH', ARGV[3], table.concat(woken, '\\n'))
end
return granted
""".replace("INCARNATION_MARK", INCARNATION_MARK)

# KEYS[1] = incarnations; ARGV = base, next incarnation, base, next incarnation...
_ADVANCE = """
for i = 1, #ARGV, 2 do
  local current = tonumber(redis.call('HGET', KEYS[1], ARGV[i])) or 0
  if tonumber(ARGV[i + 1]) > current then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
return 1
"""


# A key-mode queue whose key has queues aside (``broker.key_control``) is never retired: only
# the holder of the key's own queue drains what waits aside, so deleting that queue would leave
# the key's events with no path to a worker (and nothing re-declares a quiet key's queue). The
# check is made in the same script that marks, so no aside list can start between the two; and
# again right before each delete, with the mark renewed.
_HAS_ASIDE = """
local function has_aside(queue)
  local key = redis.call('HGET', KEYS[1], queue)
  return key and redis.call('HEXISTS', KEYS[2], key) == 1
end
"""

# KEYS[1] = queue keys, KEYS[2] = aside, KEYS[3..] = retirement marks; ARGV[1] = owner,
# ARGV[2] = ttl ms, ARGV[3..] = the queues. Each result: 1 marked, 0 marked by someone else
# already, 2 refused (its key has queues aside).
_MARK = (
    _HAS_ASIDE
    + """
local result = {}
for i = 3, #KEYS do
  if has_aside(ARGV[i]) then
    result[i - 2] = 2
  elseif redis.call('SET', KEYS[i], ARGV[1], 'NX', 'PX', ARGV[2]) then
    result[i - 2] = 1
  else
    result[i - 2] = 0
  end
end
return result
"""
)

# KEYS[1] = queue keys, KEYS[2] = aside, KEYS[3..] = retirement marks; ARGV[1] = owner,
# ARGV[2] = ttl ms, ARGV[3..] = the queues. Each result: 1 if the mark is still the owner's
# (its ttl renewed), 0 if it lapsed (expired, or someone else's now), 2 if the queue's key has
# queues aside now (a worker set events aside during the grace).
_STILL_MARKED = (
    _HAS_ASIDE
    + """
local held = {}
for i = 3, #KEYS do
  if redis.call('GET', KEYS[i]) ~= ARGV[1] then
    held[i - 2] = 0
  elseif has_aside(ARGV[i]) then
    held[i - 2] = 2
  else
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
    held[i - 2] = 1
  end
end
return held
"""
)


class Mark(enum.Enum):
    """What marking one queue as retiring came to."""

    MARKED = 1
    TAKEN = 0  # another deleter's mark is on it
    ASIDE = 2  # refused: its key has events waiting aside


class RetirementFence:
    """Retirement marks of one stream's queues."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self._client = client
        self._keys = StreamKeys(stream)
        self._lease = client.register_script(_LEASE)
        self._advance = client.register_script(_ADVANCE)
        self._mark = client.register_script(_MARK)
        self._still_marked = client.register_script(_STILL_MARKED)

    def lease(
        self, queues: Sequence[str], routed: Mapping[str, str] | None = None
    ) -> dict[str, int | None]:
        """For a producer: each base queue's current incarnation if it may be published to
        (no mark), touching that incarnation's activity; None if it is being retired.
        ``routed`` names, for a promoted key's own queue, the key whose route must still
        exist: ``UNROUTED`` if it is gone (the key's events go to its bucket again)."""
        if not queues:
            return {}
        routed = routed or {}
        granted = self._lease(
            keys=[
                self._keys.registry,
                self._keys.incarnations,
                self._keys.woken,
                self._keys.routes,
                *(self._keys.retiring(queue) for queue in queues),
            ],
            args=[
                now_ms(),
                WOKEN_AFTER_QUIET_MS,
                self._keys.announcements,
                *queues,
                *(routed.get(queue, "") for queue in queues),
            ],
        )
        return {
            queue: None if int(flag) == -1 else int(flag)
            for queue, flag in zip(queues, granted, strict=True)
        }

    def mark(self, queues: Sequence[str], owner: str, ttl_ms: int) -> dict[str, Mark]:
        """For a deleter: mark queues (any incarnation) as retiring, unless marked already or
        their key has events aside (``Mark.ASIDE``: the queue must stay). The ttl bounds how
        long producers wait if the deleter dies before ``unmark``."""
        if not queues:
            return {}
        flags = self._mark(keys=self._checked_keys(queues), args=[owner, ttl_ms, *queues])
        return {queue: Mark(int(flag)) for queue, flag in zip(queues, flags, strict=True)}

    def still_marked(self, queues: Sequence[str], owner: str, ttl_ms: int) -> dict[str, Mark]:
        """For a deleter, right before deleting: ``Mark.MARKED`` for the queues whose marks are
        still its own (their ttl renewed). A mark that lapsed while the deleter was slow (the
        marks of a pass's later chunks, on an overloaded broker) let producers publish again,
        so its queue must not be deleted now: an event on its way into a queue that is deleted
        is confirmed and lost (rabbitmq-server#4746). ``Mark.ASIDE``: the queue's key has had
        events set aside since it was marked, and the queue must stay."""
        if not queues:
            return {}
        flags = self._still_marked(keys=self._checked_keys(queues), args=[owner, ttl_ms, *queues])
        return {queue: Mark(int(flag)) for queue, flag in zip(queues, flags, strict=True)}

    def advance_incarnations(self, deleted: Sequence[str]) -> None:
        """For a deleter, while it still holds the marks: the next producer declares each of
        these deleted queues under the incarnation after it, never under its name again."""
        if deleted:
            args: list[str | int] = []
            for queue in deleted:
                args += [base_queue_name(queue), incarnation_of(queue) + 1]
            self._advance(keys=[self._keys.incarnations], args=args)

    def unmark(self, queues: Sequence[str]) -> None:
        if queues:
            self._client.delete(*(self._retiring(queue) for queue in queues))

    def marked(self, queues: Sequence[str]) -> list[str]:
        if not queues:
            return []
        values = self._client.mget([self._retiring(queue) for queue in queues])
        return [queue for queue, value in zip(queues, values, strict=True) if value is not None]

    def _checked_keys(self, queues: Sequence[str]) -> list[str]:
        return [self._keys.queue_keys, self._keys.aside, *map(self._retiring, queues)]

    def _retiring(self, queue: str) -> str:
        return self._keys.retiring(base_queue_name(queue))
