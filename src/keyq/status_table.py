"""``keyq status`` for people: the snapshot as a header of totals, the deepest queues, the live
workers and their sequence gaps, in plain text that stays greppable in a pipe.
"""

from __future__ import annotations

import io
from typing import Any, cast

from rich import box
from rich.console import Console
from rich.table import Table

from keyq.broker.fd_usage import FdUsage

TABLE_LIMIT = 50
PIPE_WIDTH = 400  # output to a pipe or file is never wrapped, so names stay greppable


def render_table(status: dict[str, Any], *, width: int = PIPE_WIDTH) -> str:
    """The status for people: a header with the totals, the deepest queues, the workers."""
    console = Console(
        file=io.StringIO(),
        width=width,
        color_system=None,
        force_terminal=False,
        highlight=False,
        markup=False,
        emoji=False,
    )
    totals = status["totals"]
    mode = status["mode"] + (f" ({status['buckets']} buckets)" if status["buckets"] else "")
    rate = totals["events_per_s"]
    console.print(f"stream {status['stream']}   mode {mode}")
    console.print(
        f"queues {totals['queues']} (held {totals['held']}, unheld {totals['unheld']}"
        + (f", missing {totals['missing']}" if totals["missing"] else "")
        + f")   lag {totals['lag']}   dead letters {_depth(totals['dead_letter_depth'])}"
        + f"   workers {totals['workers']}"
        + ("" if rate is None else f"   {rate} events/s")
    )
    policy = status.get("policy")
    if policy is not None:
        limit = policy["rate_limit"]
        console.print(
            f"poison policy {policy['poison_policy']}   rate limit "
            + ("none" if limit is None else f"{limit:g}/s per key")
            + f"   paused keys {policy['paused_keys']}   parked keys {policy['parked_keys']}"
            + ("   STREAM PAUSED" if policy["paused"] else "")
        )
    if status.get("broker") is not None:
        fds = FdUsage.from_dict(status["broker"])
        console.print(f"broker file descriptors {fds.summary()}")
        warning = fds.warning()
        if warning is not None:
            console.print(f"WARNING: {warning}")

    console.print()
    keyed = [row for row in status["queues"] if not row["dead_letter"]]
    queues = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    queues.add_column("queue", overflow="fold")
    queues.add_column("key", overflow="fold")
    for title in ("depth", "consumers"):
        queues.add_column(title, justify="right")
    queues.add_column("owner", overflow="fold")
    queues.add_column("token", justify="right")
    queues.add_column("idle", justify="right")
    for row in keyed[:TABLE_LIMIT]:
        owner = row["owner"]
        if owner is not None and not row["owner_alive"]:
            owner += " (not alive)"
        queues.add_row(
            row["name"],
            printable(row["key"]),
            _depth(row["depth"]),
            blank(row["consumers"]),
            owner or "-",
            blank(row["token"]),
            _duration(row["idle_ms"]),
        )
    console.print(queues)
    if len(keyed) > TABLE_LIMIT:
        console.print(f"… and {len(keyed) - TABLE_LIMIT} more queues")
    elif not keyed:
        console.print("no queues registered")

    console.print()
    if status["workers"]:
        workers = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        workers.add_column("worker", overflow="fold")
        for title in ("heartbeat", "held", "events", "events/s", "batches", "dead-lettered"):
            workers.add_column(title, justify="right")
        workers.add_column("host", overflow="fold")
        for row in status["workers"]:
            workers.add_row(
                row["worker"],
                _duration(row["heartbeat_age_ms"]) + " ago",
                str(row["held"]),
                blank(row["events"]),
                blank(row["events_per_s"]),
                blank(row["batches"]),
                blank(row["dead_lettered"]),
                f"{row['host'] or '-'}:{row['pid'] or '-'}",
            )
        console.print(workers)
        _print_gaps(console, status["workers"])
    else:
        console.print("no live workers")
    _print_stranded(console, status.get("stranded") or [])
    console.print()
    console.print(
        f"dead-letter queue {status['dead_letter_queue']}: "
        f"{_depth(totals['dead_letter_depth'])} messages"
    )
    text = cast(io.StringIO, console.file).getvalue()
    return "".join(line.rstrip() + "\n" for line in text.splitlines())


def _print_stranded(console: Console, stranded: list[dict[str, Any]]) -> None:
    """What the janitor's watchdog found waiting with no progress (``keyq inspect`` a key)."""
    if not stranded:
        return
    console.print()
    console.print(f"stranded keys {len(stranded)} (no progress; keyq inspect --key says why)")
    for row in stranded[:TABLE_LIMIT]:
        console.print(f"  {printable(row['key'])}: {row['reason']}", markup=False)


def _print_gaps(console: Console, workers: list[dict[str, Any]]) -> None:
    """Events held back for a missing seq, and gaps given up: never silent."""
    waiting = sum(row["waiting"] or 0 for row in workers)
    skipped = sum(row["gaps_skipped"] or 0 for row in workers)
    late = sum(row["late"] or 0 for row in workers)
    gaps = [dict(gap, worker=row["worker"]) for row in workers for gap in row["gaps"]]
    if not (waiting or skipped or late or gaps):
        return
    console.print(
        f"sequence gaps: {sum(row['gaps_open'] or 0 for row in workers)} open, {waiting} "
        f"events waiting; given up {skipped}, late arrivals dead-lettered {late}"
    )
    for gap in sorted(gaps, key=lambda gap: -float(gap.get("waited_s") or 0))[:TABLE_LIMIT]:
        console.print(
            f"  key {printable(str(gap['key']))} producer {gap.get('producer')}: waiting for "
            f"seq {gap['first']}..{gap.get('last')} for {gap.get('waited_s')}s "
            f"({gap['worker']})"
        )


def _depth(depth: int | None) -> str:
    return "missing" if depth is None else str(depth)


def blank(value: object) -> str:
    """A table cell: ``-`` for nothing."""
    return "-" if value is None else str(value)


def printable(key: str | None) -> str:
    """A key as a table shows it: as it is if printable, else its repr."""
    if key is None:
        return "-"
    return key if key.isprintable() else repr(key)


def _duration(ms: int | None) -> str:
    if ms is None:
        return "-"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"
