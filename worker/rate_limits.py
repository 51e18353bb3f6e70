"""A rate limit per key (``keyq stream set --rate-limit``): a token bucket per key, in the
worker that holds the key, so a key is held to its rate wherever it is served from and no
other key is slowed. A bucket holds at most one second of events (a key idle for a while may
burst that much), and a full bucket is forgotten, so memory follows the keys being limited."""

from __future__ import annotations

import time
from collections.abc import Callable


class KeyRateLimiter:
    """Tokens per key at ``rate`` events/s; used only by the batch loop's thread."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self._capacity = max(1.0, rate)
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def take(self, key: str, wanted: int) -> int:
        """Take up to ``wanted`` tokens of ``key``'s bucket; returns how many it had."""
        now = self._clock()
        tokens = self._tokens(key, now)
        granted = min(wanted, int(tokens))
        self._buckets[key] = (tokens - granted, now)
        return granted

    def due_in(self, key: str) -> float:
        """Seconds until ``key`` has a token again."""
        tokens = self._tokens(key, self._clock())
        return 0.0 if tokens >= 1 else (1 - tokens) / self.rate

    def forget_full(self) -> None:
        """Drop the buckets that have refilled: they are as good as new."""
        now = self._clock()
        full = [key for key in self._buckets if self._tokens(key, now) >= self._capacity]
        for key in full:
            del self._buckets[key]

    def _tokens(self, key: str, now: float) -> float:
        found = self._buckets.get(key)
        if found is None:
            return self._capacity
        tokens, at = found
        return min(self._capacity, tokens + (now - at) * self.rate)
