"""Auto mode's side of reclaiming (``keyq.broker.routes``): which own queues may be retired,
and the demotion of a promoted key once its own queue is gone.

Auto-mode streams lose their keys' own queues as key mode does (never a bucket, never the
dead-letter queue), except one whose key's move is still open: its holder holds the key's
events until the bucket's holder closes the move. A promoted key whose own queue is gone is
demoted while the queue's mark still stands, so no forward can declare the queue again under
the route being dropped, and before the registry forgets the queue (a crash in between leaves
the entry: the next pass finds the queue gone and demotes then). For quorum queues the
incarnation has moved on already.
"""

from __future__ import annotations

import logging
from collections import Counter

import redis

from keyq.broker.naming import base_queue_name, dead_letter_queue_name, is_bucket_queue
from keyq.broker.registry import QueueRegistry
from keyq.broker.routes import RouteBook
from keyq.janitor.deleter import Outcome

log = logging.getLogger("keyq.janitor")


def never_retired(stream: str, queue: str) -> bool:
    """The dead-letter queue, and buckets (auto mode): every key of a bucket publishes to
    it, promoted or not, so it is never idle for good."""
    return queue == dead_letter_queue_name(stream) or is_bucket_queue(stream, queue)


class Demotions:
    """One pass's demotions over an auto-mode stream."""

    def __init__(self, client: redis.Redis, stream: str, stats: Counter[str]) -> None:
        self._book = RouteBook(client, stream)
        self._stream = stream
        self._stats = stats
        self._routed: dict[str, str] = {}  # own queue -> its promoted key, demoted once gone

    def retirable(self, registry: QueueRegistry, free: list[str]) -> list[str]:
        """The free own queues but those whose key's move is open, noting the key of each of
        the rest whose route names it. Read before marking; a key promoted later has its move
        open and refuses the demotion."""
        keys = {q: key for q, key in registry.original_keys(free).items() if key is not None}
        routes = self._book.routes(keys.values())
        moving: set[str] = set()
        for queue, key in keys.items():
            route = routes.get(key)
            if route is None:
                continue
            if route.open:
                moving.add(queue)
            elif route.queue == base_queue_name(queue):
                self._routed[queue] = key
        self._stats["skipped_moving"] += len(moving)
        return [queue for queue in free if queue not in moving]

    def demote(self, outcomes: dict[str, Outcome]) -> None:
        """Demote the keys of the own queues gone now."""
        for queue, outcome in outcomes.items():
            key = self._routed.get(queue)
            if key is None or outcome not in (Outcome.DELETED, Outcome.GONE):
                continue
            if self._book.demote(key, base_queue_name(queue)):
                self._stats["demoted"] += 1
                continue
            self._stats["demote_refused"] += 1
            log.warning(
                "stream %s: key %r stays promoted though its queue %s is gone (its events "
                "were set aside meanwhile, or its route changed); the next event forwarded to "
                "it declares the queue again",
                self._stream,
                key,
                queue,
            )
