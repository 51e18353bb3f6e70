"""The demo's chaos: while events are published, a step every few seconds kills a worker with
kill -9 (and maybe starts another), adds one or removes one, and times each failover until
the killed worker's queues are in live hands again.

A step that fails (a broker that does not answer, say) is logged and kept in the record with
why, and the next step goes on: a misbehaving service must not end the chaos, nor the
failovers it measures, in silence.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pika.exceptions
import redis

from keyq.broker.connections import describe_exception, open_blocking_connection
from keyq.broker.errors import KeyqError
from keyq.broker.locks import FencedLocks
from keyq.broker.membership import Membership
from keyq.broker.queue_probe import QueueProbe
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import Settings
from keyq.broker.urls import scrub
from keyq.demo.processes import Daemon

# Failures a chaos step meets when a service misbehaves: reported in one line, no traceback.
SERVICE_ERRORS: tuple[type[BaseException], ...] = (
    KeyqError,
    redis.exceptions.RedisError,
    pika.exceptions.AMQPError,
    OSError,
)
FAILOVER_LIMIT_S = 60  # a failover slower than this is not recorded

# The demo's own log, which its console shows above the progress bar.
log = logging.getLogger("keyq.demo")


@dataclass
class Chaos:
    """What the chaos thread did: kills, restarts, scale changes, and failover durations.
    A step that failed has ``failed`` (why) in its action."""

    actions: list[dict[str, Any]] = field(default_factory=list)
    failovers_s: list[float] = field(default_factory=list)

    @property
    def failed_steps(self) -> int:
        return sum(1 for action in self.actions if "failed" in action)

    def as_dict(self) -> dict[str, Any]:
        return {
            "actions": self.actions,
            "failovers_s": self.failovers_s,
            "failed_steps": self.failed_steps,
        }


class ChaosMonkey:
    """The chaos steps over the demo's workers, recorded in ``record``.

    The demo lends it what it needs of its workers: the ones serving now
    (``serving_workers``) and a way to start one more (``start_worker``).
    """

    def __init__(
        self,
        settings: Settings,
        stream: str,
        record: Chaos,
        *,
        seed: int,
        max_workers: int,
        pause_s: tuple[float, float],
        serving_workers: Callable[[Membership], list[Daemon]],
        start_worker: Callable[[], Daemon],
        stop: threading.Event,
        published: threading.Event,
    ) -> None:
        self.settings = settings
        self.stream = stream
        self.record = record
        self._seed = seed
        self._max_workers = max_workers
        self._pause_s = pause_s
        self._serving_workers = serving_workers
        self._start_worker = start_worker
        self._stop = stop
        self._published = published

    def run(self, client: redis.Redis) -> None:
        """A step every few seconds (drawn from ``pause_s``) until ``stop`` is set or every
        event is published."""
        rng = random.Random(self._seed)
        locks = FencedLocks(client, self.stream)
        registry = QueueRegistry(client, self.stream)
        members = Membership(client, self.stream, ttl_ms=1)
        while not self._stop.wait(rng.uniform(*self._pause_s)) and not self._published.is_set():
            action: dict[str, Any] = {"at": time.time(), "action": "choose"}
            try:
                self._step(rng, locks, registry, members, action)
            except Exception as exc:  # noqa: BLE001 - the chaos goes on whatever one step met
                self._failed(action, exc)

    def kill_one(self, client: redis.Redis) -> None:
        """One step, now: a serving worker killed with -9 (none while fewer than two serve),
        its failover timed. For runs that must meet the same fault at the same point."""
        rng = random.Random(self._seed)
        members = Membership(client, self.stream, ttl_ms=1)
        alive = self._serving_workers(members)
        if len(alive) < 2:
            return
        action: dict[str, Any] = {"at": time.time(), "action": "kill"}
        locks = FencedLocks(client, self.stream)
        try:
            self._kill(rng.choice(alive), locks, QueueRegistry(client, self.stream), action)
        except Exception as exc:  # noqa: BLE001 - reported as a failed step, as in run()
            self._failed(action, exc)

    def _step(
        self,
        rng: random.Random,
        locks: FencedLocks,
        registry: QueueRegistry,
        members: Membership,
        action: dict[str, Any],
    ) -> None:
        alive = self._serving_workers(members)
        choice = rng.choice(["kill", "kill", "restart", "add", "remove"])
        if len(alive) <= 1 and choice in ("kill", "restart", "remove"):
            choice = "add"  # never leave the stream without a serving worker
        action["action"] = choice
        if choice == "add" and len(alive) < self._max_workers:
            worker = self._start_worker()
            action["worker"] = worker.id
            self.record.actions.append(action)
        elif choice == "remove" and len(alive) > 1:
            victim = rng.choice(alive)
            action["worker"] = victim.id
            victim.stop()
            self.record.actions.append(action)
        elif alive and choice in ("kill", "restart"):
            self._kill(rng.choice(alive), locks, registry, action, restart=choice == "restart")

    def _kill(
        self,
        victim: Daemon,
        locks: FencedLocks,
        registry: QueueRegistry,
        action: dict[str, Any],
        *,
        restart: bool = False,
    ) -> None:
        """``victim`` killed with -9 (and another worker started if ``restart``), then the
        time until its queues are in live hands."""
        action.update(action="kill -9", worker=victim.id)
        queues = list(registry.queues())
        held = [
            q for q, lease in locks.holders(queues).items() if lease and lease.owner == victim.id
        ]
        victim.kill()
        killed_at = time.monotonic()
        action["held"] = len(held)
        self.record.actions.append(action)
        if restart:
            self._start_worker()
        if held:
            try:
                self._measure_failover(locks, victim.id, held, killed_at)
            except Exception as exc:  # noqa: BLE001 - the kill is done, its measure failed
                self._failed(action, exc, "failover not measured")

    def _failed(self, action: dict[str, Any], exc: Exception, what: str = "") -> None:
        """One line on why a chaos step failed, in the log and in the step's action."""
        expected = isinstance(exc, SERVICE_ERRORS)
        reason = scrub(
            str(exc) if isinstance(exc, KeyqError) else describe_exception(exc),
            self.settings.amqp_url,
        )
        action["failed"] = f"{what}: {reason}" if what else reason
        if not any(existing is action for existing in self.record.actions):
            self.record.actions.append(action)
        log.warning(
            "chaos step %s failed, going on with the next: %s",
            action["action"],
            action["failed"],
            exc_info=not expected,
        )

    def _measure_failover(
        self, locks: FencedLocks, dead: str, held: list[str], killed_at: float
    ) -> None:
        """Time until every queue the dead worker held is in live hands: held by another
        worker, or, with its lock gone, holding no message (a drained key-mode queue needs no
        holder until its key speaks again). Not recorded if it takes over a minute; raises
        what keeps it from being measured (a service that does not answer)."""
        pending = set(held)
        connection = open_blocking_connection(self.settings, "keyq-demo-failover")
        probe = QueueProbe(connection.channel)
        try:
            while time.monotonic() - killed_at < FAILOVER_LIMIT_S and not self._stop.is_set():
                for queue, lease in locks.holders(sorted(pending)).items():
                    taken_over = lease is not None and lease.owner != dead
                    # A queue that no longer exists (the janitor took it) holds nothing.
                    if taken_over or (lease is None and _ready(probe, queue) == 0):
                        pending.discard(queue)
                if not pending:
                    self.record.failovers_s.append(round(time.monotonic() - killed_at, 3))
                    return
                time.sleep(0.2)  # each look may declare hundreds of queues: not too often
        finally:
            with contextlib.suppress(Exception):  # a broken connection: dropped either way
                connection.close()


def _ready(probe: QueueProbe, queue: str) -> int:
    """Messages ready in ``queue``; 0 for one that no longer exists."""
    counts = probe.counts(queue)
    return 0 if counts is None else counts.ready
