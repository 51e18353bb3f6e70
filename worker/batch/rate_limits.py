"""A rate limit per key (``keyq stream set --rate-limit``): a token bucket per key, in the
worker that holds the key, so a key is held to its rate wherever it is served from and no
other key is slowed. A bucket holds at most one second of events (a key idle for a while may
burst that much), and a full bucket is forgotten, so memory follows the keys being limited."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from keyq.worker.amqp.deliveries import Delivery


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


def within_rates(
    deliveries: Sequence[Delivery], keys: Sequence[str | None], limiter: KeyRateLimiter
) -> tuple[list[Delivery], list[Delivery]]:
    """Split ``deliveries`` (with their ``keys``) into those within their key's rate and
    those beyond it: a key's first events go, its later ones wait, in order."""
    counts: dict[str, int] = {}
    for delivery, key in zip(deliveries, keys, strict=True):
        if key is not None and delivery.deferred_since is None:
            counts[key] = counts.get(key, 0) + 1
    allowed = {key: limiter.take(key, count) for key, count in counts.items()}
    within: list[Delivery] = []
    beyond: list[Delivery] = []
    for delivery, key in zip(deliveries, keys, strict=True):
        # Deferred already: it goes with the one it waits for, so that its tokens never
        # starve the missing one into being given up.
        if delivery.deferred_since is None and key is not None:
            if allowed[key] <= 0:
                beyond.append(delivery)
                continue
            allowed[key] -= 1
        within.append(delivery)
    return within, beyond
