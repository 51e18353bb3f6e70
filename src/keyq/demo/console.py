"""The demo's face: a progress bar while publishing, then a summary and the verdict."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from keyq.broker.settings import load_settings
from keyq.demo.runner import Demo, DemoOptions


def run_demo(options: DemoOptions, *, as_json: bool) -> bool:
    """Run the demo; True when the verdict is clean."""
    console = Console(stderr=True)
    with (
        _demo_log_on(console),
        Progress(
            TextColumn("publishing"),
            BarColumn(),
            TextColumn("{task.completed:,}/{task.total:,} events"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,  # in a log or a pipe, a bar is only noise
        ) as bar,
    ):
        task = bar.add_task("publish", total=options.events)
        demo = Demo(
            load_settings(),
            options,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
            say=console.print,
        )
        summary = demo.run()
    if as_json:
        print(orjson.dumps(summary).decode())
    else:
        Console().print(_table(summary))
    return bool(summary["verdict"]["ok"])


@contextmanager
def _demo_log_on(console: Console) -> Iterator[None]:
    """The demo's own log lines (a chaos step that failed, say) on the console, above the
    progress bar, for as long as the demo runs."""
    demo_log = logging.getLogger("keyq.demo")
    handler = RichHandler(console=console, show_path=False, show_time=False)
    handler.setLevel(logging.INFO)
    demo_log.addHandler(handler)
    before = demo_log.propagate, demo_log.level
    demo_log.propagate = False
    demo_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        demo_log.removeHandler(handler)
        demo_log.propagate, demo_log.level = before


def _table(summary: dict[str, Any]) -> Table:
    verdict = summary["verdict"]
    latency = summary["latency_ms"]
    failovers = summary["chaos"]["failovers_s"]
    actions = len(summary["chaos"]["actions"])
    failed = summary["chaos"]["failed_steps"]
    layout = summary["mode"] + (f", {summary['buckets']} buckets" if summary["buckets"] else "")
    table = Table(title=f"keyq demo — stream {summary['stream']}", show_header=False)
    rows = [
        ("events / orders", f"{summary['events']:,} / {summary['orders']:,}"),
        ("mode / queue type", f"{layout} / {summary['queue_type']}"),
        ("publish rate", f"{summary['publish_events_per_s']:,} events/s"),
        ("end to end", f"{summary['end_to_end_events_per_s'] or '—'} events/s"),
        ("latency p50 / p95 / p99", f"{latency['p50']} / {latency['p95']} / {latency['p99']} ms"),
        ("chaos actions", f"{actions} ({failed} failed)" if failed else str(actions)),
        ("failovers", ", ".join(f"{s:.2f}s" for s in failovers) or "—"),
        ("queues created / left", f"{summary['queues_created']:,} / {summary['queues_left']:,}"),
        ("lost", str(verdict["lost"])),
        ("reordered", str(verdict["reordered"])),
        ("applied twice", str(verdict["applied_twice"])),
        ("verdict", "OK" if verdict["ok"] else "FAILED"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table
