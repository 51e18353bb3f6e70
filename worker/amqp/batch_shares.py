"""How one batch is shared among the queues a worker holds: half evenly, half oldest first.

An even share alone starves no queue, but a queue far behind the others (a dead worker's,
taken over; a bucket a hot key fills) then catches up only its share of a batch spread over
every queue held, a few dozen events a batch, while its prefetch would let it give hundreds:
that queue's oldest events set the longest wait. Oldest first alone would let one producer
whose clock runs behind, or a flood of old events, take every batch. Half of each then.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from keyq.broker.envelope import HEADER_REDRIVE_ID, published_at_ms

if TYPE_CHECKING:
    from keyq.worker.amqp.deliveries import Delivery


def batch_shares(
    queues: dict[str, deque[Delivery]],
    max_events: int,
    shared_cap: Callable[[str, int], int | None] | None = None,
) -> dict[str, int]:
    """How many to take from each queue, in ``queues``' order: half the batch (rounded up)
    shared evenly, so every queue is served within a cycle whatever its events say of their
    age, and the rest oldest event first. A queue with a ``shared_cap`` (told how many events
    the other queues have) gives, when other queues have events too, at most that many."""
    pending = [(queue, len(fifo)) for queue, fifo in queues.items() if fifo]
    if shared_cap is not None and len(pending) > 1:
        total = sum(ready for _, ready in pending)
        pending = [
            (queue, _capped(ready, shared_cap(queue, total - ready))) for queue, ready in pending
        ]
    quotas = _even_quotas(pending, max_events - max_events // 2)
    _add_oldest_first(queues, dict(pending), quotas, max_events - sum(quotas.values()))
    return quotas


def _even_quotas(pending: list[tuple[str, int]], budget: int) -> dict[str, int]:
    """Rounds of an even share of what is left of ``budget``, so a short queue leaves the
    rest of its share to the others. Each round but the last gives every queue still pending
    at least one, so this is O(queues + events)."""
    quotas: dict[str, int] = {}
    left = budget
    while left > 0 and pending:
        share = max(1, left // len(pending))
        still: list[tuple[str, int]] = []
        for queue, ready in pending:
            if left == 0:
                break
            quota = min(share, ready, left)
            quotas[queue] = quotas.get(queue, 0) + quota
            left -= quota
            if ready > quota:
                still.append((queue, ready - quota))
        pending = still
    return quotas


def _add_oldest_first(
    queues: dict[str, deque[Delivery]],
    limits: dict[str, int],
    quotas: dict[str, int],
    room: int,
) -> None:
    """Grow ``quotas`` by up to ``room`` events, the oldest next event of any queue first
    (each queue's taken events stay a prefix of it, so its order holds), to at most
    ``limits`` of a queue. A run of a queue's events no newer than every other queue's next
    is taken at once, each event's age read once: O(events + runs x log queues)."""
    if room <= 0:
        return
    age_of = _age_stamps(time.time() - time.monotonic())
    # (age of its next event, tie-break, queue, the rest of what it may give)
    heap: list[tuple[float, int, str, Iterator[Delivery]]] = []
    for order, (queue, limit) in enumerate(limits.items()):
        start = quotas.get(queue, 0)
        if limit > start:
            rest: Iterator[Delivery] = itertools.islice(queues[queue], start, limit)
            heap.append((age_of(next(rest)), order, queue, rest))
    heapq.heapify(heap)
    while room > 0 and heap:
        _age, order, queue, rest = heapq.heappop(heap)
        newer_than = heap[0][0] if heap else math.inf
        taken = 1
        room -= 1
        while room > 0:
            following = next(rest, None)
            if following is None:
                break
            age = age_of(following)
            if age > newer_than:
                heapq.heappush(heap, (age, order, queue, rest))
                break
            taken += 1
            room -= 1
        quotas[queue] = quotas.get(queue, 0) + taken


def _age_stamps(wall_offset_ms: float) -> Callable[[Delivery], float]:
    """When an event began to wait (ms since the epoch): its producer's publish time, but
    never after it arrived here (a clock running ahead), and its arrival for events not from
    the SDK and for redriven dead letters (put back now, however old their first publish:
    a redrive of old letters must not take the oldest half of every batch until it is done)."""

    def age_of(delivery: Delivery) -> float:
        arrived_ms = delivery.received_at * 1000 + wall_offset_ms
        published = published_at_ms(delivery.headers)
        if published is None or HEADER_REDRIVE_ID in delivery.headers:
            return arrived_ms
        return min(float(published), arrived_ms)

    return age_of


def _capped(ready: int, cap: int | None) -> int:
    return ready if cap is None else min(ready, cap)
