"""The cost of sequencing a batch by (producer, seq), against a plain duplicate check.

``python -m bench.sequencing [--out FILE]``: runs the worker's ``plan_batch`` on batches of
5,000 events (in order, and in a quorum queue's redelivery order) and, as the baseline in the
same run, the check the worker did before it sequenced: one mark comparison per event, in
delivery order. Pure Python, no services; medians of repeated runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.common import emit, median, ratio
from keyq.worker.batch.marks import KeyMarks
from keyq.worker.batch.sequencing import Identified, plan_batch

BATCH = 5000
KEYS = 200


def dedup_only(items: Sequence[Identified], marks: dict[str, KeyMarks]) -> int:
    """The baseline: skip what is at or below the mark, apply the rest as delivered."""
    current: dict[str, KeyMarks] = {}
    fresh = 0
    for item in items:
        key_marks = current.get(item.key)
        if key_marks is None:
            key_marks = current[item.key] = (marks.get(item.key) or KeyMarks()).copy()
        assert item.producer is not None and item.seq is not None
        if key_marks.seen(item.producer, item.seq):
            continue
        key_marks.advance(item.producer, item.seq)
        fresh += 1
    return fresh


def batch(reordered: bool) -> list[Identified]:
    per_key = BATCH // KEYS
    seqs = list(range(1, per_key + 1))
    if reordered:  # a cancelled consumer's first half handed back after the second
        half = per_key // 2
        seqs = seqs[half:] + seqs[:half]
    return [Identified(f"key-{k}", "producer-a", seq) for seq in seqs for k in range(KEYS)]


def timed(run: Callable[[], object], repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    found = median(seconds)
    assert found is not None
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    result: dict[str, Any] = {"benchmark": "sequencing", "batch": BATCH, "keys": KEYS}
    for name, reordered in (("in_order", False), ("quorum_redelivery_order", True)):
        items = batch(reordered)
        plan = plan_batch(items, {}, now=0.0, gap_timeout_s=60.0)
        assert len(plan.apply) == BATCH and not plan.deferred
        sequenced = timed(
            lambda i=items: plan_batch(i, {}, now=0.0, gap_timeout_s=60.0), args.repeats
        )
        baseline = timed(lambda i=items: dedup_only(i, {}), args.repeats)
        result[name] = {
            "plan_batch_ms": round(sequenced * 1000, 2),
            "dedup_only_ms": round(baseline * 1000, 2),
            "ratio": ratio(sequenced, baseline),
            "applied_by_dedup_only": dedup_only(items, {}),
        }
    emit(result, args.out)


if __name__ == "__main__":
    main()
