"""Spotting dead peers: a worker whose Redis connections are all gone (a killed process) has
its locks released and its membership ended, so its queues move without waiting for the lock
ttl."""

from __future__ import annotations

import logging
from collections.abc import Collection

import redis
import redis.exceptions

from keyq.broker.connections import FAILING_OVER
from keyq.broker.locks import FencedLocks, Lease
from keyq.broker.membership import Membership
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.redis_topology import node_client

log = logging.getLogger("keyq.worker.holding.claims")

CLIENT_NAME_PREFIX = "keyq-w:"


def client_name(worker_id: str) -> str:
    """The Redis client name a worker's connections carry, by which peers see it alive."""
    return CLIENT_NAME_PREFIX + worker_id


class PeerReaper:
    """Used by the claim loop's thread only."""

    def __init__(
        self,
        *,
        client: redis.Redis,
        keys: StreamKeys,
        locks: FencedLocks,
        membership: Membership,
        worker_id: str,
    ) -> None:
        self._client = client
        self._keys = keys
        self._locks = locks
        self._membership = membership
        self._worker_id = worker_id
        self._missing_once: set[str] = set()
        self._client_list_ok = True
        self.reaped = 0

    def reap(self, queues: Collection[str]) -> bool:
        """Release the locks among ``queues`` of members whose Redis connections are all gone:
        only after two looks in a row, so a reconnecting peer is not reaped. True if any was."""
        if not self._client_list_ok:
            return False
        try:
            # The server holding the stream's keys: every live worker has a connection there.
            server = node_client(self._client, self._keys.members)
            names = {str(c.get("name", "")) for c in server.client_list()}
        except FAILING_OVER:
            return False  # the stream's primary is failing over: look again next tick
        except redis.exceptions.ResponseError:
            self._client_list_ok = False  # no CLIENT permission: fall back to lock ttls
            log.info("CLIENT LIST not permitted; dead workers are detected by ttl only")
            return False
        missing = {
            m
            for m in self._membership.alive()
            if m != self._worker_id and client_name(m) not in names
        }
        confirmed = missing & self._missing_once
        self._missing_once = missing
        if not confirmed:
            return False
        listed = list(queues)
        holders = self._locks.holders(listed) if listed else {}
        for dead in confirmed:
            leases: list[Lease] = [
                lease for lease in holders.values() if lease is not None and lease.owner == dead
            ]
            released = self._locks.release(leases)
            self._membership.leave(dead)
            self.reaped += 1
            log.warning("worker %s is gone: released its %d locks", dead, released)
        return True
