"""Closing auto mode's moves (``keyq.broker.routes``): the holder of a promoted key's bucket
closes the key's move between two of its batches, under its lease. Every batch of that bucket
that read the key's status before the promotion has then committed (batches run one at a time
on this thread), and every later one forwards the key's events, so from the close on the holder
of the key's own queue is its only applier.

``step`` runs on the batch loop's thread, between batches."""

from __future__ import annotations

import logging
import time

import redis

from keyq.broker.routes import RouteBook
from keyq.worker.holding.held_queues import HeldQueues

log = logging.getLogger("keyq.worker")

STEP_EVERY_S = 0.1


class RouteMoves:
    """Closes the open moves of the buckets one worker holds."""

    def __init__(self, client: redis.Redis, stream: str, every_s: float = STEP_EVERY_S) -> None:
        self._book = RouteBook(client, stream)
        self._every_s = every_s
        self._stepped_at = 0.0
        self.closed = 0

    def step(self, held: HeldQueues) -> None:
        """One round, at most every ``every_s``; Redis errors are the caller's."""
        now = time.monotonic()
        if now - self._stepped_at < self._every_s:
            return
        self._stepped_at = now
        moves = self._book.open_moves()
        mine = {key: held.get(bucket) for key, bucket in moves.items()}
        routes = self._book.routes([key for key, holding in mine.items() if holding is not None])
        for key, route in routes.items():
            holding = mine[key]
            if holding is None or not route.open:
                continue
            if self._book.close(key, route.epoch, holding.lease):
                self.closed += 1
                log.info("closed the move of key %r to %s (%d)", key, route.queue, route.epoch)
