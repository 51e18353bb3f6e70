"""The no-progress watchdog: finds keys whose waiting events have no path to a worker, or make
no progress on one, repairs what keyq can and reports the rest.

Run by the leader of each stream once a pass. What it looks at, and what it does:

- **Events aside, and nobody to drain them.** Only the holder of a key's own queue drains the
  queues its events wait in aside (``broker.key_control``). A key that may flow, with queues
  aside, whose own queue is missing or unregistered, is re-declared, registered and announced
  at once, as a producer or a resume would (``broker.key_wake``): a worker claims it within a
  tick. One that exists but stays unheld past ``stranded_after_s`` is woken again and
  reported. A held one whose aside head does not shrink is reported.
- **Held queues that do not move.** A held queue with events ready whose count does not fall
  for ``stranded_after_s`` (its consumer receives nothing, or its worker is stuck) is
  reported; its holder's lock keeps anyone else away, so only the holder or an operator can
  act.
- **Parked keys with no dead letter.** A parked key waits for the redrive of its poison
  event; with none in the dead-letter queue, a redrive has nothing to put back (``--skip``
  unparks it).
- **Gaps open too long.** A worker deferring a key's events for an earlier seq past
  ``stranded_after_s`` (from the worker's heartbeat report).
- **Workers that apply nothing.** A live worker holding unapplied events that has applied
  none for ``stranded_after_s`` (a pipeline or Spark job that hangs), by its heartbeat.

Paused keys, and parked keys whose dead letter waits, wait for an operator by design and are
not stranded. Unheld queues with a backlog are the janitor's own pass's: a non-empty queue it
tries to retire is made active again, and workers claim it. What a look reads is
``janitor.watch_view``'s.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import pika
import pika.exceptions
import redis

from keyq.broker.clock import now_ms
from keyq.broker.connections import open_blocking_connection
from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.broker.errors import KeyqError
from keyq.broker.key_wake import wake_keys
from keyq.broker.stranded import Stranded, StrandedRecord
from keyq.broker.streams import StreamConfig
from keyq.janitor.cluster_probe import unreachable_nodes
from keyq.janitor.config import JanitorSettings
from keyq.janitor.watch_view import FiguresOf, WatchView

log = logging.getLogger("keyq.janitor")

REPAIRS_PER_LOOK = 100  # stranded keys' queues declared again per stream and look
PARKED_LIMIT = 1000  # parked keys looked up in the index of dead letters per look
# The stranded record outlives the longest of these, so that it outlives the gap between two
# looks, and a janitor that stopped looking leaves no stale verdict for long.
RECORD_TTL_LOOKS = 6  # passes
RECORD_TTL_MIN_MS = 120_000


@dataclass
class _Track:
    """What was last seen of one waiting queue, and since when it has not moved."""

    ready: int
    applied: int | None  # what its holder had applied, by its own report
    still_since: float  # monotonic


class Watchdog:
    """Looks at the streams a janitor leads; ``latest`` (stream -> stranded count) is read by
    its metrics, and its repairs are counted in the janitor's ``stats``."""

    def __init__(
        self,
        settings: JanitorSettings,
        janitor_id: str,
        figures: FiguresOf,
        stats: Counter[str],
    ) -> None:
        self._settings = settings
        self._name = f"{janitor_id}-watchdog"
        self._figures = figures
        self._connection: pika.BlockingConnection | None = None
        self._tracks: dict[tuple[str, str], _Track] = {}
        self._since: dict[tuple[str, str], float] = {}  # (stream, slot) -> since when
        self.latest: dict[str, int] = {}
        self.stats = stats

    def forget(self, stream: str) -> None:
        """No longer this janitor's to watch (or its look failed): what it knew goes stale."""
        self.latest.pop(stream, None)
        for known in (self._tracks, self._since):
            for slot in [slot for slot in known if slot[0] == stream]:
                del known[slot]

    def look(self, client: redis.Redis, stream: str, config: StreamConfig) -> list[Stranded]:
        """One look at ``stream``; returns (and records) what is stranded. Errors propagate:
        the janitor's pass goes on without this look."""
        now = time.monotonic()
        view = WatchView.read(client, stream, config, self._settings, self._figures)
        found: list[Stranded] = []
        seen: set[tuple[str, str]] = set()
        if not view.stream_paused:  # a paused stream is held by nobody, by design
            found += self._aside_without_path(view, now, seen)
            found += self._held_not_moving(view, now, seen)
            found += self._workers_not_applying(view, now, seen)
        found += self._parked_without_letter(view, now, seen)
        found += self._open_gaps(view)
        for known in (self._tracks, self._since):
            for slot in [slot for slot in known if slot[0] == stream and slot not in seen]:
                del known[slot]
        unique = list({entry.subject: entry for entry in reversed(found)}.values())[::-1]
        after_ms = self._settings.stranded_after_s * 1000
        interval_ms = self._settings.janitor_interval_s * 1000
        ttl_ms = int(max(RECORD_TTL_MIN_MS, 4 * after_ms, RECORD_TTL_LOOKS * interval_ms))
        StrandedRecord(client, stream).replace(unique, ttl_ms)
        self.latest[stream] = len(unique)
        if unique:
            log.warning(
                "stream %s: %d keys stranded: %s",
                stream,
                len(unique),
                "; ".join(f"{entry.subject!r}: {entry.reason}" for entry in unique[:5]),
            )
        return unique

    def _aside_without_path(
        self, view: WatchView, now: float, seen: set[tuple[str, str]]
    ) -> list[Stranded]:
        """Keys that may flow with events aside: their queue declared again where it is gone
        (a repair), announced again and reported where nobody holds it, reported where its
        holder drains nothing."""
        after_s = self._settings.stranded_after_s
        found: list[Stranded] = []
        gone: list[str] = []
        unheld: list[str] = []
        for key, queues in view.flowing.items():
            queue, head = view.queue_of[key], queues[0]
            waiting = counts.ready if (counts := view.figures.get(head)) is not None else 0
            lease = view.holders.get(queue)
            if lease is not None:
                applied = view.applied_by(lease)
                still = self._still_since(view.stream, head, waiting, applied, now=now, seen=seen)
                if still is not None and now - still >= after_s:
                    found.append(
                        self._entry(
                            key,
                            queue,
                            f"{waiting} events wait aside in {head}, held by {lease.owner}, "
                            f"and none has drained for {now - still:.0f} s",
                            still,
                        )
                    )
                continue
            gone_queue = queue in view.figures and view.figures[queue] is None
            if queue not in view.registered or gone_queue:
                gone.append(key)  # no path at all: repaired now
                continue
            since = self._since_of((view.stream, queue), now, seen)
            if now - since >= after_s:
                unheld.append(key)
                who = "no worker is alive" if not view.live else "no worker claims it"
                found.append(
                    self._entry(
                        key,
                        queue,
                        f"{waiting} events wait aside in {head} and nobody holds its queue "
                        f"({who}) for {now - since:.0f} s",
                        since,
                    )
                )
        if gone:
            self._repair(view, gone)
        if unheld and view.live:
            self._wake(view, unheld)  # announced again: a worker may have missed it
        return found

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except Exception:  # closing a broken connection: nothing left to do
                log.debug("closing the watchdog's connection failed", exc_info=True)

    # ---- the looks ----------------------------------------------------------------------------

    def _held_not_moving(
        self, view: WatchView, now: float, seen: set[tuple[str, str]]
    ) -> list[Stranded]:
        """Held queues among those measured with events ready whose count has not fallen,
        while their holder applied nothing, for a while."""
        found = []
        for queue in view.held:
            counts, lease = view.figures.get(queue), view.holders.get(queue)
            if counts is None or counts.ready <= 0 or lease is None:
                continue
            applied = view.applied_by(lease)
            still = self._still_since(view.stream, queue, counts.ready, applied, now=now, seen=seen)
            if still is None or now - still < self._settings.stranded_after_s:
                continue
            why = "it has no consumer" if not counts.consumers else "its consumer receives nothing"
            found.append(
                self._entry(
                    view.keys_of.get(queue) or queue,
                    queue,
                    f"{counts.ready} events ready, held by {lease.owner}, and none applied for "
                    f"{now - still:.0f} s ({why}, or the worker is stuck)",
                    still,
                )
            )
        return found

    def _parked_without_letter(
        self, view: WatchView, now: float, seen: set[tuple[str, str]]
    ) -> list[Stranded]:
        """Parked keys none of whose dead letters waits, past ``stranded_after_s``: their
        poison event was dropped, so a redrive has nothing to put back (``--skip`` lets them
        go on). Read off the index of dead letters while it is in step with the queue
        (letters RabbitMQ dead-lettered by itself are indexed only by the next walk); else
        only an empty queue says so. Not judged while a command walks the dead-letter queue:
        the letters it holds unacked are not counted as ready."""
        counts = view.figures.get(view.config.dead_letter_queue)
        if view.walking_letters:  # no verdict now; what was seen before still counts
            seen.update((view.stream, f"parked:{key}") for key in view.parked)
        if not view.parked or counts is None or view.walking_letters:
            return []
        depth = counts.ready
        index = DeadLetterIndex(view.client, view.stream)
        if depth > 0 and index.counts()[1] != depth:
            return []  # the index is not in step: no per-key verdict
        looked = list(view.parked)[:PARKED_LIMIT]
        lettered = set() if depth == 0 else {k for k in looked if index.of_key(k, 1).matched}
        found = []
        for key in looked:
            if key in lettered:
                continue
            since = self._since_of((view.stream, f"parked:{key}"), now, seen)
            if now - since < self._settings.stranded_after_s:
                continue
            where = view.parked[key]
            found.append(
                Stranded(
                    subject=key,
                    queue=view.own_queue(key),
                    reason=f"parked at {where.reason!r} but no dead letter of it waits to be "
                    f"redriven (dropped?): `keyq dlq redrive --key KEY --skip` lets it go on",
                    since_ms=where.at_ms,
                )
            )
        return found

    @staticmethod
    def _open_gaps(view: WatchView) -> list[Stranded]:
        found = []
        for worker, report in view.reports.items():
            for gap in report.gaps:
                if gap.waited_s >= view.settings.stranded_after_s:
                    found.append(
                        Stranded(
                            subject=gap.key,
                            queue="",
                            reason=f"{worker} defers its events behind seqs {gap.first}.."
                            f"{gap.last} of producer {gap.producer}, missing for "
                            f"{gap.waited_s:.0f} s",
                            since_ms=now_ms() - int(gap.waited_s * 1000),
                        )
                    )
        return found

    def _workers_not_applying(
        self, view: WatchView, now: float, seen: set[tuple[str, str]]
    ) -> list[Stranded]:
        """Live workers holding unapplied events that applied none for a while: a pipeline or
        Spark job that hangs holds every key it has taken (their events unacked, so no queue
        shows them ready)."""
        found = []
        for worker, report in view.reports.items():
            if report.oldest_event_ms is None:
                continue
            slot = f"worker:{worker}"
            still = self._still_since(view.stream, slot, 1, report.events, now=now, seen=seen)
            held_s = max(0.0, (now_ms() - report.oldest_event_ms) / 1000)
            after_s = self._settings.stranded_after_s
            if still is not None and now - still >= after_s and held_s >= after_s:
                found.append(
                    self._entry(
                        f"worker {worker}",
                        "",
                        f"holds events published {held_s:.0f} s ago and applied none for "
                        f"{now - still:.0f} s (a pipeline or Spark job that hangs?)",
                        still,
                    )
                )
        return found

    # ---- repairs ------------------------------------------------------------------------------

    def _repair(self, view: WatchView, keys: list[str]) -> None:
        """Declare, register and announce the queues of keys stranded with events aside, each
        on its own (a queue the broker refuses does not hold the others back), at most
        ``REPAIRS_PER_LOOK`` a look; quorum queues only while every node answers (one
        declared during an outage would lack that node's replica)."""
        if view.config.queue_type == "quorum" and unreachable_nodes(self._settings):
            log.info("stream %s: %d stranded keys wait for every node", view.stream, len(keys))
            return
        for key in keys[:REPAIRS_PER_LOOK]:
            log.warning(
                "stream %s: key %r has events aside (%s) but its queue %s is gone; declaring "
                "it again so a worker drains them",
                view.stream,
                key,
                ", ".join(view.flowing[key]),
                view.queue_of[key],
            )
            if self._wake(view, [key]):
                self.stats["watchdog_repairs"] += 1

    def _wake(self, view: WatchView, keys: list[str]) -> bool:
        """``wake_keys`` on a connection checked alive first (an idle one is dropped by the
        broker after a few heartbeats); False, said at WARNING, if the broker refused."""
        try:
            wake_keys(view.client, self._live_connection(), view.config, keys)
        except (KeyqError, pika.exceptions.AMQPError) as exc:
            if isinstance(exc, pika.exceptions.AMQPConnectionError):
                self.close()
            log.warning("stream %s: waking %s failed: %s", view.stream, ", ".join(keys), exc)
            return False
        return True

    def _live_connection(self) -> pika.BlockingConnection:
        connection = self._connection
        if connection is not None and connection.is_open:
            try:
                connection.process_data_events(0)  # heartbeats; raises if it was dropped
                return connection
            except pika.exceptions.AMQPError:
                self.close()
        self._connection = open_blocking_connection(self._settings, self._name)
        return self._connection

    # ---- helpers ------------------------------------------------------------------------------

    def _since_of(self, slot: tuple[str, str], now: float, seen: set[tuple[str, str]]) -> float:
        """Since when a condition about ``slot`` has held, look after look."""
        seen.add(slot)
        return self._since.setdefault(slot, now)

    def _still_since(
        self,
        stream: str,
        queue: str,
        ready: int,
        applied: int | None,
        *,
        now: float,
        seen: set[tuple[str, str]],
    ) -> float | None:
        """Since when ``queue``'s ready count has not fallen while its holder applied
        nothing (``applied``: the holder's count of applied events, None if unknown); None
        while nothing waits in it."""
        slot = (stream, queue)
        seen.add(slot)
        track = self._tracks.get(slot)
        if ready <= 0:
            self._tracks.pop(slot, None)
            return None
        if track is None or ready < track.ready or applied != track.applied:
            self._tracks[slot] = _Track(ready, applied, now)
            return now
        track.ready = ready
        return track.still_since

    @staticmethod
    def _entry(subject: str, queue: str, reason: str, since: float) -> Stranded:
        since_ms = now_ms() - int((time.monotonic() - since) * 1000)
        return Stranded(subject, queue, reason, since_ms)
