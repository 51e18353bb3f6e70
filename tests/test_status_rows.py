"""``keyq status``'s rows built from parsed heartbeats, without a service: the JSON a worker
row shows for a report, for a report of an older worker, and for no report at all."""

from __future__ import annotations

from typing import Any

import orjson

from keyq.broker.worker_report import GapReport, WorkerReport
from keyq.cli.status import render_table
from keyq.ops.status import add_rates, deepest_first, queue_row, worker_row

FULL_ROW = {
    "worker": "w",
    "heartbeat_age_ms": 2_000,
    "held": 2,
    "events": 42,
    "batches": 7,
    "dead_lettered": 1,
    "waiting": 3,
    "gaps_open": 1,
    "gaps_skipped": 2,
    "late": 1,
    "gaps": [{"key": "k", "producer": "p", "first": 3, "last": 5, "waited_s": 1.5}],
    "events_per_s": None,
    "host": "h",
    "pid": 99,
    "ready": True,
    "started_ms": 123,
}
ROW_KEYS = list(FULL_ROW)
COUNTS = ["events", "batches", "dead_lettered", "waiting", "gaps_open", "gaps_skipped", "late"]


def row_of(raw: str | None, *, held: int = 0) -> dict[str, Any]:
    """The row of worker ``w`` of stream ``s``, whose heartbeat ``raw`` is 2 s old."""
    report = WorkerReport.parse(raw, worker="w", stream="s")
    return worker_row("w", 10_000, now=7_000, ttl_ms=5_000, report=report, held=held)


def test_a_worker_row_shows_its_report_an_older_ones_defaults_and_none_for_no_report() -> None:
    fields = {name: FULL_ROW[name] for name in (*COUNTS, "ready", "started_ms", "host", "pid")}
    gaps = (GapReport(key="k", producer="p", first=3, last=5, waited_s=1.5),)
    report = WorkerReport(worker="w", stream="s", gaps=gaps, **fields)
    row = row_of(report.to_json(), held=2)
    assert list(row) == list(FULL_ROW)  # in this order
    assert row == FULL_ROW
    assert orjson.loads(orjson.dumps(row)) == row
    # An older worker's heartbeat: the defaults it did not write.
    row = row_of(orjson.dumps({"worker": "w", "events": 5, "host": "h", "pid": 1}).decode())
    assert row["events"] == 5 and row["batches"] == 0 and row["late"] == 0
    assert (row["host"], row["pid"], row["ready"]) == ("h", 1, False)
    # No report: the counts are None, and the age is never negative.
    for raw in (None, "", "{", "[1]", '"text"', "42"):
        row = row_of(raw, held=1)
        assert list(row) == ROW_KEYS
        assert all(row[count] is None for count in COUNTS), raw
        assert row["held"] == 1 and row["heartbeat_age_ms"] == 2_000
        assert row["gaps"] == [] and row["ready"] is False
        assert row["host"] is None and row["pid"] is None and row["started_ms"] is None
    row = worker_row("w", 20_000, now=7_000, ttl_ms=5_000, report=None, held=0)
    assert row["heartbeat_age_ms"] == 0  # a heartbeat from the future is no negative age


def test_queue_rows_sort_deepest_first_and_missing_last() -> None:
    rows = [
        queue_row("b", "kb", (1, 0), dead_letter=False),
        queue_row("ghost", "kg", None, dead_letter=False),
        queue_row("a", "ka", (1, 1), dead_letter=False),
        queue_row("deep", "kd", (9, 1), dead_letter=False),
    ]
    assert [row["name"] for row in sorted(rows, key=deepest_first)] == ["deep", "a", "b", "ghost"]
    ghost = rows[1]
    assert (ghost["depth"], ghost["consumers"], ghost["missing"]) == (None, None, True)


def snapshot(at_ms: int, events: int | None) -> dict[str, Any]:
    report = None if events is None else WorkerReport(worker="w", stream="s", events=events)
    row = worker_row("w", at_ms, now=at_ms, ttl_ms=1, report=report, held=0)
    return {"at_ms": at_ms, "workers": [row], "totals": {"events_per_s": None}}


def test_rates_come_from_the_growth_of_reported_events() -> None:
    later = add_rates(snapshot(3_000, 150), snapshot(1_000, 50))
    assert later["workers"][0]["events_per_s"] == 50.0
    assert later["totals"]["events_per_s"] == 50.0
    for before, after in ((50, 10), (None, 10), (50, None)):  # restarted, or no report
        unknown = add_rates(snapshot(3_000, after), snapshot(1_000, before))
        assert unknown["workers"][0]["events_per_s"] is None
        assert unknown["totals"]["events_per_s"] is None


def test_the_table_shows_a_worker_without_a_report_as_dashes() -> None:
    status = {
        "stream": "s",
        "broker": None,
        "mode": "key",
        "buckets": None,
        "dead_letter_queue": "s.dlq",
        "queues": [queue_row("s.dlq", None, (0, 0), dead_letter=True)],
        "workers": [row_of(None), row_of(WorkerReport(worker="w", stream="s").to_json())],
        "totals": {
            "queues": 0,
            "lag": 0,
            "dead_letter_depth": 0,
            "held": 0,
            "unheld": 0,
            "missing": 0,
            "workers": 2,
            "events_per_s": None,
        },
    }
    lines = render_table(status).splitlines()
    workers = [line.split() for line in lines if line.startswith("w ")]
    assert workers == [
        ["w", "2.0s", "ago", "0", "-", "-", "-", "-", "-:-"],
        ["w", "2.0s", "ago", "0", "0", "-", "0", "0", "-:-"],
    ]
    assert not any(line.startswith("sequence gaps") for line in lines)
