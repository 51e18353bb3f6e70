"""Which keys of an auto-mode stream's buckets need a queue of their own (``keyq.broker.routes``),
from what the bucket holder's attempts see: a key published at ``auto_promote_rate`` events a
second, with ``auto_promote_backlog`` events in one attempt, held back (paused or parked) while its
bucket-mates flow, or over its rate limit. A promoted key no longer takes its bucket's prefetch or
batch room from its bucket-mates. A key is promoted at the start of the attempt that shows it, so
the events that showed it are forwarded already.

A key's rate is read from its events' publish times, not from when they are taken: a bucket
draining a backlog takes a cold key's old events fast, and promoting it then would only move
that backlog (forwarded, then consumed again) for nothing. Each producer's events are counted in
a window that ends at that producer's newest publish time, so producers whose clocks disagree
add up rather than hide each other, and each event once, by its ``(producer, seq)``, however
often its delivery is taken again (a rerun attempt, an event deferred behind a gap). Publish
times come from the producers' clocks, so the caller caps them at its own clock, and events
without one (not from the SDK) count at the time they are taken.

The count is divided by the time the counted events span, at least ``LEAST_SPAN`` of the
window: a key that has just got hot shows its rate in the first attempt that takes it, while
its bucket is still current. Counted over a whole window, it would show only in a later
attempt, and applying its events meanwhile (a slow key's especially) may have put the bucket
behind, which puts off its promotion (below).

A key is promoted by its rate only while its bucket keeps up: its newest event taken was
published at most ``CURRENT_S`` ago. Producers switch to a key's own queue only once their
earlier events of it have left the bucket, and wait a few seconds for that; a bucket further
behind is most often one of a stream published faster than its workers apply it, which falls
further behind before the switch can be made, so the switch is put off again and again, and a
promotion would only forward the key's events, to be consumed a second time. Further behind, a
key is promoted by its backlog (``auto_promote_backlog``), or by its rate when its bucket's
events are slow to apply (``SLOW_EVENT_S`` each, as the worker measured them): forwarding them
then costs the bucket's holder far less than applying them would, switch or none.

Pure: the caller passes the events, the statuses and the clock."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from keyq.broker.key_control import KeyStatus
from keyq.broker.routes import WHY_BACKLOG, WHY_RATE, WHY_RATE_LIMITED, WHY_STOPPED

WINDOW_S = 1.0
# The least share of the window a rate is read over: a key whose events so far span less (it
# has just got hot, or this is a burst) needs at least this much of a window's events.
LEAST_SPAN = 0.5
# How far behind its publishing a bucket may be for a key's rate to promote it: about a batch.
# At 1.5 s, the demo (published flat out) promoted a dozen orders whose switches were then put
# off, and 9,000 to 13,000 of its 100,000 events went through the buckets to be forwarded.
CURRENT_S = 0.5
# What an event of a bucket must cost a Spark job, beyond a job's fixed cost, for a promotion
# to pay in a bucket further behind: several times what forwarding it costs (a publish
# confirmed, then consumed again).
SLOW_EVENT_S = 0.0005


# One event of a key taken from its bucket: (producer, seq, publish time in ms, at most the
# taker's clock). A plain tuple: a batch holds thousands, read once each.
Published = tuple[str | None, int | None, int]


@dataclass(slots=True)
class _Lane:
    """One producer's events of a key within a window of its newest publish time."""

    times_ms: deque[int] = field(default_factory=deque)
    newest_ms: int = 0
    counted_seq: int = 0  # its events up to this seq are counted

    def add(self, seq: int | None, at_ms: int, window_ms: int) -> None:
        if seq is not None:
            if seq <= self.counted_seq:
                return  # taken again: counted already
            self.counted_seq = seq
        if at_ms <= self.newest_ms - window_ms:
            self.times_ms.clear()  # its clock stepped back: start again from here
            self.newest_ms = at_ms
        self.times_ms.append(at_ms)
        self.newest_ms = max(self.newest_ms, at_ms)

    def rate(self, window_ms: int, least_ms: int) -> float:
        """Events a second within a window of its newest publish time: over the time they
        span, at least ``least_ms`` (a lane seen for less than a window is judged by what it
        was seen for, so a hot key's first attempt can show it)."""
        start = self.newest_ms - window_ms
        while self.times_ms and self.times_ms[0] <= start:
            self.times_ms.popleft()
        if not self.times_ms:
            return 0.0
        return len(self.times_ms) * 1000 / max(self.newest_ms - self.times_ms[0], least_ms)


