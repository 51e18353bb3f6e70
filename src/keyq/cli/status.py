"""``keyq status``: options, one snapshot or ``--watch``, exit codes; and the snapshot for
people: a header of totals, the deepest queues, the live workers and their sequence gaps, in
plain text that stays greppable in a pipe. The reading is ``keyq.ops.status``'s.
"""

from __future__ import annotations

import io
import shutil
import sys
from typing import Any, cast

import click
import orjson
from rich import box
from rich.console import Console
from rich.table import Table

from keyq.broker.fd_usage import FdUsage
from keyq.broker.settings import load_settings
from keyq.cli.checks import POSITIVE, stream_name
from keyq.cli.errors import OneLineCommand
from keyq.ops.status import StatusReader, add_rates

TABLE_LIMIT = 50
PIPE_WIDTH = 400  # output to a pipe or file is never wrapped, so names stay greppable


def _show(status: dict[str, Any], as_json: bool, *, watching: bool) -> None:
    if as_json:
        option = 0 if watching else orjson.OPT_INDENT_2
        click.echo(orjson.dumps(status, option=option).decode())
        return
    interactive = sys.stdout.isatty()
    width = shutil.get_terminal_size().columns if interactive else PIPE_WIDTH
    text = render_table(status, width=width)
    if watching and interactive:
        click.clear()
    click.echo(text, nl=False)
    if watching and not interactive:
        click.echo()


def _watch(reader: StatusReader, as_json: bool, every: float) -> None:
    """A snapshot every ``every`` seconds, each with the rates since the one before."""
    previous: dict[str, Any] | None = None
    while True:
        status = reader.collect()
        if previous is not None:
            add_rates(status, previous)
        _show(status, as_json, watching=True)
        previous = status
        reader.wait(every)


@click.command("status", cls=OneLineCommand)
@click.option("--stream", required=True, callback=stream_name, help="Stream name.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option(
    "--watch",
    type=POSITIVE,
    default=None,
    metavar="SECONDS",
    help="Refresh every SECONDS until Ctrl-C; with --json, one JSON object per line.",
)
def status_command(stream: str, as_json: bool, watch: float | None) -> None:
    """Show a stream's queues (depth, owner, idle time), live workers and dead letters."""
    reader = StatusReader(load_settings(), stream)
    try:
        if watch is None:
            _show(reader.collect(), as_json, watching=False)
        else:
            _watch(reader, as_json, watch)
    except KeyboardInterrupt:
        pass  # Ctrl-C ends --watch; exit 0
    finally:
        reader.close()


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
    _print_header(console, status)
    console.print()
    _print_queues(console, [row for row in status["queues"] if not row["dead_letter"]])
    console.print()
    if status["workers"]:
        _print_workers(console, status["workers"])
        _print_gaps(console, status["workers"])
    else:
        console.print("no live workers")
    _print_stranded(console, status.get("stranded") or [])
    console.print()
    console.print(
        f"dead-letter queue {status['dead_letter_queue']}: "
        f"{_depth(status['totals']['dead_letter_depth'])} messages"
    )
    text = cast(io.StringIO, console.file).getvalue()
    return "".join(line.rstrip() + "\n" for line in text.splitlines())


def _print_header(console: Console, status: dict[str, Any]) -> None:
    """The stream, its totals, its policy and the broker's file descriptors."""
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
    routes = status.get("routes")
    if routes is not None:
        by_why = ", ".join(f"{why} {count}" for why, count in routes["promotions"].items())
        console.print(
            f"promoted keys {routes['promoted_keys']}   open moves {routes['open_moves']}"
            f"   promotions {sum(routes['promotions'].values())}"
            + (f" ({by_why})" if by_why else "")
            + f"   demotions {routes['demotions']}"
        )
    if status.get("broker") is not None:
        fds = FdUsage.from_dict(status["broker"])
        console.print(f"broker file descriptors {fds.summary()}")
        warning = fds.warning()
        if warning is not None:
            console.print(f"WARNING: {warning}")


def _print_queues(console: Console, keyed: list[dict[str, Any]]) -> None:
    """The deepest ``TABLE_LIMIT`` keyed queues, each with its holder."""
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


def _print_workers(console: Console, rows: list[dict[str, Any]]) -> None:
    workers = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    workers.add_column("worker", overflow="fold")
    for title in ("heartbeat", "held", "events", "events/s", "batches", "dead-lettered"):
        workers.add_column(title, justify="right")
    workers.add_column("host", overflow="fold")
    for row in rows:
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


def _print_stranded(console: Console, stranded: list[dict[str, Any]]) -> None:
    """What the janitor's watchdog found waiting with no progress (``keyq inspect`` a key)."""
    if not stranded:
        return
    console.print()
    console.print(f"stranded keys {len(stranded)} (no progress; keyq inspect --key says why)")
    for row in stranded[:TABLE_LIMIT]:
        console.print(f"  {printable(row['key'])}: {row['reason']}", markup=False)


def _print_gaps(console: Console, workers: list[dict[str, Any]]) -> None:
    """Events deferred for a missing seq, and gaps given up: never unsaid."""
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
