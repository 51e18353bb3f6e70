"""A stream's operator settings, in Redis: what a poison event does to its key, a rate limit
per key, and whether the whole stream is paused. Set with ``keyq stream set`` and ``keyq
pause --all``; workers read them each tick, so a change takes effect without a restart."""

from __future__ import annotations

import math
from dataclasses import dataclass

import redis

from keyq.broker.errors import InvalidInput
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.text import as_text

POISON_POLICIES = ("skip", "park")
DEFAULT_DEDUPE_WINDOW_S = 86_400  # a day: past a restart, a redeploy, a night's retries


@dataclass(frozen=True)
class StreamPolicy:
    """``poison_policy``: ``skip`` dead-letters a poison event and its key goes on; ``park``
    dead-letters it and stops the key there until a redrive. ``rate_limit``: events per second
    per key (None: unlimited). ``paused``: nothing of the stream is applied.
    ``dedupe_window_s``: how long an event's dedupe id is remembered at least."""

    poison_policy: str = "skip"
    rate_limit: float | None = None
    paused: bool = False
    dedupe_window_s: int = DEFAULT_DEDUPE_WINDOW_S

    def __post_init__(self) -> None:
        if self.poison_policy not in POISON_POLICIES:
            raise InvalidInput(
                f"poison policy must be one of {', '.join(POISON_POLICIES)}, "
                f"got {self.poison_policy!r}"
            )
        if self.rate_limit is not None:
            check_rate_limit(self.rate_limit)
        check_dedupe_window(self.dedupe_window_s)


def check_dedupe_window(seconds: int) -> int:
    if not 60 <= seconds <= 30 * 86_400:
        raise InvalidInput(f"a dedupe window must be 60 s to 30 days (2,592,000 s), got {seconds}")
    return seconds


def check_rate_limit(value: float) -> float:
    if not math.isfinite(value) or value <= 0:
        raise InvalidInput(
            f"a rate limit must be a number of events per second above 0, got {value}"
        )
    return value


class StreamPolicies:
    """Reads and writes the policy of one stream."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self._client = client
        self._key = StreamKeys(stream).policy

    def load(self) -> StreamPolicy:
        raw = {as_text(k): as_text(v) for k, v in self._client.hgetall(self._key).items()}
        policy = raw.get("poison_policy", "skip")
        limit = raw.get("rate_limit")
        window = raw.get("dedupe_window_s")
        return StreamPolicy(
            poison_policy=policy if policy in POISON_POLICIES else "skip",
            rate_limit=float(limit) if limit else None,
            paused=raw.get("paused") == "1",
            dedupe_window_s=int(window) if window else DEFAULT_DEDUPE_WINDOW_S,
        )

    def set_poison_policy(self, policy: str) -> None:
        StreamPolicy(poison_policy=policy)  # checks it
        self._client.hset(self._key, "poison_policy", policy)

    def set_rate_limit(self, per_second: float | None) -> None:
        """``None`` lifts the limit."""
        if per_second is None:
            self._client.hdel(self._key, "rate_limit")
            return
        self._client.hset(self._key, "rate_limit", repr(check_rate_limit(per_second)))

    def set_dedupe_window(self, seconds: int) -> None:
        self._client.hset(self._key, "dedupe_window_s", check_dedupe_window(seconds))

    def set_paused(self, paused: bool) -> None:
        if paused:
            self._client.hset(self._key, "paused", "1")
        else:
            self._client.hdel(self._key, "paused")
