"""Queues the claim loop asks the batch loop to hand back at a batch boundary (a surplus over
this worker's fair share, or idle ones in key mode), and the ones handed back lately, which
this worker leaves alone for a while so that a peer can take them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from keyq.worker.amqp.deliveries import DeliveryBuffer
from keyq.worker.holding.held_index import Held

# After handing a queue over, do not take it back at once: let a peer have it.
RELEASE_COOLDOWN_S = 3.0


class HandBacks:
    """Asked for by the claim loop's thread, taken and done by the batch loop's."""

    def __init__(self, buffer: DeliveryBuffer) -> None:
        self._buffer = buffer
        self._lock = threading.Lock()
        self._requests: dict[str, str] = {}  # queue -> "rebalance" | "idle"
        self._cooldown_until: dict[str, float] = {}

    def take(self) -> dict[str, str]:
        """The hand-backs asked for since the last call (queue -> reason)."""
        with self._lock:
            requests, self._requests = self._requests, {}
            return requests

    def ask_surplus(self, held: set[str], surplus: int) -> None:
        """Ask for ``surplus`` queues back for a rebalance: the least busy first, counting
        those asked for already."""
        with self._lock:
            pending = sum(1 for reason in self._requests.values() if reason == "rebalance")
            wanted = surplus - pending
            if wanted <= 0:
                return
            spare = sorted((q for q in held if q not in self._requests), key=self._buffer.depth)
            for queue in spare[:wanted]:
                self._requests[queue] = "rebalance"

    def ask_idle(self, held: Iterable[Held], idle_after_s: float) -> None:
        """Ask for the held queues that have had nothing to do for ``idle_after_s``."""
        now = time.monotonic()
        idle = []
        for item in held:
            last = self._buffer.last_arrival(item.queue) or item.since
            if now - max(last, item.since) >= idle_after_s and self._buffer.depth(item.queue) == 0:
                idle.append(item.queue)
        if idle:
            with self._lock:
                for queue in idle:
                    self._requests.setdefault(queue, "idle")

    def handed_back(self, queues: Iterable[str]) -> None:
        until = time.monotonic() + RELEASE_COOLDOWN_S
        with self._lock:
            for queue in queues:
                self._cooldown_until[queue] = until

    def cooling(self, queue: str, now: float) -> bool:
        """Handed back lately: left for a peer to take."""
        return self._cooldown_until.get(queue, 0) > now
