"""The claim loop: membership, lock renewal, fair shares, claims, and spotting dead peers.

Runs on its own thread so that locks are renewed on time even while a Spark job runs. Every
tick it heartbeats and renews all held locks in one round trip; a lock found lost stops its
queue at once. It claims unlocked active queues up to this worker's fair share (lock first,
then an exclusive consumer), asks the batch loop to hand surplus or idle queues back at a
batch boundary, and releases the locks of peers whose Redis connections vanished (killed
processes), so their queues move without waiting for the lock ttl.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
import redis.exceptions

from keyq.broker.clock import now_ms
from keyq.broker.errors import KeyqError
from keyq.broker.locks import FencedLocks
from keyq.broker.membership import Membership
from keyq.broker.naming import Mode, base_queue_name, is_bucket_queue
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.registry import QueueRegistry
from keyq.broker.stream_policy import StreamPolicy
from keyq.worker.amqp.consume_rounds import ConsumeOutcome
from keyq.worker.amqp.link import ConsumerLink
from keyq.worker.amqp.starvation import StarvedQueues
from keyq.worker.config import WorkerSettings
from keyq.worker.holding.aside_drains import AsideDrains
from keyq.worker.holding.handbacks import HandBacks
from keyq.worker.holding.held_index import Held
from keyq.worker.holding.held_queues import HeldQueues
from keyq.worker.holding.peer_reaper import PeerReaper
from keyq.worker.holding.placement import Placement
from keyq.worker.holding.queue_news import QueueNews
from keyq.worker.holding.refused_claims import RefusedClaims

log = logging.getLogger("keyq.worker.holding.claims")

# Idle unheld queues looked into per scan (a passive declare each, ~1 ms), so a backlog left
# while no worker held its queue is found within seconds even among thousands of queues.
PROBES_PER_SCAN = 200
# Queues locked in one script and consumed in one I/O-thread call.
CLAIMS_PER_ROUND = 50
# A claim round woken early by news (a queue declared, or woken by a producer) starts at
# least this long after the last round started: a burst of news makes one round.
NEWS_ROUND_GAP_S = 0.05


@dataclass
class ClaimStats:
    claims: int = 0
    refused: int = 0


@dataclass
class _View:
    """What this worker knows of the stream's queues: name -> last activity (ms)."""

    activity: dict[str, int] = field(default_factory=dict)
    scanned_at: float = 0.0


