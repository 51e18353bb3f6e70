"""The rows of ``keyq status``: one queue's or one worker's figures as plain JSON-ready data,
and the workers' event rates between two snapshots.

A worker's row reads its heartbeat through ``WorkerReport``; a worker whose heartbeat holds no
report (none written yet, or not one) shows None for every count rather than a made-up 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from keyq.broker.worker_report import WorkerReport


def queue_row(
    name: str, key: str | None, declared: tuple[int, int] | None, *, dead_letter: bool
) -> dict[str, Any]:
    """A queue's name, original key, (ready messages, consumers), or ``missing``."""
    return {
        "name": name,
        "key": key,
        "dead_letter": dead_letter,
        "depth": None if declared is None else declared[0],
        "consumers": None if declared is None else declared[1],
        "missing": declared is None,
    }


def deepest_first(row: dict[str, Any]) -> tuple[int, str]:
    """Sort key: the deepest queue first, a missing one after every existing one, then name."""
    depth = row["depth"]
    return (-depth if depth is not None else 1, row["name"])


def worker_row(
    worker: str,
    expiry: int,
    *,
    now: int,
    ttl_ms: int,
    report: WorkerReport | None,
    held: int,
) -> dict[str, Any]:
    """A live worker: its heartbeat's age (from its expiry), the locks it holds (``held``,
    counted from the locks, not from what it says) and what its report says."""
    return {
        "worker": worker,
        "heartbeat_age_ms": max(0, now - (expiry - ttl_ms)),
        "held": held,
        "events": None if report is None else report.events,
        "batches": None if report is None else report.batches,
        "dead_lettered": None if report is None else report.dead_lettered,
        "waiting": None if report is None else report.waiting,
        "gaps_open": None if report is None else report.gaps_open,
        "gaps_skipped": None if report is None else report.gaps_skipped,
        "late": None if report is None else report.late,
        "gaps": [] if report is None else [dataclasses.asdict(gap) for gap in report.gaps],
        "events_per_s": None,
        "host": None if report is None else report.host,
        "pid": None if report is None else report.pid,
        "ready": report is not None and report.ready,
        "started_ms": None if report is None else report.started_ms,
    }


def add_rates(current: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]:
    """Fill each worker's ``events_per_s`` from the growth of its ``events`` counter since
    ``previous`` (workers publish the counter with each heartbeat, so rates are approximate;
    a worker that is new or restarted keeps None)."""
    seconds = (current["at_ms"] - previous["at_ms"]) / 1000
    before = {row["worker"]: row["events"] for row in previous["workers"]}
    rates: list[float] = []
    for row in current["workers"]:
        then, now = before.get(row["worker"]), row["events"]
        if seconds > 0 and isinstance(then, int) and isinstance(now, int) and now >= then:
            row["events_per_s"] = round((now - then) / seconds, 1)
            rates.append(row["events_per_s"])
    current["totals"]["events_per_s"] = round(sum(rates), 1) if rates else None
    return current
