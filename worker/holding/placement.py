"""How many queues make a worker's fair share, and, in auto mode, where a promoted key's own
queue is held.

A key is promoted so that its bucket-mates stop waiting behind it. If the worker holding its
bucket also holds its own queue, that worker's batches still carry the key's events beside the
bucket's (and, until producers switch, the forwards too), so the neighbours keep waiting. The
bucket's holder therefore leaves a free own queue to a peer for ``SPREAD_WAIT_S`` and takes it
only if no peer has; nothing already held is moved, so the rule causes no churn.

For a peer to have room, a worker's share in auto mode is its even split of the buckets plus
the own queues divided among the members, rounded up: the shares add up to at least every
queue, whichever worker holds which bucket.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

import redis

from keyq.broker.membership import fair_share
from keyq.broker.naming import Mode, base_queue_name, is_bucket_queue
from keyq.broker.routes import RouteBook

# How long the holder of a promoted key's bucket leaves the key's free own queue to a peer.
SPREAD_WAIT_S = 2.0
# The routes are re-read at most this often (and only after a promotion or a demotion).
REREAD_S = 0.2


def auto_share(stream: str, active: Iterable[str], members: list[str], worker_id: str) -> int:
    """How many queues ``worker_id`` may hold in an auto-mode stream."""
    queues = list(active)
    buckets = sum(1 for queue in queues if is_bucket_queue(stream, queue))
    own = len(queues) - buckets
    return fair_share(buckets, members, worker_id) + math.ceil(own / max(1, len(members)))


class Placement:
    """A worker's share, and which free own queues it leaves to its peers for now (the claim
    loop's thread)."""

    def __init__(
        self, client: redis.Redis, stream: str, mode: Mode, worker_id: str, max_held: int | None
    ) -> None:
        self._stream = stream
        self._max_held = max_held
        self._auto = mode is Mode.AUTO
        self._worker_id = worker_id
        self._book = RouteBook(client, stream)
        self._version: tuple[int, int] | None = None
        self._read_at = 0.0
        self._bucket_of: dict[str, str] = {}  # own queue (base name) -> its key's bucket
        self._free_since: dict[str, float] = {}

    def share(self, active: Collection[str], members: list[str], channels: int) -> int:
        """How many of the ``active`` queues this worker may hold: its share, within its
        setting (``max_held_queues``) and what its connection's ``channels`` allow."""
        if self._auto:
            share = auto_share(self._stream, active, members, self._worker_id)
        else:
            share = fair_share(len(active), members, self._worker_id)
        return min(share, channels, channels if self._max_held is None else self._max_held)

    def left_to_peers(
        self, free: Collection[str], held: Collection[str], members: int, now: float
    ) -> set[str]:
        """Of the ``free`` queues, the own queues whose key's bucket this worker holds and
        that have been free for less than ``SPREAD_WAIT_S``: a peer may take them."""
        own = [queue for queue in free if not is_bucket_queue(self._stream, queue)]
        if not self._auto or members < 2 or not own:
            self._free_since.clear()
            return set()
        if any(base_queue_name(queue) not in self._bucket_of for queue in own):
            self._reread(now)
        held_buckets = {base_queue_name(queue) for queue in held}
        self._free_since = {queue: self._free_since.get(queue, now) for queue in own}
        return {
            queue
            for queue in own
            if self._bucket_of.get(base_queue_name(queue)) in held_buckets
            and now - self._free_since[queue] < SPREAD_WAIT_S
        }

    def _reread(self, now: float) -> None:
        if now - self._read_at < REREAD_S:
            return
        self._read_at = now
        version = self._book.version()
        if version != self._version:
            self._bucket_of = {r.queue: r.bucket for r in self._book.promoted().values()}
            self._version = version