class ClaimLoop:
    """Decides what to claim and what to hand back; ``HeldQueues`` does the holding."""

    def __init__(
        self,
        *,
        settings: WorkerSettings,
        stream: str,
        mode: Mode,
        worker_id: str,
        client: redis.Redis,
        link: ConsumerLink,
        held: HeldQueues,
        handbacks: HandBacks,
        info: Callable[[], dict[str, object]],
        aside: AsideDrains,
        starved: StarvedQueues,
        policy: Callable[[], StreamPolicy],
    ) -> None:
        self._settings = settings
        self._aside = aside
        self._starved = starved
        self._policy = policy
        self._stream = stream
        self._mode = mode
        self._own_queues = mode is not Mode.BUCKET  # keys' own queues: go idle, are woken
        self._placement = Placement(client, stream, mode, worker_id, settings.max_held_queues)
        self._worker_id = worker_id
        self._client = client
        self._keys = StreamKeys(stream)
        self._locks = FencedLocks(client, stream)
        self._membership = Membership(client, stream, settings.member_ttl_ms)
        self._registry = QueueRegistry(client, stream)
        self._link = link
        self._held = held
        self._handbacks = handbacks
        self._info = info
        self._view = _View()
        self._refused = RefusedClaims()
        self._members: list[str] = []
        self._probe_cursor = 0
        self._stop = threading.Event()
        self._news = QueueNews(client, self._keys, self._stop)
        self._reaper = PeerReaper(
            client=client,
            keys=self._keys,
            locks=self._locks,
            membership=self._membership,
            worker_id=worker_id,
        )
        self._claiming = threading.Event()
        self._claiming.set()
        self._thread = threading.Thread(target=self._run, name="keyq-claims", daemon=True)
        self._first_round = threading.Event()
        self._failing = False
        self._more_to_claim = False
        # Claiming in one tick stops after this long, well inside the lock ttl: the locks
        # held are renewed at the next tick, so a quarter of the ttl leaves three quarters to
        # spare. Under delivery load each consume costs several ms, so the budget, not the
        # tick, sets how fast a worker takes over a dead peer's queues.
        self._claim_budget_s = settings.lock_ttl_ms / 4 / 1000
        self.stats = ClaimStats()

    # ---- control --------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wait_first_round(self, timeout: float) -> bool:
        """True once a tick has succeeded: heartbeat, renewals and a claim round all done."""
        return self._first_round.wait(timeout)

    @property
    def ready(self) -> bool:
        return self._first_round.is_set()

    def stop_claiming(self) -> None:
        """Keep renewing what we hold, but take nothing new (shutdown)."""
        self._claiming.clear()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        self._news.close()

    @property
    def members(self) -> list[str]:
        return list(self._members)

    @property
    def peers_reaped(self) -> int:
        return self._reaper.reaped

    # ---- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        tick = self._settings.tick_ms / 1000
        next_tick = time.monotonic()
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if started >= next_tick:
                    next_tick = started + tick
                    full_round = self._tick()
                    if self._failing:
                        log.info("claim loop recovered")
                        self._failing = False
                else:  # woken early by news: claim, and leave the rest to the tick
                    full_round = self._news_round()
                if full_round and not self._first_round.is_set():
                    self._first_round.set()
                    # Say "ready" now rather than a tick later: status and supervisors read it.
                    self._membership.heartbeat(self._worker_id, self._info())
            except (redis.exceptions.RedisError, OSError, KeyqError) as exc:
                if not self._failing:  # once per outage, not once per tick
                    log.warning("claim loop cannot reach a service, retrying: %s", exc)
                    self._failing = True
            except Exception:
                log.exception("claim loop failed a tick")
            self._wait_for_news(max(0.0, next_tick - time.monotonic()), started + NEWS_ROUND_GAP_S)

    def _wait_for_news(self, seconds: float, earliest: float) -> None:
        """Sleep until the next tick, waking early (not before ``earliest``) for queues
        announced as new or woken by a producer after a quiet time."""
        self._news.wait(seconds, earliest, self._heard)

    def _heard(self, queue: str, at_ms: int) -> None:
        self._view.activity[queue] = at_ms

    def _tick(self) -> bool:
        """One round; False if it could only heartbeat and renew (RabbitMQ not connected)."""
        self._heartbeat_and_renew(self._held.all())
        if not self._link.connected:
            return False
        now = time.monotonic()
        interval = self._settings.scan_interval_ms / 1000
        scanned = False
        if now - self._view.scanned_at >= interval:
            self._scan()
            scanned = True
        woke = self._own_queues and self._read_woken(trim=scanned)
        reaped = self._reaper.reap(self._view.activity)
        members = self._membership.alive()
        changed = members != self._members
        self._members = members
        members = self._sharing()
        if self._claiming.is_set():
            force = (
                scanned or reaped or changed or woke or self._news.announced or self._more_to_claim
            )
            self._more_to_claim = False
            self._balance(members, force=force, probe=scanned)
        self._news.announced = False
        # Own queues go back when idle; buckets are held for good, so watched while quiet.
        idle_s, draining = self._settings.idle_release_ms / 1000, self._aside.draining()
        buckets = [h for h in self._held.all() if is_bucket_queue(self._stream, h.queue)]
        draining |= {h.queue for h in buckets}
        self._handbacks.ask_idle([h for h in self._held.all() if h.queue not in draining], idle_s)
        self._starved.watch_quiet(buckets, idle_s)
        return True

    def _news_round(self) -> bool:
        """A claim round between ticks, for announced queues (new, or woken by a producer).
        Heartbeat, renewals and reaping stay on the tick: news can come many times a second
        (thousands of keys), and reaping counts ticks. Its claims end within the claim budget
        from the last renewal, as a tick's own would, so the next renewal is never later
        than after a tick's round. When it cannot claim, the news waits for the tick.
        Returns False: it is never a full round."""
        deadline = self._renewed_at + self._claim_budget_s
        if not self._link.connected or not self._claiming.is_set() or time.monotonic() >= deadline:
            return False
        if self._own_queues:
            self._read_woken(trim=False)
        members = self._sharing()
        self._more_to_claim = False
        self._balance(members, force=True, probe=False, deadline=deadline)
        self._news.announced = False
        return False

    def _sharing(self) -> list[str]:
        """The members queues are shared among: the live ones seen last, and this worker
        (which counts itself even while its heartbeat is not seen yet)."""
        if self._worker_id in self._members:
            return self._members
        return sorted([*self._members, self._worker_id])

    _renewed_at = 0.0  # monotonic: when the last tick renewed (news rounds claim from it)

    def _heartbeat_and_renew(self, held: list[Held]) -> None:
        """End the holdings whose consumers the broker took away, heartbeat, and renew every
        lock held; a lock found lost stops its queue at once."""
        self._renewed_at = time.monotonic()
        self._held.settle_gone()
        self._membership.heartbeat(self._worker_id, self._info())
        leases = [h.lease for h in held]
        if not leases:
            return
        alive = self._locks.renew(leases, self._settings.lock_ttl_ms)
        for item in held:
            if not alive.get(item.queue, True):
                self._held.lose(item.lease, "lock lost")

    def _read_woken(self, *, trim: bool) -> bool:
        """Queues producers published to again after a quiet time, since the last look: made
        active now, so an unheld one is claimed this tick however many queues are idle. An
        entry is news only if it is newer than what this worker knows of the queue (the lease
        script moves the registry's activity to the same time, so a scan knows it too)."""
        news = False
        for name, stamp in self._news.read_woken(trim=trim):
            if stamp > self._view.activity.get(name, 0):
                self._view.activity[name] = stamp
                news = True
        return news

    def _scan(self) -> None:
        self._view.activity = self._registry.queues()
        self._view.scanned_at = time.monotonic()

    def _active(self) -> set[str]:
        """Queues worth holding: every bucket, and the keys' own queues recently active."""
        if self._mode is Mode.BUCKET:
            return set(self._view.activity)
        cutoff = now_ms() - self._settings.idle_release_ms
        aside = self._aside.wanted  # quiet, but what waits aside for them must be drained
        return {
            q
            for q, stamp in self._view.activity.items()
            if stamp >= cutoff
            or (aside and base_queue_name(q) in aside)
            or is_bucket_queue(self._stream, q)
        }

    def _balance(
        self, members: list[str], *, force: bool, probe: bool, deadline: float | None = None
    ) -> None:
        """Claim up to this worker's share, or ask to hand the surplus back; with ``probe``
        (once a scan, in key mode) also look into a few idle queues for a backlog."""
        held = set(self._held.queues())
        active = self._active() | held
        share = self._placement.share(active, members, self._link.capacity)
        if self._policy().paused:
            share = 0  # paused: hand everything back, events wait in their queues
        if len(held) > share:
            self._handbacks.ask_surplus(held, len(held) - share)
            return
        if len(held) == share or not force:
            self._probe_idle(held, probe)
            return
        now = time.monotonic()
        unheld = active - held
        candidates = [
            q
            for q in unheld
            if not self._refused.waiting(q, now) and not self._handbacks.cooling(q, now)
        ]
        if len(candidates) < len(unheld):
            self._more_to_claim = True  # look again next tick: a wait ends, not a scan
        if not candidates:
            self._probe_idle(held, probe)
            return
        holders = self._locks.holders(candidates)
        free = [q for q, lease in holders.items() if lease is None]
        left = self._placement.left_to_peers(free, held, len(members), now)
        self._more_to_claim |= bool(left)  # taken here after the wait if no peer has
        free = [q for q in free if q not in left]
        random.shuffle(free)
        # Claims are made in rounds (one script for the locks, one I/O-thread call for the
        # consumers), but hundreds of them (a dead peer's queues, a burst of new keys) would
        # still outlast the locks this worker holds, which are renewed only between ticks.
        # Claim for a bounded time, renew, go on next tick.
        wanted = free[: share - len(held)]
        if deadline is None:
            deadline = time.monotonic() + self._claim_budget_s
        for start in range(0, len(wanted), CLAIMS_PER_ROUND):
            if self._stop.is_set() or not self._claiming.is_set():
                return
            if time.monotonic() >= deadline:
                self._more_to_claim = True
                return
            if self._claim(wanted[start : start + CLAIMS_PER_ROUND], deadline) is None:
                self._more_to_claim = True
                return

    def _claim(self, queues: list[str], deadline: float) -> int | None:
        """Lock, then consume, as many of ``queues`` as are free until ``deadline``; returns
        how many, or None if time ran out first."""
        leases = self._locks.acquire_many(queues, self._worker_id, self._settings.lock_ttl_ms)
        if not leases:
            return 0
        outcomes = self._held.claim(leases, budget_s=max(0.0, deadline - time.monotonic()))
        claimed = untried = 0
        now = time.monotonic()
        for item in outcomes:
            queue, outcome = item.lease.queue, item.consumed.outcome
            if outcome is ConsumeOutcome.CONSUMING:
                claimed += 1
                self._refused.consumed(queue)
            elif outcome is ConsumeOutcome.NOT_TRIED:
                untried += 1  # claimed next tick, after the renewal
            else:
                self.stats.refused += 1
                self._refused.refused(queue, outcome, now)
                if outcome is ConsumeOutcome.MISSING:
                    self._view.activity.pop(queue, None)
        self.stats.claims += claimed
        return None if untried else claimed

    def _probe_idle(self, held: set[str], probe: bool) -> None:
        """With ``probe``, look into a few idle unheld own queues: one with messages is made
        active again, so a backlog left while no worker ran is never stranded."""
        if not probe or not self._own_queues:
            return
        cutoff = now_ms() - self._settings.idle_release_ms
        idle = sorted(
            q for q, stamp in self._view.activity.items() if stamp < cutoff and q not in held
        )
        if not idle:
            return
        start = self._probe_cursor % len(idle)
        sample = (idle[start:] + idle[:start])[:PROBES_PER_SCAN]
        self._probe_cursor += len(sample)
        holders = self._locks.holders(sample)
        for queue in sample:  # a call to the I/O thread each: deliveries flow in between
            if holders[queue] is None and self._link.counts.message_count(queue):
                self._registry.touch([queue])
                self._view.activity[queue] = now_ms()
                self._more_to_claim = True  # claimed next tick, not at the next scan
