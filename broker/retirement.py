"""The retirement fence: how a queue is deleted without losing an event routed to it.

RabbitMQ confirms a message routed to a queue that is deleted before the message reaches it
(rabbitmq-server#4746), so ``queue.delete(if_empty)`` alone can lose confirmed events. Deleters
therefore first *mark* the queue as retiring in Redis and wait a grace period; producers only
publish to a queue while they hold a *lease* on it: a check, at most ``publish_lease_ms`` old,
that no mark existed (the same script touches the queue's activity). A producer that sees a
mark holds that queue's events until the mark is gone, then declares the queue again. Since the
grace period is longer than the lease, by the time the deleter deletes, no producer can still
be publishing on a lease taken before the mark.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from keyq.broker.clock import now_ms
from keyq.broker.redis_keys import StreamKeys

# KEYS[1] = registry, KEYS[2..] = retirement marks; ARGV[1] = now, ARGV[2..] = queue names.
_LEASE = """
local granted = {}
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    granted[i - 1] = 0
  else
    redis.call('ZADD', KEYS[1], 'XX', 'GT', ARGV[1], ARGV[i])
    granted[i - 1] = 1
  end
end
return granted
"""


class RetirementFence:
    """Retirement marks of one stream's queues."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self._client = client
        self._keys = StreamKeys(stream)
        self._lease = client.register_script(_LEASE)

    def lease(self, queues: Sequence[str]) -> dict[str, bool]:
        """For a producer: which queues may be published to (no mark), touching those."""
        if not queues:
            return {}
        granted = self._lease(
            keys=[self._keys.registry, *(self._keys.retiring(queue) for queue in queues)],
            args=[now_ms(), *queues],
        )
        return {queue: bool(flag) for queue, flag in zip(queues, granted, strict=True)}

    def mark(self, queues: Sequence[str], owner: str, ttl_ms: int) -> list[str]:
        """For a deleter: mark queues as retiring; returns those it marked (not marked yet).

        The ttl bounds how long producers wait if the deleter dies before ``unmark``.
        """
        if not queues:
            return []
        pipe = self._client.pipeline(transaction=False)
        for queue in queues:
            pipe.set(self._keys.retiring(queue), owner, nx=True, px=ttl_ms)
        return [queue for queue, ok in zip(queues, pipe.execute(), strict=True) if ok]

    def unmark(self, queues: Sequence[str]) -> None:
        if queues:
            self._client.delete(*(self._keys.retiring(queue) for queue in queues))

    def marked(self, queues: Sequence[str]) -> list[str]:
        if not queues:
            return []
        values = self._client.mget([self._keys.retiring(queue) for queue in queues])
        return [queue for queue, value in zip(queues, values, strict=True) if value is not None]
