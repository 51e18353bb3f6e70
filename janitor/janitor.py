"""The janitor: deletes drained, idle, unheld queues of keys' own, and keyq's stale Redis state.

A pass over a stream, as its leader: read registry entries idle past the ttl, skip queues a
worker holds, mark the rest retiring (the retirement fence), wait ``retire_grace_ms`` so no
producer can still be publishing to them, delete each with ``if_empty`` and ``if_unused``,
forget the deleted ones in the registry unless a producer touched them since (compare and
delete), and lift the marks. A queue refused as not empty is marked active again, so workers
pick up its backlog. Bucket-mode streams keep their queues; auto-mode streams lose their keys'
own queues the same way (``keyq.janitor.demotions``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

import pika.exceptions
import redis
import redis.exceptions

from keyq.broker.backoff import Backoff
from keyq.broker.clock import now_ms
from keyq.broker.connections import open_redis, redis_errors
from keyq.broker.errors import AuthenticationFailed, ConfigurationError, KeyqError
from keyq.broker.key_control import KeyControl
from keyq.broker.locks import FencedLocks
from keyq.broker.membership import Membership
from keyq.broker.naming import Mode, base_queue_name, check_stream_name
from keyq.broker.registry import QueueRegistry
from keyq.broker.retirement import Mark, RetirementFence
from keyq.broker.settings import load_settings
from keyq.broker.streams import StreamConfig, discover_streams, load_stream_config
from keyq.janitor.chunk_deletes import MARK_MARGIN_MS, Marks, delete_locked, delete_marked
from keyq.janitor.cluster_probe import unreachable_nodes
from keyq.janitor.config import JanitorSettings
from keyq.janitor.deleter import Outcome, QueueDeleter
from keyq.janitor.demotions import Demotions, never_retired
from keyq.janitor.fd_watch import FdWatch
from keyq.janitor.inventory import InventoryUnavailable, list_queues
from keyq.janitor.leader import Leadership
from keyq.janitor.stream_gauges import StreamGauges
from keyq.janitor.watchdog import Watchdog

log = logging.getLogger("keyq.janitor")

INITIAL_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
ADOPT_EVERY_S = 60.0
CHUNKS_IN_FLIGHT = 3
# What a pass fails with when a service is down; anything else is logged with its traceback.
EXPECTED_FAILURES = (KeyqError, redis.exceptions.RedisError, OSError)


class Janitor:
    """Reclaims idle queues of the given streams (all keyq streams if none are given)."""

    def __init__(
        self,
        streams: Sequence[str] = (),
        *,
        settings: JanitorSettings | None = None,
        janitor_id: str | None = None,
    ) -> None:
        self.settings = settings or load_settings(JanitorSettings)
        self.streams = [check_stream_name(stream) for stream in streams]
        self.janitor_id = janitor_id or f"janitor-{uuid.uuid4().hex[:8]}"
        self.stats: Counter[str] = Counter()
        self._stop = threading.Event()
        self._adopted_at = 0.0
        self._inventory_said: str | None = None  # why the queue list was not read, if said
        self.fd_watch = FdWatch(self.settings, self.settings.fd_warn_every_s)
        # Nodes of KEYQ_AMQP_URL that did not answer, probed once per pass when a quorum
        # stream has queues to delete (None: not probed yet in this pass).
        self._nodes_down: list[str] | None = None
        figures_ttl_s = 3 * self.settings.janitor_interval_s + 30  # a few passes
        self.gauges = StreamGauges(self.settings, self.janitor_id, figures_ttl_s)
        self.watchdog = Watchdog(self.settings, self.janitor_id, self.gauges.figures, self.stats)
        self._turned_at: float | None = None  # monotonic: the loop's last sign of life
        self._passed = False  # the last pass reached Redis and RabbitMQ

    def stop(self) -> None:
        self._stop.set()

    def is_live(self) -> bool:
        """True while the loop turns: it started a pass or a stream within three pass
        intervals (at least a minute, as deleting a chunk waits out the retirement grace)."""
        turned = self._turned_at
        within = max(3 * self.settings.janitor_interval_s, 60.0)
        return turned is None or time.monotonic() - turned <= within

    def is_ready(self) -> bool:
        """True while connected: the last pass reached Redis and RabbitMQ."""
        return self._passed and not self._stop.is_set()

    # ---- the loop -------------------------------------------------------------------------

    def run(self, *, once: bool = False) -> None:
        """Pass over the streams until stopped (or once). Services that are down are waited
        for with jittered backoff; only bad configuration and refused credentials raise."""
        backoff = Backoff(INITIAL_BACKOFF_S, MAX_BACKOFF_S)
        client: redis.Redis | None = None
        deleter: QueueDeleter | None = None
        try:
            while not self._stop.is_set():
                deleted_before = self.stats["deleted"]
                self._turned_at = time.monotonic()
                try:
                    if client is None:
                        client = open_redis(self.settings)
                    if deleter is None:
                        deleter = QueueDeleter(
                            self.settings, self.settings.janitor_connections, self.janitor_id
                        )
                    with redis_errors(self.settings.redis_url):
                        self.run_pass(client, deleter)
                    self._passed = True
                    backoff.reset()
                except (ConfigurationError, AuthenticationFailed):
                    raise  # no wait cures either: not retried
                except Exception as exc:  # a daemon survives a failed pass
                    progressed = self.stats["deleted"] > deleted_before
                    delay = self._pass_failed(exc, backoff, progressed=progressed, once=once)
                    # Anything unexpected (pika can fail inside its own loop on a broken
                    # socket) is said with its traceback, and the next pass starts over on
                    # fresh connections rather than the daemon dying.
                    expected = isinstance(exc, EXPECTED_FAILURES)
                    log.warning(
                        "janitor pass failed, retrying in %.1fs: %s",
                        delay,
                        exc,
                        exc_info=not expected,
                    )
                    if once:
                        raise
                    if not expected and deleter is not None:
                        deleter.close()
                        deleter = None
                    if self._stop.wait(delay):
                        break
                    continue
                if once or self._stop.wait(self.settings.janitor_interval_s):
                    break
        finally:
            self.gauges.close()
            self.watchdog.close()
            if deleter is not None:
                deleter.close()
            if client is not None:
                self._resign(client)
                client.close()

    def _pass_failed(
        self, exc: Exception, backoff: Backoff, *, progressed: bool, once: bool
    ) -> float:
        """Count a failed pass; the delay before the next one. A ``KeyqError`` of a pass run
        ``once`` is raised again at once: the command says why in one line."""
        self.stats["errors"] += 1
        self._passed = False
        if once and isinstance(exc, KeyqError):
            raise exc
        if progressed:
            # It got somewhere before failing (a cut connection, a node going away): the
            # broker is there, so the next pass starts soon again.
            backoff.reset()
        return backoff.next()

    def run_pass(self, client: redis.Redis, deleter: QueueDeleter) -> None:
        self.stats["passes"] += 1
        self._nodes_down = None
        self.fd_watch.poll()  # the broker's fd use, at most once a minute; never raises
        try:
            deleter.check()
            streams = self.streams or discover_streams(client)
            self._adopt_leftovers(client, streams)
            for stream in streams:
                if self._stop.is_set():
                    return
                self._pass_stream(client, deleter, stream)
        finally:
            deleter.release()

    def _pass_stream(self, client: redis.Redis, deleter: QueueDeleter, stream: str) -> None:
        self._turned_at = time.monotonic()
        pruned = Membership(client, stream, 1).prune()
        self.stats["members_pruned"] += len(pruned)
        config = load_stream_config(client, stream)
        if config is None:
            return
        # Every stream has a leader, which measures it; only streams whose keys have queues of
        # their own (key and auto mode) lose queues.
        leader = Leadership(client, stream, self.janitor_id, self.settings.janitor_lease_ms)
        if not leader.hold():
            self.gauges.forget(stream)
            self.watchdog.forget(stream)
            if config.holds_own_queues():
                self.stats["not_leader"] += 1
            return
        if self.settings.metrics_port is not None:
            # Only read where someone can scrape them: without a listing endpoint they cost
            # the broker a passive declare per queue and pass.
            self.gauges.measure(client, stream, config)
        self._watch(client, stream, config)
        if not config.holds_own_queues():
            return
        registry = QueueRegistry(client, stream)
        cutoff = now_ms() - int(self.settings.idle_ttl_s * 1000)
        # Own queues of keys with events aside stay (refused again where marked): read past
        # them and an auto stream's buckets, or many paused keys would stop all retiring.
        kept = {config.own_queue_for(key) for key in KeyControl(client, stream).keys_aside()}
        limit = self.settings.janitor_batch + len(kept) + (config.buckets or 0)
        idle = {
            q: at
            for q, at in registry.idle_since(cutoff, limit=limit).items()
            if base_queue_name(q) not in kept and not never_retired(stream, q)
        }
        if not idle:
            return
        holders = FencedLocks(client, stream).holders(list(idle))
        free = [queue for queue, lease in holders.items() if lease is None]
        self.stats["skipped_held"] += len(idle) - len(free)
        demotions = Demotions(client, stream, self.stats) if config.mode is Mode.AUTO else None
        if demotions is not None:
            free = demotions.retirable(registry, free)
        quorum = config.queue_type == "quorum"
        if quorum and free and self._quorum_kept(stream, len(free)):
            return
        chunk = self.settings.janitor_chunk
        self._retire(
            client=client,
            stream=stream,
            deleter=deleter,
            leader=leader,
            registry=registry,
            seen=idle,
            waiting=deque(free[i : i + chunk] for i in range(0, len(free), chunk)),
            quorum=quorum,
            demotions=demotions,
        )

    def _quorum_kept(self, stream: str, idle: int) -> bool:
        """True, and said, when a node does not answer (probed once a pass): the ``idle``
        quorum queues of ``stream`` are kept. See janitor/cluster_probe.py: deleting now
        invites a re-declare short of a replica for good. Counted as unreachable: "not now",
        never gone."""
        if self._nodes_down is None:
            self._nodes_down = unreachable_nodes(self.settings)
        down = self._nodes_down
        if down:
            self.stats["skipped_unreachable"] += idle
            log.info(
                "stream %s: %d idle quorum queues kept while %s do not answer",
                stream,
                idle,
                ", ".join(down),
            )
        return bool(down)

    def _watch(self, client: redis.Redis, stream: str, config: StreamConfig) -> None:
        """The no-progress watchdog's look at ``stream``; a broker that cannot be asked
        leaves it for the next pass (said at WARNING) without stopping the deletes."""
        try:
            self.watchdog.look(client, stream, config)
        except (KeyqError, pika.exceptions.AMQPError, OSError) as exc:
            self.gauges.close()
            self.watchdog.close()
            self.watchdog.forget(stream)  # no verdict rather than a stale one
            log.warning("stream %s: the watchdog could not look: %s", stream, exc)

    def _retire(
        self,
        *,
        client: redis.Redis,
        stream: str,
        deleter: QueueDeleter,
        leader: Leadership,
        registry: QueueRegistry,
        seen: dict[str, int],
        waiting: deque[list[str]],
        quorum: bool = False,
        demotions: Demotions | None = None,
    ) -> None:
        """Mark chunks ahead and delete each once its grace has passed, so the grace of the
        next chunks overlaps the deletes of this one; a queue stays marked only about
        ``retire_grace_ms`` plus a few chunks' deletes."""
        fence = RetirementFence(client, stream)
        grace_s = self.settings.retire_grace_ms / 1000
        mark_ttl = self.settings.retire_grace_ms + MARK_MARGIN_MS
        in_flight: deque[tuple[list[str], float]] = deque()
        try:
            while waiting or in_flight:
                if waiting and len(in_flight) < CHUNKS_IN_FLIGHT:
                    tried = fence.mark(waiting.popleft(), self.janitor_id, mark_ttl)
                    marked = [queue for queue, mark in tried.items() if mark is Mark.MARKED]
                    self.stats["skipped_aside"] += sum(m is Mark.ASIDE for m in tried.values())
                    if marked:
                        in_flight.append((marked, time.monotonic()))
                    continue
                marked, marked_at = in_flight[0]
                # No producer lease taken before the marks can outlive this wait.
                left = marked_at + grace_s - time.monotonic()
                if (left > 0 and self._stop.wait(left)) or self._stop.is_set():
                    return
                if not leader.hold():
                    return
                # The marks of the chunks after this one are renewed as it goes.
                ahead = [queue for chunk, _at in list(in_flight)[1:] for queue in chunk]
                marks = Marks(fence, self.janitor_id, mark_ttl, ahead)
                if quorum:
                    outcomes, down = delete_locked(
                        settings=self.settings,
                        client=client,
                        stream=stream,
                        deleter=deleter,
                        queues=marked,
                        marks=marks,
                        stats=self.stats,
                    )
                    if down:
                        self._nodes_down = down  # the rest of this pass keeps its queues too
                else:
                    outcomes = delete_marked(deleter, marked, marks)
                self._settle(stream, registry, seen, outcomes, demotions)
                in_flight.popleft()
                fence.unmark(marked)
        finally:
            for marked, _at in in_flight:
                fence.unmark(marked)

    def _settle(
        self,
        stream: str,
        registry: QueueRegistry,
        seen: dict[str, int],
        outcomes: dict[str, Outcome],
        demotions: Demotions | None = None,
    ) -> None:
        if demotions is not None:
            demotions.demote(outcomes)  # before the registry forgets them and the marks go
        tally = Counter(outcome.value for outcome in outcomes.values())
        self.stats["deleted"] += tally[Outcome.DELETED.value]
        self.stats["already_gone"] += tally[Outcome.GONE.value]
        self.stats["skipped_not_empty"] += tally[Outcome.NOT_EMPTY.value]
        self.stats["skipped_in_use"] += tally[Outcome.IN_USE.value]
        self.stats["skipped_unreachable"] += tally[Outcome.UNREACHABLE.value]
        self.stats["skipped_lapsed"] += tally[Outcome.LAPSED.value]
        self.stats["skipped_aside"] += tally[Outcome.ASIDE.value]
        gone = {
            queue: seen[queue]
            for queue, outcome in outcomes.items()
            if outcome in (Outcome.DELETED, Outcome.GONE)
        }
        self.stats["forgotten"] += registry.forget_if_unchanged(gone)
        backlog = [q for q, outcome in outcomes.items() if outcome is Outcome.NOT_EMPTY]
        if backlog:
            registry.touch(backlog)  # active again: workers claim it and drain it
            self.stats["revived"] += len(backlog)
        if tally:
            log.info("stream %s: %s", stream, dict(tally))

    def _adopt_leftovers(self, client: redis.Redis, streams: Sequence[str]) -> None:
        """Register keyq queues that exist on the broker but not in the registry (a crash
        between declare and register), so the normal passes can reclaim them."""
        if time.monotonic() - self._adopted_at < ADOPT_EVERY_S:
            return
        self._adopted_at = time.monotonic()
        try:
            names = list_queues(self.settings)
        except InventoryUnavailable as exc:
            if str(exc) != self._inventory_said:  # said once, not every pass
                log.info("not looking for unregistered queues: %s", exc)
                self._inventory_said = str(exc)
            return
        self._inventory_said = None
        for stream in streams:
            prefixes = (f"keyq.{stream}.k.", f"keyq.{stream}.h.")
            ours = [name for name in names if name.startswith(prefixes)]
            if not ours:
                continue
            registry = QueueRegistry(client, stream)
            known = set(registry.queues())
            orphans = [name for name in ours if name not in known]
            if orphans:
                registry.register(dict.fromkeys(orphans), announce=False)
                self.stats["adopted"] += len(orphans)
                log.info("stream %s: adopted %d unregistered queues", stream, len(orphans))

    def _resign(self, client: redis.Redis) -> None:
        for stream in self.streams or []:
            try:
                Leadership(client, stream, self.janitor_id, 1000).resign()
            except (redis.exceptions.RedisError, OSError):
                return

    def snapshot(self) -> dict[str, Any]:
        return {"janitor": self.janitor_id, **self.stats}
