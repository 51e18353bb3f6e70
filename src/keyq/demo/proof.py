"""What the demo measures and proves from the data in Redis: publish-to-commit latency of a
sample of orders, the moment every order is committed, and the verdict (lost, applied twice,
reordered) from each order's committed state and marks.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import orjson

from keyq.worker.batch.state_store import StateStore


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def latency_ms(latencies: list[float]) -> dict[str, int | None]:
    """The 50th, 95th and 99th percentiles of publish-to-commit latency, in ms."""
    return {
        name: None if value is None else round(value * 1000)
        for name, value in (
            ("p50", percentile(latencies, 0.50)),
            ("p95", percentile(latencies, 0.95)),
            ("p99", percentile(latencies, 0.99)),
        )
    }


def watch_latency(
    store: StateStore,
    sample: set[str],
    sent: dict[tuple[str, int], float],
    latencies: list[float],
    stop: threading.Event,
) -> None:
    """Publish-to-commit latency of a sample of orders, until ``stop``: poll their marks and
    note when each sent seq is first seen applied."""
    applied: dict[str, int] = dict.fromkeys(sample, 0)
    orders = sorted(sample)
    while not stop.is_set():
        now = time.monotonic()
        marks = store.marks(orders)
        for order in orders:
            top = max(marks[order].seqs.values(), default=0)
            for seq in range(applied[order] + 1, top + 1):
                at = sent.get((order, seq))
                if at is not None:
                    latencies.append(now - at)
            applied[order] = max(applied[order], top)
        time.sleep(0.05)


def wait_drained(
    store: StateStore, counts: dict[str, int], started: float, timeout: float
) -> float | None:
    """Seconds from ``started`` until every order has all its events applied; None if that
    took over ``timeout`` seconds from now."""
    orders = sorted(counts)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = store.states(orders)
        done = sum(
            1 for order in orders if order in states and _applied(states[order]) >= counts[order]
        )
        if done == len(orders):
            return time.monotonic() - started
        time.sleep(0.25)
    return None


def verdict(store: StateStore, expected: dict[str, Any], counts: dict[str, int]) -> dict[str, Any]:
    """Lost, applied twice, reordered: from each order's committed state and marks."""
    orders = sorted(counts)
    raw = store.states(orders)
    marks = store.marks(orders)
    lost = twice = reordered = 0
    wrong: list[str] = []
    for order in orders:
        state = None if order not in raw else orjson.loads(raw[order])
        applied = 0 if state is None else int(state["events_applied"])
        lost += max(0, counts[order] - applied)
        twice += max(0, applied - counts[order])
        if applied == counts[order] and state != expected.get(order):
            reordered += 1
        if state != expected.get(order):
            wrong.append(order)
        if marks[order].applied not in (0, applied):
            twice += abs(marks[order].applied - applied)
    return {
        "lost": lost,
        "applied_twice": twice,
        "reordered": reordered,
        "orders_checked": len(orders),
        "orders_wrong": wrong[:20],
        "ok": lost == twice == reordered == 0 and not wrong,
    }


def _applied(raw: str) -> int:
    return int(orjson.loads(raw).get("events_applied", 0))
