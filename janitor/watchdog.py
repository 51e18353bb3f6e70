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
- **Gaps open too long.** A worker waiting on an earlier seq of a key past
  ``stranded_after_s`` (from the worker's heartbeat report).
- **Workers that apply nothing.** A live worker holding unapplied events that has applied
  none for ``stranded_after_s`` (a pipeline or Spark job that hangs), by its heartbeat.

Paused keys, and parked keys whose dead letter waits, wait for an operator by design and are
not stranded. Unheld queues with a backlog are the janitor's own pass's: a non-empty queue it
tries to retire is made active again, and workers claim it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pika
import redis

from keyq.broker.clock import now_ms
from keyq.broker.connections import open_blocking_connection
from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.broker.key_control import FLOWING, KeyControl
from keyq.broker.key_wake import wake_keys
from keyq.broker.locks import FencedLocks, Lease
from keyq.broker.membership import Membership
from keyq.broker.naming import incarnation_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.registry import QueueRegistry
from keyq.broker.stranded import Stranded, StrandedRecord
from keyq.broker.streams import StreamConfig
from keyq.broker.worker_report import WorkerReport
from keyq.janitor.config import JanitorSettings

log = logging.getLogger("keyq.janitor")

WATCH_LIMIT = 500  # queues whose depth is read per stream and look
PARKED_LIMIT = 1000  # parked keys looked up in the index of dead letters per look
HOLDERS_LIMIT = 20_000  # most recently active queues whose holder is read per stream and look
RECORD_TTL_LOOKS = 6  # the stranded record outlives this many of the janitor's passes

Figures = dict[str, tuple[int, int] | None]  # queue -> (ready, consumers); None: not there
FiguresOf = Callable[[str, list[str]], Figures]


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
        self._unheld_since: dict[tuple[str, str], float] = {}
        self.latest: dict[str, int] = {}
        self.stats = stats

    def forget(self, stream: str) -> None:
        self.latest.pop(stream, None)

    def look(self, client: redis.Redis, stream: str, config: StreamConfig) -> list[Stranded]:
        """One look at ``stream``; returns (and records) what is stranded. Errors propagate:
        the janitor's pass fails as a whole and is tried again."""
        now = time.monotonic()
        after_s = self._settings.stranded_after_s
        found: list[Stranded] = []
        control = KeyControl(client, stream)
        aside = control.keys_aside()
        statuses = control.statuses([*aside, *control.parked()])
        flowing = {k: q for k, q in aside.items() if q and not statuses.get(k, FLOWING).stopped}
        queue_of = self._current_queues(client, stream, config, flowing)
        keys = StreamKeys(stream)
        own = sorted(set(queue_of.values()))
        registered = {
            queue
            for queue, score in zip(
                own, client.zmscore(keys.registry, own) if own else [], strict=True
            )
            if score is not None
        }
        # Held queues are among the most recently active: workers touch what they commit.
        recent = [str(q) for q in client.zrevrange(keys.registry, 0, HOLDERS_LIMIT - 1)]
        holders = _holders(client, stream, [*own, *recent])
        aside_queues = {*queue_of.values(), *(q[0] for q in flowing.values())}
        held = [q for q, lease in holders.items() if lease is not None and q not in aside_queues]
        watched = [*sorted(aside_queues), *held][:WATCH_LIMIT]
        figures = self._figures(stream, [*watched, config.dead_letter_queue])
        live = Membership(client, stream, self._settings.member_ttl_ms).alive()
        reports = _reports(client, stream, live)
        seen: set[tuple[str, str]] = set()

        to_wake: list[str] = []
        for key, queues in flowing.items():
            queue, head = queue_of[key], queues[0]
            waiting = (figures.get(head) or (0, 0))[0]
            lease = holders.get(queue)
            if lease is None:
                slot = (stream, queue)
                seen.add(slot)
                if queue not in registered or (queue in figures and figures[queue] is None):
                    to_wake.append(key)  # no path at all: repaired now
                    log.warning(
                        "stream %s: key %r has events aside (%s) but its queue %s is gone; "
                        "declaring it again so a worker drains them",
                        stream,
                        key,
                        ", ".join(queues),
                        queue,
                    )
                    continue
                since = self._unheld_since.setdefault(slot, now)
                if now - since >= after_s:
                    if live:
                        to_wake.append(key)  # announced again: one may have missed it
                    who = "no worker is alive" if not live else "no worker claims it"
                    found.append(
                        self._entry(
                            key,
                            queue,
                            f"{waiting} events wait aside in {head} and nobody holds its "
                            f"queue ({who}) for {now - since:.0f} s",
                            since,
                            repaired=bool(live),
                        )
                    )
                continue
            applied = _applied(reports, lease)
            stalled = self._stalled(stream, head, waiting, applied, now=now, seen=seen)
            if stalled is not None and now - stalled >= after_s:
                found.append(
                    self._entry(
                        key,
                        queue,
                        f"{waiting} events wait aside in {head}, held by {lease.owner}, and "
                        f"none has drained for {now - stalled:.0f} s",
                        stalled,
                    )
                )
        if to_wake:
            self._wake(client, config, to_wake)

        found += self._held_not_moving(
            client, stream, holders=holders, reports=reports, figures=figures, now=now, seen=seen
        )
        found += self._parked_without_letter(client, control, config, figures)
        found += self._open_gaps(reports)
        found += self._workers_not_applying(stream, reports, now)
        for slot in [s for s in self._tracks if s[0] == stream and s not in seen]:
            if not slot[1].startswith("worker:"):
                del self._tracks[slot]
        for slot in [s for s in self._unheld_since if s[0] == stream and s not in seen]:
            del self._unheld_since[slot]
        ttl_ms = int(RECORD_TTL_LOOKS * max(self._settings.janitor_interval_s, 5.0) * 1000)
        StrandedRecord(client, stream).replace(found, ttl_ms)
        self.latest[stream] = len(found)
        if found:
            log.warning(
                "stream %s: %d keys stranded: %s",
                stream,
                len(found),
                "; ".join(f"{entry.subject!r}: {entry.reason}" for entry in found[:5]),
            )
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
        self,
        client: redis.Redis,
        stream: str,
        *,
        holders: dict[str, Lease | None],
        reports: dict[str, WorkerReport],
        figures: Figures,
        now: float,
        seen: set[tuple[str, str]],
    ) -> list[Stranded]:
        """Held queues among those measured with events ready whose count has not fallen,
        while their holder applied nothing, for a while."""
        measured = {
            q: (lease, counts)
            for q, counts in figures.items()
            if counts is not None and counts[0] > 0 and (lease := holders.get(q)) is not None
        }
        keys = QueueRegistry(client, stream).original_keys(measured)
        found = []
        for queue, (lease, (ready, consumers)) in measured.items():
            stalled = self._stalled(
                stream, queue, ready, _applied(reports, lease), now=now, seen=seen
            )
            if stalled is None or now - stalled < self._settings.stranded_after_s:
                continue
            why = "it has no consumer" if consumers == 0 else "its consumer receives nothing"
            found.append(
                self._entry(
                    keys.get(queue) or queue,
                    queue,
                    f"{ready} events ready, held by {lease.owner}, and none applied for "
                    f"{now - stalled:.0f} s ({why}, or the worker is stuck)",
                    stalled,
                )
            )
        return found

    def _parked_without_letter(
        self,
        client: redis.Redis,
        control: KeyControl,
        config: StreamConfig,
        figures: Figures,
    ) -> list[Stranded]:
        """Parked keys none of whose dead letters waits: their poison event was dropped, so a
        redrive has nothing to put back (``--skip`` lets them go on). Read off the index of
        dead letters while it is in step with the queue (letters RabbitMQ dead-lettered by
        itself are indexed only by the next walk); else only an empty queue says so."""
        counts = figures.get(config.dead_letter_queue)
        depth = None if counts is None else counts[0]
        parked = control.parked()
        if not parked or depth is None:
            return []
        index = DeadLetterIndex(client, config.stream)
        if depth > 0 and index.counts()[1] != depth:
            return []  # the index is not in step: no per-key verdict
        waiting = [] if depth == 0 else list(parked)[:PARKED_LIMIT]
        lettered = {key for key in waiting if index.of_key(key, 1).matched}
        return [
            Stranded(
                subject=key,
                queue=config.queue_for(key),
                reason=f"parked at {where.reason!r} but no dead letter of it waits to be "
                f"redriven (dropped?): `keyq dlq redrive --key KEY --skip` lets it go on",
                since_ms=where.at_ms,
            )
            for key, where in parked.items()
            if key not in lettered and (depth == 0 or key in waiting)
        ]

    def _open_gaps(self, reports: dict[str, WorkerReport]) -> list[Stranded]:
        found = []
        for worker, report in reports.items():
            for gap in report.gaps:
                if gap.waited_s >= self._settings.stranded_after_s:
                    found.append(
                        Stranded(
                            subject=gap.key,
                            queue="",
                            reason=f"{worker} waits for seqs {gap.first}..{gap.last} of "
                            f"producer {gap.producer} for {gap.waited_s:.0f} s",
                            since_ms=now_ms() - int(gap.waited_s * 1000),
                        )
                    )
        return found

    def _workers_not_applying(
        self, stream: str, reports: dict[str, WorkerReport], now: float
    ) -> list[Stranded]:
        """Live workers holding unapplied events that applied none for a while: a pipeline or
        Spark job that hangs holds every key it has taken (their events unacked, so no queue
        shows them ready)."""
        found = []
        for worker, report in reports.items():
            slot = (stream, f"worker:{worker}")
            if report.oldest_event_ms is None:
                self._tracks.pop(slot, None)
                continue
            stalled = self._stalled(stream, slot[1], 1, report.events, now=now, seen=set())
            held_s = max(0.0, (now_ms() - report.oldest_event_ms) / 1000)
            after_s = self._settings.stranded_after_s
            if stalled is not None and now - stalled >= after_s and held_s >= after_s:
                found.append(
                    self._entry(
                        f"worker {worker}",
                        "",
                        f"holds events published {held_s:.0f} s ago and applied none for "
                        f"{now - stalled:.0f} s (a pipeline or Spark job that hangs?)",
                        stalled,
                    )
                )
        for slot in [s for s in self._tracks if s[0] == stream and s[1].startswith("worker:")]:
            if slot[1][len("worker:") :] not in reports:
                del self._tracks[slot]
        return found

    # ---- helpers ------------------------------------------------------------------------------

    def _stalled(
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
    def _entry(
        subject: str, queue: str, reason: str, since: float, *, repaired: bool = False
    ) -> Stranded:
        since_ms = now_ms() - int((time.monotonic() - since) * 1000)
        return Stranded(subject, queue, reason, since_ms, repaired)

    @staticmethod
    def _current_queues(
        client: redis.Redis, stream: str, config: StreamConfig, keys: dict[str, list[str]]
    ) -> dict[str, str]:
        """Each key's own queue under its current incarnation."""
        bases = {key: config.queue_for(key) for key in keys}
        names = sorted(set(bases.values()))
        raw = client.hmget(StreamKeys(stream).incarnations, names) if names else []
        current = {
            base: incarnation_name(base, int(value or 0))
            for base, value in zip(names, raw, strict=True)
        }
        return {key: current[base] for key, base in bases.items()}

    def _wake(self, client: redis.Redis, config: StreamConfig, keys: list[str]) -> None:
        if self._connection is None or not self._connection.is_open:
            self._connection = open_blocking_connection(self._settings, self._name)
        try:
            wake_keys(client, self._connection, config, keys)
        except Exception:
            self.close()
            raise
        self.stats["watchdog_repairs"] += len(keys)


def _holders(client: redis.Redis, stream: str, queues: list[str]) -> dict[str, Lease | None]:
    """The holders of ``queues`` (at most ``HOLDERS_LIMIT``), a chunk a round trip."""
    names = list(dict.fromkeys(queues))[:HOLDERS_LIMIT]
    locks = FencedLocks(client, stream)
    found: dict[str, Lease | None] = {}
    for start in range(0, len(names), 1000):
        found.update(locks.holders(names[start : start + 1000]))
    return found


def _reports(client: redis.Redis, stream: str, live: list[str]) -> dict[str, WorkerReport]:
    raws = client.hmget(StreamKeys(stream).member_info, live) if live else []
    return {
        worker: report
        for worker, raw in zip(live, raws, strict=True)
        if (report := WorkerReport.parse(raw, worker=worker, stream=stream)) is not None
    }


def _applied(reports: dict[str, WorkerReport], lease: Lease) -> int | None:
    report = reports.get(lease.owner)
    return None if report is None else report.events
