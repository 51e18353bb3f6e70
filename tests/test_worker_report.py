"""The heartbeat's record, ``WorkerReport``: what a worker writes is what a reader parses, and
a reader copes with what a worker of another version (or no worker) wrote."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
import pytest

from keyq.broker.worker_report import GapReport, WorkerReport

GAP = GapReport(key="order-1", producer="p-1", first=4, last=6, waited_s=1.5)
FULL = WorkerReport(
    worker="worker-a", stream="orders", ready=True, started_ms=1_700_000_000_000, held=3,
    batches=7, events=42, skipped=2, dead_lettered=1, commits_refused=1, commits_unreplicated=1,
    pipeline_failures=2, spark_seconds=12.5, last_spark_seconds=0.25,
    stage_seconds={"decode": 0.5, "apply": 1.0}, claims=5, lost=1, released=2, peers_reaped=1,
    reconnects=3, late=1, gaps_skipped=1, gap_reopens=2, waiting=4, gaps_open=1,
    oldest_gap_s=1.5, gaps=(GAP,), host="host-1", pid=4242,
)  # fmt: skip


def heartbeat(**fields: Any) -> str:
    """A heartbeat as Membership stores it: the report's plain form and host and pid."""
    return orjson.dumps(fields).decode()


@pytest.mark.parametrize("report", [FULL, WorkerReport(worker="w", stream="s")])
def test_a_report_survives_its_json(report: WorkerReport) -> None:
    assert WorkerReport.parse(report.to_json()) == report
    assert WorkerReport.parse(report.to_json().encode()) == report


def test_the_plain_form_is_json_ready_and_names_every_field() -> None:
    plain = FULL.to_dict()
    assert list(plain) == [spec.name for spec in dataclasses.fields(WorkerReport)]
    assert plain["gaps"] == [
        {"key": "order-1", "producer": "p-1", "first": 4, "last": 6, "waited_s": 1.5}
    ]
    assert orjson.loads(orjson.dumps(plain)) == plain


def test_a_report_keeps_the_host_and_pid_the_heartbeat_adds_and_other_versions_parse() -> None:
    """Membership writes host and pid, then the worker's plain report over them: a report
    that does not know them must not erase them (status showed no host for a live worker)."""
    report = WorkerReport(worker="w", stream="s", events=3)
    assert "host" not in report.to_dict() and "pid" not in report.to_dict()
    stored = orjson.dumps({"host": "host-1", "pid": 4242, **report.to_dict()})
    assert WorkerReport.parse(stored) == dataclasses.replace(report, host="host-1", pid=4242)
    # What an older worker did not write takes its default; a newer one's extras are ignored.
    parsed = WorkerReport.parse(heartbeat(worker="w", stream="s", events=9, host="h", pid=7))
    assert parsed == WorkerReport(worker="w", stream="s", events=9, host="h", pid=7)
    raw = heartbeat(**FULL.to_dict(), queue_bytes=123, mood="fine", stage_seconds_p99={"a": 1})
    assert WorkerReport.parse(raw) == FULL


WRONG_TYPES = {
    "events": ["42", 4.2, True, None], "spark_seconds": ["1.5", False], "ready": [1, "yes"],
    "host": [5], "pid": ["4242"], "stage_seconds": [[1, 2]], "gaps": [{"key": "k"}],
    "started_ms": [[1]],
}  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [(field, value) for field, values in WRONG_TYPES.items() for value in values],
)
def test_a_field_of_the_wrong_type_keeps_its_default(field: str, value: object) -> None:
    parsed = WorkerReport.parse(heartbeat(worker="w", stream="s", **{field: value}))
    assert parsed == WorkerReport(worker="w", stream="s")


def test_only_the_well_formed_stages_and_gaps_are_kept_and_a_whole_number_is_a_float() -> None:
    raw = heartbeat(
        worker="w",
        stream="s",
        spark_seconds=3,
        stage_seconds={"decode": 1, "apply": "slow", "commit": True, "ack": 0.5},
        gaps=[
            {"key": "k1", "producer": "p", "first": 1, "last": 2, "waited_s": 0.5},
            {"key": "k2", "first": 3},  # an older worker: only key and first
            {"key": "k3", "first": "1"},
            {"first": 1},
            "k4",
            {"key": "k5", "first": True},
        ],
    )
    parsed = WorkerReport.parse(raw)
    assert parsed is not None
    assert parsed.stage_seconds == {"decode": 1.0, "ack": 0.5}
    assert parsed.gaps == (
        GapReport(key="k1", producer="p", first=1, last=2, waited_s=0.5),
        GapReport(key="k2", producer="", first=3, last=3, waited_s=0.0),
    )
    assert parsed.spark_seconds == 3.0 and isinstance(parsed.spark_seconds, float)


@pytest.mark.parametrize(
    "raw", [None, "", "{", "not json", b"\xff\xfe", "[1, 2]", '"worker"', "42", "null", "{}"]
)
def test_what_is_no_report_is_none(raw: str | bytes | None) -> None:
    assert WorkerReport.parse(raw) is None


def test_a_record_keeps_the_identity_it_names_and_else_needs_the_reader_s() -> None:
    raw = heartbeat(ready=True, events=3, host="h")
    assert WorkerReport.parse(raw) is None
    assert WorkerReport.parse(raw, worker="w") is None
    assert WorkerReport.parse(raw, worker="w", stream="s") == WorkerReport(
        worker="w", stream="s", ready=True, events=3, host="h"
    )
    parsed = WorkerReport.parse(FULL.to_json(), worker="other", stream="elsewhere")
    assert parsed is not None and (parsed.worker, parsed.stream) == ("worker-a", "orders")
    wrong = heartbeat(worker=7, stream=["s"], events=1)
    assert WorkerReport.parse(wrong) is None
    assert WorkerReport.parse(wrong, worker="w", stream="s") == WorkerReport(
        worker="w", stream="s", events=1
    )
