"""The claim loop: membership, lock renewal, fair shares, claims, and spotting dead peers.

Runs on its own thread so that locks are renewed on time even while a Spark job runs. Every
tick it heartbeats and renews all held locks in one round trip; a lock found lost stops its
queue at once. It claims unlocked active queues up to this worker's fair share (lock first,
then an exclusive consumer), asks the batch loop to hand surplus or idle queues back at a
batch boundary, and releases the locks of peers whose Redis connections vanished (killed
processes), so their queues move without waiting for the lock ttl.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import redis
import redis.exceptions

from keyq.broker.clock import now_ms
from keyq.broker.connections import FAILING_OVER
from keyq.broker.errors import KeyqError
from keyq.broker.locks import FencedLocks, Lease
from keyq.broker.log_context import about_queues
from keyq.broker.membership import Membership, fair_share
from keyq.broker.naming import Mode
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.redis_topology import node_client
from keyq.broker.registry import QueueRegistry
from keyq.worker.config import WorkerSettings
from keyq.worker.consumer import ConsumeOutcome, ConsumerLink
from keyq.worker.deliveries import DeliveryBuffer
from keyq.worker.holdings import Held, Holdings

log = logging.getLogger("keyq.worker.claims")

CLIENT_NAME_PREFIX = "keyq-w:"
# Queues that refused us (another consumer still attached) are left alone this long.
BUSY_BACKOFF_S = 1.0
# A registered queue that does not exist (deleted; the janitor forgets it) is left alone longer.
MISSING_BACKOFF_S = 30.0
UNREACHABLE_BACKOFF_S = 2.0
# After handing a queue over, do not take it back at once: let a peer have it.
RELEASE_COOLDOWN_S = 3.0
# Idle unheld queues looked into per scan (a passive declare each, ~1 ms), so a backlog left
# while no worker held its queue is found within seconds even among thousands of queues.
PROBES_PER_SCAN = 200
# Queues locked in one script and consumed in one I/O-thread call.
CLAIMS_PER_ROUND = 50
# Woken queues (``StreamKeys.woken``) are forgotten this long after they woke.
WOKEN_KEPT_MS = 60_000
# A claim round woken early by news (a queue declared, or woken by a producer) starts at
# least this long after the last round started: a burst of news makes one round.
NEWS_ROUND_GAP_S = 0.05


def client_name(worker_id: str) -> str:
    return CLIENT_NAME_PREFIX + worker_id


@dataclass
class ClaimStats:
    claims: int = 0
    lost: int = 0
    refused: int = 0
    peers_reaped: int = 0


@dataclass
class _View:
    """What this worker knows of the stream's queues: name -> last activity (ms)."""

    activity: dict[str, int] = field(default_factory=dict)
    scanned_at: float = 0.0


