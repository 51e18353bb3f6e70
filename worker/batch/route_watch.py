"""Which keys of an auto-mode stream's buckets need a queue of their own (``keyq.broker.routes``),
from what the bucket holder's attempts see: a key at ``auto_promote_rate`` events a second, with
``auto_promote_backlog`` events in one attempt, held back (paused or parked) while its bucket-mates
flow, or over its rate limit. A promoted key no longer takes its bucket's prefetch or batch room
from its bucket-mates. A key is promoted at the start of the attempt that shows it, so the events
that showed it are forwarded already.

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
        self._limited: dict[str, float] = {}  # key -> when it was last over its rate limit

    def limited(self, keys: Iterable[str], now: float) -> None:
        """Keys an attempt held back for the stream's rate limit: promoted when seen next."""
        self._limited.update(dict.fromkeys(keys, now))

    def due(
        self, counts: Mapping[str, int], statuses: Mapping[str, KeyStatus], now: float
    ) -> dict[str, str]:
        """Of the keys an attempt takes from their buckets (``counts``: events each), those to
        promote now, and why."""
        horizon = now - self._window_s
        found: dict[str, str] = {}
        for key, events in counts.items():
            status = statuses.get(key)
            if status is not None and status.route is not None:
                continue  # promoted already
            seen = self._seen.setdefault(key, deque())
            seen.append((now, events))
            while seen and seen[0][0] < horizon:
                seen.popleft()
            if status is not None and status.stopped and not status.aside:
                found[key] = WHY_STOPPED
            elif self._limited.get(key, horizon - 1) >= horizon:
                found[key] = WHY_RATE_LIMITED
            elif events >= self.backlog:
                found[key] = WHY_BACKLOG
            elif sum(n for _, n in seen) >= self.rate * self._window_s:
                found[key] = WHY_RATE
        for key in found:
            self._seen.pop(key, None)
            self._limited.pop(key, None)
        for key in [key for key, seen in self._seen.items() if not seen or seen[-1][0] < horizon]:
            del self._seen[key]  # quiet for a window: forgotten
        for key in [key for key, at in self._limited.items() if at < horizon]:
            del self._limited[key]
        return found
