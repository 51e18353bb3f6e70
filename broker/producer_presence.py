"""Which producer instances are still running: how a worker tells a sequence gap that will
fill from one that never will.

A producer takes seqs 1, 2, 3… per key and re-sends every event the broker refuses until it
is confirmed, so while it runs, a gap in a key's seqs fills. A producer that stopped between
taking a seq and its confirm (killed, or closed with events unconfirmed) leaves a gap for
good: what is not in the queue by then never comes. Each producer keeps a key with a ttl
while it runs and deletes it when it closes; a worker gives up a gone producer's gap once the
queue holds nothing more for it (``keyq.worker.holding.abandoned_gaps``), instead of waiting out the
gap timeout.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

from keyq.broker.redis_keys import StreamKeys


class ProducerPresence:
    """The live producer instances of one stream."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self._client = client
        self._keys = StreamKeys(stream)

    def announce(self, producer_id: str, ttl_ms: int) -> None:
        """``producer_id`` runs for another ``ttl_ms`` at least."""
        self._client.set(self._keys.producer(producer_id), b"1", px=ttl_ms)

    def withdraw(self, producer_id: str) -> None:
        """``producer_id`` has stopped: nothing it has not had confirmed will be sent."""
        self._client.delete(self._keys.producer(producer_id))

    def alive(self, producer_ids: Iterable[str]) -> set[str]:
        """Those of ``producer_ids`` still running (one round trip)."""
        ids = sorted(set(producer_ids))
        if not ids:
            return set()
        pipe = self._client.pipeline(transaction=False)
        for producer_id in ids:
            pipe.exists(self._keys.producer(producer_id))
        return {
            producer_id for producer_id, found in zip(ids, pipe.execute(), strict=True) if found
        }
