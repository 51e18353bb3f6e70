"""Which keys of an auto-mode stream's buckets need a queue of their own (``keyq.broker.routes``),
from what the bucket holder's attempts see: a key published at ``auto_promote_rate`` events a
second, with ``auto_promote_backlog`` events in one attempt, held back (paused or parked) while its
bucket-mates flow, or over its rate limit. A promoted key no longer takes its bucket's prefetch or
batch room from its bucket-mates. A key is promoted at the start of the attempt that shows it, so
the events that showed it are forwarded already.

A key's rate is read from its events' publish times, not from when they are taken: a bucket
draining a backlog takes a cold key's old events fast, and promoting it then would only move
that backlog (forwarded, then consumed again) for nothing.

Pure: the caller passes the publish times, the statuses and the clock."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from keyq.broker.key_control import KeyStatus
from keyq.broker.routes import WHY_BACKLOG, WHY_RATE, WHY_RATE_LIMITED, WHY_STOPPED

WINDOW_S = 1.0


@dataclass(slots=True)
class _Published:
    """One key's events within a window of its newest publish time."""

    times_ms: deque[int] = field(default_factory=deque)
    newest_ms: int = 0
    seen_at: float = 0.0  # when an attempt last took some (monotonic)

    def add(self, times_ms: Sequence[int], window_ms: int, now: float) -> int:
        """Note ``times_ms`` (not empty); how many of the key's events were published within
        the window that ends at the newest."""
        self.times_ms.extend(times_ms)
        self.newest_ms = max(self.newest_ms, *times_ms)
        self.seen_at = now
        start = self.newest_ms - window_ms
        while self.times_ms and self.times_ms[0] < start:
            self.times_ms.popleft()
        return sum(1 for at in self.times_ms if at >= start)


class RouteWatch:
    """Proposes promotions for one worker."""

    def __init__(self, *, rate: float, backlog: int, window_s: float = WINDOW_S) -> None:
        self.rate = rate
        self.backlog = backlog
        self._window_s = window_s
        self._published: dict[str, _Published] = {}
        self._limited: dict[str, float] = {}  # key -> when it was last over its rate limit

    def limited(self, keys: Iterable[str], now: float) -> None:
        """Keys an attempt held back for the stream's rate limit: promoted when seen next."""
        self._limited.update(dict.fromkeys(keys, now))

    def due(
        self,
        published: Mapping[str, Sequence[int]],
        statuses: Mapping[str, KeyStatus],
        now: float,
    ) -> dict[str, str]:
        """Of the keys an attempt takes from their buckets (``published``: the publish times,
        ms, of each one's events), those to promote now, and why."""
        horizon = now - self._window_s
        window_ms = round(self._window_s * 1000)
        found: dict[str, str] = {}
        for key, times_ms in published.items():
            status = statuses.get(key)
            if status is not None and status.route is not None:
                continue  # promoted already
            recent = self._published.setdefault(key, _Published()).add(times_ms, window_ms, now)
            if status is not None and status.stopped and not status.aside:
                found[key] = WHY_STOPPED
            elif self._limited.get(key, horizon - 1) >= horizon:
                found[key] = WHY_RATE_LIMITED
            elif len(times_ms) >= self.backlog:
                found[key] = WHY_BACKLOG
            elif recent >= self.rate * self._window_s:
                found[key] = WHY_RATE
        for key in found:
            self._published.pop(key, None)
            self._limited.pop(key, None)
        quiet = [key for key, seen in self._published.items() if seen.seen_at < horizon]
        for key in quiet:
            del self._published[key]  # none taken for a window: forgotten
        for key in [key for key, at in self._limited.items() if at < horizon]:
            del self._limited[key]
        return found
