"""The index of held queues: each with its fenced lease and its consumer's epoch (kept by
``keyq.worker.holding.held_queues.HeldQueues``, which owns their life cycle)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from keyq.broker.locks import Lease


@dataclass(frozen=True)
class Held:
    queue: str
    lease: Lease
    epoch: int
    since: float = field(default_factory=time.monotonic)
    # A consumer reopened wider than the settings' prefetch: its AMQP prefetch (messages).
    prefetch: int | None = None


class Holdings:
    """Thread-safe map of held queues, shared by the claim loop and the batch loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, Held] = {}

    def add(self, held: Held) -> None:
        with self._lock:
            self._held[held.queue] = held

    def remove(self, queue: str, epoch: int | None = None) -> Held | None:
        """Forget ``queue`` (only if it is still that epoch, when one is given)."""
        with self._lock:
            held = self._held.get(queue)
            if held is None or (epoch is not None and held.epoch != epoch):
                return None
            return self._held.pop(queue)

    def get(self, queue: str) -> Held | None:
        with self._lock:
            return self._held.get(queue)

    def lease_for(self, queue: str, epoch: int) -> Lease | None:
        """The lease a delivery of that consumer epoch may be committed under, if any."""
        with self._lock:
            held = self._held.get(queue)
            return held.lease if held is not None and held.epoch == epoch else None

    def all(self) -> list[Held]:
        with self._lock:
            return list(self._held.values())

    def queues(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def __contains__(self, queue: object) -> bool:
        with self._lock:
            return queue in self._held
