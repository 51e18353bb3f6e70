"""The producer's one Redis thread: publish leases and queue registrations, off the hot path.

Leases (see ``broker.retirement``) are asked for by the I/O thread before a queue's lease runs
out and granted here in batches, one script call per batch; the same call touches the queues'
activity, so the janitor sees them as active. A queue is registered (and announced to workers)
once the broker confirmed its first event, which proves the declaration happened. The same
thread keeps the producer's presence alive (``broker.producer_presence``). Redis outages are
retried with backoff, never dropped: events wait for their lease meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from keyq.broker.backoff import Backoff
from keyq.broker.connections import redis_errors
from keyq.broker.errors import KeyqError, PublishTimeout
from keyq.broker.producer_presence import ProducerPresence
from keyq.broker.registry import QueueRegistry
from keyq.broker.retirement import RetirementFence
from keyq.producer.route_follow import RouteFollower

log = logging.getLogger("keyq.producer")

LEASE_BATCH = 500
# Waits before trying Redis again after a failure: from 0.1 s, doubling up to 2 s, jittered.
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0
# Per base queue: its current incarnation if leased, None if being retired.
LeaseResults = Callable[[dict[str, int | None], float], None]


class Registrar:
    """Background thread granting leases and writing registrations."""

    def __init__(
        self,
        registry: QueueRegistry,
        fence: RetirementFence,
        redis_url: str,
        presence: tuple[ProducerPresence, str, int],
    ) -> None:
        self._registry = registry
        self._fence = fence
        self._redis_url = redis_url
        self._presence, self._producer_id, self._presence_ttl_ms = presence
        self._presence_due = 0.0  # renewed every third of its ttl
        self._lock = threading.Condition()
        self._new: dict[str, str | None] = {}
        self._leases: dict[str, str | None] = {}  # queue -> the key of its events, if one
        self._routes: RouteFollower | None = None
        self._in_progress = 0
        self._stop = False
        self._on_leases: LeaseResults | None = None
        self._thread = threading.Thread(target=self._run, name="keyq-producer-redis", daemon=True)

    def start(self, on_leases: LeaseResults) -> None:
        self._on_leases = on_leases
        self._thread.start()

    def add_new(self, queues: dict[str, str | None]) -> None:
        """Register these queues (their first event was confirmed)."""
        with self._lock:
            self._new.update(queues)
            self._lock.notify_all()

    def follow(self, routes: RouteFollower) -> None:
        """Auto mode: read the routes too, and lease own queues only while routed."""
        with self._lock:
            self._routes = routes
            self._lock.notify_all()

    def request_lease(self, queue: str, key: str | None) -> None:
        with self._lock:
            self._leases[queue] = key
            self._lock.notify_all()

    def wait_idle(self, deadline: float | None) -> None:
        """Block until every confirmed queue is registered, or raise ``PublishTimeout``."""
        with self._lock:
            while self._new or self._in_progress:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    pending = len(self._new) + self._in_progress
                    raise PublishTimeout(
                        f"flush timed out: {pending} queues not yet registered in Redis"
                    )
                self._lock.wait(remaining if remaining is not None else 1.0)

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        failures = 0
        delays = Backoff(RETRY_FIRST_S, RETRY_MAX_S)
        while True:
            with self._lock:
                while not (self._new or self._leases or self._stop):
                    wait = self._next_due() - time.monotonic()
                    if wait <= 0:
                        break
                    self._lock.wait(wait)
                if self._stop and not self._new:
                    return
                new, self._new = self._new, {}
                leases, self._leases = self._leases, {}
                self._in_progress = len(new)
            try:
                with redis_errors(self._redis_url):
                    if time.monotonic() >= self._presence_due:
                        self._renew_presence()
                    self._follow_routes()
                    self._grant(leases)
                    self._registry.register(new)
                failures = 0
                delays.reset()
            except KeyqError as exc:
                failures += 1
                log.warning(
                    "Redis unavailable for %d leases and %d registrations (%s); retrying",
                    len(leases),
                    len(new),
                    exc,
                )
                with self._lock:
                    new.update(self._new)
                    self._new = new
                    self._leases = {**leases, **self._leases}
                    stopping = self._stop
                if stopping and failures >= 3:
                    return
                time.sleep(delays.next())
            finally:
                with self._lock:
                    self._in_progress = 0
                    self._lock.notify_all()

    def _renew_presence(self) -> None:
        started = time.monotonic()
        self._presence.announce(self._producer_id, self._presence_ttl_ms)
        self._presence_due = started + self._presence_ttl_ms / 3000

    def _follow_routes(self) -> None:
        """Auto mode: the routes read and the switches settled, when due. What is not a
        service error (a route this producer cannot read) is logged: leases must go on."""
        routes = self._routes
        if routes is None or time.monotonic() < routes.due:
            return
        try:
            routes.step()
        except (KeyqError, redis.exceptions.RedisError, OSError):
            raise  # retried with the leases (``redis_errors``)
        except Exception:
            log.exception("reading the stream's routes failed; the last ones read stand")

    def _next_due(self) -> float:
        routes = self._routes
        return self._presence_due if routes is None else min(self._presence_due, routes.due)

    def _grant(self, leases: dict[str, str | None]) -> None:
        assert self._on_leases is not None
        queues = sorted(leases)
        routes = self._routes
        for start in range(0, len(queues), LEASE_BATCH):
            batch = queues[start : start + LEASE_BATCH]
            routed: dict[str, str] = {}
            if routes is not None:
                for queue in batch:
                    key = leases[queue]
                    needed = None if key is None else routes.routed_key(queue, key)
                    if needed is not None:
                        routed[queue] = needed
            issued_at = time.monotonic()  # before the check: the lease is never overstated
            self._on_leases(self._fence.lease(batch, routed), issued_at)