class ClaimLoop:
    """Owns claiming and holding; reports changes through ``notify(kind, queues, reason)``."""

    def __init__(
        self,
        *,
        settings: WorkerSettings,
        stream: str,
        mode: Mode,
        worker_id: str,
        client: redis.Redis,
        link: ConsumerLink,
        holdings: Holdings,
        buffer: DeliveryBuffer,
        notify: Callable[[str, list[str], str], None],
        info: Callable[[], dict[str, object]],
    ) -> None:
        self._settings = settings
        self._stream = stream
        self._mode = mode
        self._worker_id = worker_id
        self._client = client
        self._keys = StreamKeys(stream)
        self._locks = FencedLocks(client, stream)
        self._membership = Membership(client, stream, settings.member_ttl_ms)
        self._registry = QueueRegistry(client, stream)
        self._link = link
        self._holdings = holdings
        self._buffer = buffer
        self._notify = notify
        self._info = info
        self._view = _View()
        self._busy_until: dict[str, float] = {}
        # Queues whose last consume was refused because their node is down: said once when
        # that starts and once when it ends, not on every retry.
        self._unreachable: set[str] = set()
        self._cooldown_until: dict[str, float] = {}
        self._release_requests: dict[str, str] = {}
        self._requests_lock = threading.Lock()
        self._members: list[str] = []
        self._missing_once: set[str] = set()
        self._client_list_ok = True
        self._probe_cursor = 0
        self._woken_seen: int | None = None  # None: read every queue woken so far
        self._pubsub: redis.client.PubSub | None = None
        self._stop = threading.Event()
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
        if self._pubsub is not None:
            with contextlib.suppress(Exception):  # closing at exit
                self._pubsub.close()

    def take_release_requests(self) -> dict[str, str]:
        with self._requests_lock:
            requests, self._release_requests = self._release_requests, {}
            return requests

    def note_released(self, queue: str) -> None:
        self._cooldown_until[queue] = time.monotonic() + RELEASE_COOLDOWN_S

    @property
    def members(self) -> list[str]:
        return list(self._members)

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
        """Sleep until the next tick, waking early for announcements (new queues, and queues
        a producer woke after a quiet time), though not before ``earliest``: news that comes
        in a burst makes one claim round, not one per message."""
        deadline = time.monotonic() + seconds
        pubsub = self._subscription()
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if pubsub is None:
                self._stop.wait(left)
                return
            try:
                message = pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
            except (redis.exceptions.RedisError, OSError):
                self._pubsub = None  # subscribed again next time; until then, the tick
                self._stop.wait(max(0.0, deadline - time.monotonic()))
                return
            if message is not None and message.get("type") == "message":
                now = now_ms()
                for queue in str(message["data"]).split("\n"):  # a queue per line
                    self._view.activity[queue] = now
                self._announced = True
                deadline = min(deadline, earliest)

    def _subscription(self) -> redis.client.PubSub | None:
        if self._pubsub is None:
            try:
                pubsub = self._client.pubsub()  # type: ignore[no-untyped-call]
                pubsub.subscribe(self._keys.announcements)
                self._pubsub = pubsub
            except (redis.exceptions.RedisError, OSError):
                return None
        return self._pubsub

    _announced = False

    def _tick(self) -> bool:
        """One round; False if it could only heartbeat and renew (RabbitMQ not connected)."""
        held = self._holdings.all()
        self._heartbeat_and_renew(held)
        if not self._link.connected:
            return False
        now = time.monotonic()
        interval = self._settings.scan_interval_ms / 1000
        scanned = False
        if now - self._view.scanned_at >= interval:
            self._scan()
            scanned = True
        woke = self._mode is Mode.KEY and self._read_woken(trim=scanned)
        reaped = self._reap_dead_peers()
        members = self._membership.alive()
        changed = members != self._members
        self._members = members
        members = self._sharing()
        if self._claiming.is_set():
            force = scanned or reaped or changed or woke or self._announced or self._more_to_claim
            self._more_to_claim = False
            self._balance(members, force=force, probe=scanned)
        self._announced = False
        if self._mode is Mode.KEY:
            self._release_idle()
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
        if self._mode is Mode.KEY:
            self._read_woken(trim=False)
        members = self._sharing()
        self._more_to_claim = False
        self._balance(members, force=True, probe=False, deadline=deadline)
        self._announced = False
        return False

    def _sharing(self) -> list[str]:
        """The members queues are shared among: the live ones seen last, and this worker
        (which counts itself even while its heartbeat is not seen yet)."""
        if self._worker_id in self._members:
            return self._members
        return sorted([*self._members, self._worker_id])

    _renewed_at = 0.0  # monotonic: when the last tick renewed (news rounds claim from it)

    def _heartbeat_and_renew(self, held: list[Held]) -> None:
        self._renewed_at = time.monotonic()
        self._membership.heartbeat(self._worker_id, self._info())
        leases = [h.lease for h in held]
        if not leases:
            return
        alive = self._locks.renew(leases, self._settings.lock_ttl_ms)
        for item in held:
            if not alive.get(item.queue, True):
                self._lose(item, "lock lost")

    def _lose(self, held: Held, reason: str) -> None:
        """Stop a queue at once: nothing of it is committed or acked from now on."""
        if self._holdings.remove(held.queue, held.epoch) is None:
            return
        self.stats.lost += 1
        with about_queues([held.queue]):
            log.warning("lost %s (%s): stopping it", held.queue, reason)
        self._link.close_queue(held.queue, held.epoch)
        self._buffer.drop(held.queue, held.epoch)
        # A lock is lost with the queue's registration when Redis fails over to a replica
        # that had neither: register it again, or its messages, back in the queue now, would
        # wait for a producer to use the key again before any worker claimed them.
        with contextlib.suppress(redis.exceptions.RedisError, OSError, *FAILING_OVER):
            self._registry.register({held.queue: None})
        self._notify("revoked", [held.queue], reason)

    def lose(self, lease: Lease, reason: str) -> None:
        """Stop a queue whose lease was found lost elsewhere (a refused commit), at once
        rather than at the next renewal; a newer holding of the queue is left alone."""
        held = self._holdings.get(lease.queue)
        if held is not None and held.lease == lease:
            self._lose(held, reason)

    def queue_lost(self, queue: str, epoch: int, reason: str) -> None:
        """The broker took a consumer away (connection or channel closed): let its lock go."""
        held = self._holdings.remove(queue, epoch)
        if held is None:
            return
        self.stats.lost += 1
        self._buffer.drop(queue, epoch)
        with contextlib.suppress(redis.exceptions.RedisError, OSError):  # it expires by itself
            self._locks.release([held.lease])
        self._notify("revoked", [queue], reason)

    def _read_woken(self, *, trim: bool) -> bool:
        """Queues producers published to again after a quiet time, since the last look: made
        active now, so an unheld one is claimed this tick however many queues are idle. An
        entry is news only if it is newer than what this worker knows of the queue (the lease
        script moves the registry's activity to the same time, so a scan knows it too)."""
        since = "-inf" if self._woken_seen is None else self._woken_seen  # inclusive: same ms
        found = cast(
            list[tuple[str, float]],
            self._client.zrangebyscore(self._keys.woken, since, "+inf", withscores=True),
        )
        if trim:  # every scan: an entry outlives any worker's interest in it
            self._client.zremrangebyscore(self._keys.woken, "-inf", now_ms() - WOKEN_KEPT_MS)
        news = False
        for queue, score in found:
            name, stamp = str(queue), int(score)
            if stamp > self._view.activity.get(name, 0):
                self._view.activity[name] = stamp
                news = True
        if found:
            self._woken_seen = int(found[-1][1])  # sorted by score: the newest
        return news

    def _scan(self) -> None:
        self._view.activity = self._registry.queues()
        self._view.scanned_at = time.monotonic()

    def _active(self) -> set[str]:
        """Queues worth holding: all of them in bucket mode, recently active in key mode."""
        if self._mode is Mode.BUCKET:
            return set(self._view.activity)
        cutoff = now_ms() - self._settings.idle_release_ms
        return {q for q, stamp in self._view.activity.items() if stamp >= cutoff}

    def _balance(
        self, members: list[str], *, force: bool, probe: bool, deadline: float | None = None
    ) -> None:
        """Claim up to this worker's share, or ask to hand the surplus back; with ``probe``
        (once a scan, in key mode) also look into a few idle queues for a backlog."""
        held = set(self._holdings.queues())
        active = self._active() | held
        share = min(fair_share(len(active), members, self._worker_id), self._capacity())
        if len(held) > share:
            self._request_surplus_release(held, len(held) - share)
            return
        if len(held) == share or not force:
            if probe and self._mode is Mode.KEY:
                self._probe_idle(held)
            return
        now = time.monotonic()
        unheld = active - held
        candidates = [
            q
            for q in unheld
            if self._busy_until.get(q, 0) <= now and self._cooldown_until.get(q, 0) <= now
        ]
        if len(candidates) < len(unheld):
            self._more_to_claim = True  # look again next tick: a wait ends, not a scan
        if not candidates:
            if probe and self._mode is Mode.KEY:
                self._probe_idle(held)
            return
        holders = self._locks.holders(candidates)
        free = [q for q, lease in holders.items() if lease is None]
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
        # Held first: deliveries may reach the batch loop before the consumers are all open.
        claims = [
            Held(queue=lease.queue, lease=lease, epoch=self._link.new_epoch()) for lease in leases
        ]
        for item in claims:
            self._holdings.add(item)
        try:
            results = self._link.consume_many(
                [(item.queue, item.epoch) for item in claims],
                budget_s=max(0.0, deadline - time.monotonic()),
            )
        except KeyqError:
            # No consumer of this call outlives the connection that failed it.
            for item in claims:
                self._holdings.remove(item.queue, item.epoch)
            self._locks.release(leases)
            raise
        claimed: list[str] = []
        refused: list[Lease] = []
        untried: list[Lease] = []
        now = time.monotonic()
        for item, consumed in zip(claims, results, strict=True):
            if consumed.outcome is ConsumeOutcome.CONSUMING:
                claimed.append(item.queue)
                self._note_reachable(item.queue)
                continue
            self._holdings.remove(item.queue, item.epoch)
            if consumed.outcome is ConsumeOutcome.NOT_TRIED:
                untried.append(item.lease)  # claimed next tick, after the renewal
                continue
            refused.append(item.lease)
            backoff = BUSY_BACKOFF_S
            if consumed.outcome is ConsumeOutcome.MISSING:
                self._view.activity.pop(item.queue, None)
                self._unreachable.discard(item.queue)
                backoff = MISSING_BACKOFF_S
            elif consumed.outcome in (ConsumeOutcome.UNREACHABLE, ConsumeOutcome.FAILED):
                backoff = UNREACHABLE_BACKOFF_S  # tried again soon: its node may be back
                if consumed.outcome is ConsumeOutcome.UNREACHABLE:
                    self._note_unreachable(item.queue)
            self._busy_until[item.queue] = now + backoff
        self._locks.release(refused + untried)
        self.stats.refused += len(refused)
        self.stats.claims += len(claimed)
        if claimed:
            self._notify("assigned", claimed, "claimed")
        return None if untried else len(claimed)

    def _note_unreachable(self, queue: str) -> None:
        if queue not in self._unreachable:
            self._unreachable.add(queue)
            log.warning(
                "queue %s is unreachable (its node or queue process is down); trying it "
                "every %.0f s",
                queue,
                UNREACHABLE_BACKOFF_S,
            )

    def _note_reachable(self, queue: str) -> None:
        if queue in self._unreachable:
            self._unreachable.discard(queue)
            log.info("queue %s is reachable again", queue)

    def _capacity(self) -> int:
        """The most queues this worker may hold: its setting, within what its connection's
        channels allow."""
        cap = self._settings.max_held_queues
        return self._link.capacity if cap is None else min(cap, self._link.capacity)

    def _request_surplus_release(self, held: set[str], surplus: int) -> None:
        with self._requests_lock:
            pending = sum(1 for reason in self._release_requests.values() if reason == "rebalance")
            wanted = surplus - pending
            if wanted <= 0:
                return
            spare = sorted(
                (q for q in held if q not in self._release_requests), key=self._buffer.depth
            )
            for queue in spare[:wanted]:
                self._release_requests[queue] = "rebalance"

    def _release_idle(self) -> None:
        limit = self._settings.idle_release_ms / 1000
        now = time.monotonic()
        idle = []
        for item in self._holdings.all():
            last = self._buffer.last_arrival(item.queue) or item.since
            if now - max(last, item.since) >= limit and self._buffer.depth(item.queue) == 0:
                idle.append(item.queue)
        if idle:
            with self._requests_lock:
                for queue in idle:
                    self._release_requests.setdefault(queue, "idle")

    def _probe_idle(self, held: set[str]) -> None:
        """Look into a few idle unheld queues: one with messages is made active again, so
        a backlog left while no worker ran is never stranded."""
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
        for queue in sample:
            if holders[queue] is not None:
                continue
            depth = self._link.message_count(queue)
            if depth:
                self._registry.touch([queue])
                self._view.activity[queue] = now_ms()
                self._more_to_claim = True  # claimed next tick, not at the next scan

    def _reap_dead_peers(self) -> bool:
        """Release the locks of members whose Redis connections are all gone (a killed
        process): only after two ticks in a row, so a reconnecting peer is not reaped."""
        if not self._client_list_ok:
            return False
        try:
            # The server holding the stream's keys: every live worker has a connection there.
            server = node_client(self._client, self._keys.members)
            names = {str(c.get("name", "")) for c in server.client_list()}
        except FAILING_OVER:
            return False  # the stream's primary is failing over: look again next tick
        except redis.exceptions.ResponseError:
            self._client_list_ok = False  # no CLIENT permission: fall back to lock ttls
            log.info("CLIENT LIST not permitted; dead workers are detected by ttl only")
            return False
        missing = {
            m
            for m in self._membership.alive()
            if m != self._worker_id and client_name(m) not in names
        }
        confirmed = missing & self._missing_once
        self._missing_once = missing
        if not confirmed:
            return False
        queues = list(self._view.activity)
        holders = self._locks.holders(queues) if queues else {}
        for dead in confirmed:
            leases: list[Lease] = [
                lease for lease in holders.values() if lease is not None and lease.owner == dead
            ]
            released = self._locks.release(leases)
            self._membership.leave(dead)
            self.stats.peers_reaped += 1
            log.warning("worker %s is gone: released its %d locks", dead, released)
        return True
