"""One janitor leads each stream: a Redis lease, taken with SET NX PX and renewed by its owner.

Two janitors deleting the same queues would not lose events (the deletes are conditional),
but they would double the broker's work and each other's refusals; the others stand by and
take over within a lease ttl if the leader dies.
"""

from __future__ import annotations

import redis

from keyq.broker.redis_keys import StreamKeys

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0
"""

_RESIGN = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Leadership:
    """The janitor lease of one stream."""

    def __init__(self, client: redis.Redis, stream: str, owner: str, ttl_ms: int) -> None:
        self._key = StreamKeys(stream).janitor_lease
        self._owner = owner
        self._ttl_ms = ttl_ms
        self._renew = client.register_script(_RENEW)
        self._resign = client.register_script(_RESIGN)

    def hold(self) -> bool:
        """Take or keep the lease; True while this janitor leads the stream."""
        return bool(self._renew(keys=[self._key], args=[self._owner, self._ttl_ms]))

    def resign(self) -> None:
        self._resign(keys=[self._key], args=[self._owner])
