"""The ``keyq status`` command: options, one snapshot or ``--watch``, exit codes."""

from __future__ import annotations

import shutil
import sys
from typing import TYPE_CHECKING, Any

import click
import orjson

from keyq.broker.settings import load_settings
from keyq.cli_checks import POSITIVE, stream_name
from keyq.command_errors import OneLineCommand
from keyq.status_rows import add_rates
from keyq.status_table import PIPE_WIDTH, render_table

if TYPE_CHECKING:
    from keyq.status import StatusReader


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
    # keyq.status imports this module to re-export the command: its reader comes in here.
    from keyq.status import StatusReader  # noqa: PLC0415

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