@dataclass(slots=True)
class _KeyRate:
    lanes: dict[str | None, _Lane] = field(default_factory=dict)
    seen_at: float = 0.0  # when an attempt last took some (monotonic)

    def add(self, events: Sequence[Published], window_ms: int, now: float) -> float:
        """Note ``events``; the key's publish rate (events a second) over its producers."""
        self.seen_at = now
        lanes = self.lanes
        for producer, seq, at_ms in events:
            lane = lanes.get(producer)
            if lane is None:
                lane = lanes[producer] = _Lane()
            lane.add(seq, at_ms, window_ms)
        least_ms = round(window_ms * LEAST_SPAN)
        return sum(lane.rate(window_ms, least_ms) for lane in self.lanes.values())


class RouteWatch:
    """Proposes promotions for one worker."""

    def __init__(
        self,
        *,
        rate: float,
        backlog: int,
        window_s: float = WINDOW_S,
        event_cost: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.rate = rate
        self.backlog = backlog
        self._window_s = window_s
        self._event_cost = event_cost  # what a bucket's event costs a Spark job (s), if known
        self._rates: dict[str, _KeyRate] = {}
        self._limited: dict[str, float] = {}  # key -> when it was last over its rate limit

    def limited(self, keys: Iterable[str], now: float) -> None:
        """Keys an attempt held back for the stream's rate limit: promoted when seen next."""
        self._limited.update(dict.fromkeys(keys, now))

    def due(
        self,
        published: Mapping[str, Sequence[Published]],
        statuses: Mapping[str, KeyStatus],
        now: float,
        taken_ms: int,
    ) -> dict[str, str]:
        """Of the keys an attempt takes from their buckets (``published``: each one's events),
        those to promote now, and why; ``taken_ms``: the taker's clock."""
        horizon = now - self._window_s
        for key in [key for key, rate in self._rates.items() if rate.seen_at < horizon]:
            del self._rates[key]  # none taken for a window: forgotten
        for key in [key for key, at in self._limited.items() if at < horizon]:
            del self._limited[key]
        window_ms = round(self._window_s * 1000)
        found: dict[str, str] = {}
        for key, events in published.items():
            status = statuses.get(key)
            if status is not None and status.route is not None:
                continue  # promoted already
            rate = self._rates.setdefault(key, _KeyRate()).add(events, window_ms, now)
            if status is not None and status.stopped and not status.aside:
                found[key] = WHY_STOPPED
            elif key in self._limited:
                found[key] = WHY_RATE_LIMITED
            elif len(events) >= self.backlog:
                found[key] = WHY_BACKLOG
            elif rate >= self.rate and (_current(events, taken_ms) or self._slow()):
                found[key] = WHY_RATE
        for key in found:
            self._rates.pop(key, None)
            self._limited.pop(key, None)
        return found

    def _slow(self) -> bool:
        cost = self._event_cost()
        return cost is not None and cost >= SLOW_EVENT_S


def _current(events: Sequence[Published], taken_ms: int) -> bool:
    """Whether the newest of ``events`` was published at most ``CURRENT_S`` before taken."""
    newest = max((at_ms for _, _, at_ms in events), default=taken_ms)
    return taken_ms - newest <= CURRENT_S * 1000
