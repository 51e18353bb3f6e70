"""Writes the producer's queues into the Redis registry off the publishing path.

A queue is registered (and announced to workers) once the broker confirmed its first event,
which proves the declaration happened; queues that keep receiving events are touched about
once a second so the janitor sees them as active. Redis outages are retried, never dropped.
"""

from __future__ import annotations

import logging
import threading
import time

from broker.connections import redis_errors
from broker.errors import KeyqError
from broker.registry import QueueRegistry

log = logging.getLogger("keyq.producer")

TOUCH_EVERY_S = 1.0


class Registrar:
    """Background thread batching registrations and activity touches."""

    def __init__(self, registry: QueueRegistry, redis_url: str) -> None:
        self._registry = registry
        self._redis_url = redis_url
        self._lock = threading.Condition()
        self._new: dict[str, str | None] = {}
        self._active: set[str] = set()
        self._in_progress = 0
        self._stop = False
        self._thread = threading.Thread(
            target=self._run, name="keyq-producer-registry", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def add_new(self, queues: dict[str, str | None]) -> None:
        with self._lock:
            self._new.update(queues)
            self._lock.notify_all()

    def add_active(self, queues: set[str]) -> None:
        with self._lock:
            self._active |= queues

    def pending(self) -> int:
        """Queues confirmed but not yet registered."""
        with self._lock:
            return len(self._new) + self._in_progress

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._new or self._in_progress:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
        return True

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        last_touch = time.monotonic()
        failures = 0
        while True:
            with self._lock:
                if not self._new and not self._stop:
                    self._lock.wait(TOUCH_EVERY_S)
                if self._stop and not self._new:
                    return
                new, self._new = self._new, {}
                self._in_progress = len(new)
                touch_due = time.monotonic() - last_touch >= TOUCH_EVERY_S
                active: set[str] = set()
                if touch_due:
                    active, self._active = self._active, set()
            try:
                with redis_errors(self._redis_url):
                    self._registry.register(new)
                    if active:
                        self._registry.touch(active - set(new))
                failures = 0
                if touch_due:
                    last_touch = time.monotonic()
            except KeyqError as exc:
                failures += 1
                log.warning("cannot register %d queues yet (%s); retrying", len(new), exc)
                with self._lock:
                    new.update(self._new)
                    self._new = new
                    self._active |= active
                    stopping = self._stop
                if stopping and failures >= 3:
                    return
                time.sleep(min(0.1 * 2**failures, 2.0))
            finally:
                with self._lock:
                    self._in_progress = 0
                    self._lock.notify_all()
