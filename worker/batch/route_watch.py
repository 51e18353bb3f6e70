"""Which keys of an auto-mode stream's buckets need a queue of their own (``keyq.broker.routes``),
from what the bucket holder's batches see: a key at ``auto_promote_rate`` events a second, with
``auto_promote_backlog`` events in one batch, held back (paused or parked) while its bucket-mates
flow, or over its rate limit. A promoted key no longer takes its bucket's prefetch or batch room
from its bucket-mates.

Pure: the caller passes the counts, the statuses and the clock."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

from keyq.broker.key_control import KeyStatus
from keyq.broker.routes import WHY_BACKLOG, WHY_RATE, WHY_RATE_LIMITED, WHY_STOPPED

WINDOW_S = 1.0


class RouteWatch:
    """Proposes promotions for one worker."""

    def __init__(self, *, rate: float, backlog: int, window_s: float = WINDOW_S) -> None:
        self.rate = rate
        self.backlog = backlog
        self._window_s = window_s
        self._seen: dict[str, deque[tuple[float, int]]] = {}  # key -> (when, events) in window
        self._due: dict[str, tuple[str, float]] = {}  # key -> why, since when

    def observe(self, counts: Mapping[str, int], limited: Iterable[str], now: float) -> None:
        """One batch's events per key taken from its bucket, and its keys over their rate."""
        for key in limited:
            self._due.setdefault(key, (WHY_RATE_LIMITED, now))
        horizon = now - self._window_s
        for key, events in counts.items():
            if events >= self.backlog:
                self._due.setdefault(key, (WHY_BACKLOG, now))
            seen = self._seen.setdefault(key, deque())
            seen.append((now, events))
            while seen and seen[0][0] < horizon:
                seen.popleft()
            if sum(n for _, n in seen) >= self.rate * self._window_s:
                self._due.setdefault(key, (WHY_RATE, now))
        for key in [key for key, seen in self._seen.items() if seen[-1][0] < horizon]:
            del self._seen[key]  # quiet for a window: forgotten
        for key in [key for key, (_, since) in self._due.items() if since < horizon]:
            del self._due[key]  # not seen again in its bucket since: no longer needed

    def due(self, keys: Iterable[str], statuses: Mapping[str, KeyStatus]) -> dict[str, str]:
        """The keys among ``keys`` (seen in a bucket now) to promote, and why: held back with
        nothing aside yet, or proposed by earlier batches. Each proposal is given once."""
        found: dict[str, str] = {}
        for key in keys:
            status = statuses.get(key)
            if status is not None and status.route is not None:
                self._due.pop(key, None)
                continue
            proposed = self._due.pop(key, None)
            why = None if proposed is None else proposed[0]
            if status is not None and status.stopped and not status.aside:
                why = WHY_STOPPED
            if why is not None:
                found[key] = why
                self._seen.pop(key, None)
        return found
