"""News of queues between claim rounds: announcements (a queue declared, or woken by a
producer after a quiet time) on Redis pub/sub, and the stream's sorted set of woken queues."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import cast

import redis
import redis.exceptions

from keyq.broker.clock import now_ms
from keyq.broker.redis_keys import StreamKeys

# Woken queues (``StreamKeys.woken``) are forgotten this long after they woke.
WOKEN_KEPT_MS = 60_000


class QueueNews:
    """Used by the claim loop's thread only. ``heard(queue, at_ms)`` records activity."""

    def __init__(self, client: redis.Redis, keys: StreamKeys, stop: threading.Event) -> None:
        self._client = client
        self._keys = keys
        self._stop = stop
        self._pubsub: redis.client.PubSub | None = None
        self._woken_seen: int | None = None  # None: read every queue woken so far
        self.announced = False  # an announcement came since the last claim round

    def close(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(Exception):  # closing at exit
                self._pubsub.close()

    def wait(self, seconds: float, earliest: float, heard: Callable[[str, int], None]) -> None:
        """Sleep until ``seconds`` from now, waking early for announcements, though not before
        ``earliest``: news that comes in a burst makes one claim round, not one per message."""
        deadline = time.monotonic() + seconds
        pubsub = self._subscription()
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if pubsub is None:
                self._stop.wait(left)
                return
            try:
                message = pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
            except (redis.exceptions.RedisError, OSError):
                self._pubsub = None  # subscribed again next time; until then, the tick
                self._stop.wait(max(0.0, deadline - time.monotonic()))
                return
            if message is not None and message.get("type") == "message":
                now = now_ms()
                for queue in str(message["data"]).split("\n"):  # a queue per line
                    heard(queue, now)
                self.announced = True
                deadline = min(deadline, earliest)

    def _subscription(self) -> redis.client.PubSub | None:
        if self._pubsub is None:
            try:
                pubsub = self._client.pubsub()  # type: ignore[no-untyped-call, unused-ignore]
                pubsub.subscribe(self._keys.announcements)
                self._pubsub = pubsub
            except (redis.exceptions.RedisError, OSError):
                return None
        return self._pubsub

    def read_woken(self, *, trim: bool) -> list[tuple[str, int]]:
        """Queues producers published to again after a quiet time, since the last look, with
        when they woke; with ``trim`` (every scan) entries older than anyone's interest go."""
        since = "-inf" if self._woken_seen is None else self._woken_seen  # inclusive: same ms
        found = cast(
            list[tuple[str, float]],
            self._client.zrangebyscore(self._keys.woken, since, "+inf", withscores=True),
        )
        if trim:
            self._client.zremrangebyscore(self._keys.woken, "-inf", now_ms() - WOKEN_KEPT_MS)
        if found:
            self._woken_seen = int(found[-1][1])  # sorted by score: the newest
        return [(str(queue), int(score)) for queue, score in found]
