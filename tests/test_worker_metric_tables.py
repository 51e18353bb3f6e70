"""The worker's metric tables, without a service: every number a worker reports is a metric
family or deliberately not one, and each family reads the field its name says."""

from __future__ import annotations

import dataclasses
import typing

from prometheus_client import CollectorRegistry, generate_latest

from keyq.broker.worker_report import WorkerReport
from keyq.worker.metrics import COUNTERS, GAUGES, UNEXPORTED, Figure, ReportCollector
from tests.scrapes import parse

FIGURES: tuple[Figure, ...] = (*COUNTERS, *GAUGES)


def numeric_fields() -> list[str]:
    """The report's int and float fields (an optional one included)."""
    hints = typing.get_type_hints(WorkerReport)
    numbers = {int, float, int | None, float | None}
    return [spec.name for spec in dataclasses.fields(WorkerReport) if hints[spec.name] in numbers]


def readers_of(field: str) -> list[str]:
    """The families whose value moves when ``field`` does."""
    base = WorkerReport(worker="w", stream="s")
    changes: dict[str, typing.Any] = {field: 7919}
    moved = dataclasses.replace(base, **changes)
    return [figure.name for figure in FIGURES if figure.read(moved) != figure.read(base)]


def test_every_reported_number_is_one_family_or_deliberately_not() -> None:
    fields = numeric_fields()
    assert "events" in fields and "oldest_gap_s" in fields and "pid" in fields
    uncovered = [f for f in fields if f not in UNEXPORTED and not readers_of(f)]
    assert not uncovered, f"add a metric family for {uncovered}, or say in UNEXPORTED why not"
    both = [f for f in UNEXPORTED if readers_of(f)]
    assert not both, f"{both} are exported yet listed in UNEXPORTED"
    assert set(UNEXPORTED) <= set(fields), "UNEXPORTED names a field the report does not have"
    # Each family reads one field, no two read the same, and counters are totals.
    read_by = {
        figure.name: [f for f in fields if figure.name in readers_of(f)] for figure in FIGURES
    }
    assert all(len(read) == 1 for read in read_by.values()), read_by
    assert len({read[0] for read in read_by.values()}) == len(FIGURES)
    assert read_by["keyq_worker_events_processed_total"] == ["events"]
    assert read_by["keyq_worker_releases_total"] == ["released"]
    assert read_by["keyq_worker_start_time_seconds"] == ["started_ms"]
    names = [figure.name for figure in FIGURES]
    assert len(set(names)) == len(names)
    assert all(figure.name.endswith("_total") for figure in COUNTERS)
    assert not any(figure.name.endswith("_total") for figure in GAUGES)
    assert all(figure.help.endswith(".") for figure in FIGURES)


def test_the_families_carry_the_report_s_values_and_labels() -> None:
    report = WorkerReport(
        worker="w-1", stream="orders", events=42, spark_seconds=1.25, held=3, started_ms=1500
    )
    registry = CollectorRegistry()
    registry.register(ReportCollector(lambda: report))
    text = generate_latest(registry).decode()
    families = parse(text)
    assert list(families) == [f.name for f in FIGURES]
    labels = {"stream": "orders", "worker": "w-1"}
    for family in families.values():
        [(_name, sample_labels, _value)] = family.samples
        assert sample_labels == labels
    values = {name: family.samples[0][2] for name, family in families.items()}
    assert values["keyq_worker_events_processed_total"] == 42
    assert values["keyq_worker_spark_seconds_total"] == 1.25
    assert values["keyq_worker_queues_held"] == 3
    assert values["keyq_worker_start_time_seconds"] == 1.5
    assert values["keyq_worker_batches_total"] == 0
    assert 'keyq_worker_events_processed_total{stream="orders",worker="w-1"} 42.0' in text
