"""The ``keyq status`` command: options, one snapshot or ``--watch``, exit codes."""

from __future__ import annotations

import shutil
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import click
import orjson

from keyq.broker.errors import ConfigurationError, InvalidInput, KeyqError
from keyq.broker.settings import load_settings
from keyq.status_rows import add_rates
from keyq.status_table import PIPE_WIDTH, render_table

if TYPE_CHECKING:
    from keyq.status import StatusReader

EXIT_FAILURE = 1
EXIT_USAGE = 2


def _fail(exc: KeyqError) -> NoReturn:
    code = EXIT_USAGE if isinstance(exc, (ConfigurationError, InvalidInput)) else EXIT_FAILURE
    click.echo(f"keyq: {exc}", err=True)
    sys.exit(code)


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


@click.command("status")
@click.option("--stream", required=True, help="Stream name.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option(
    "--watch",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="Refresh every SECONDS until Ctrl-C; with --json, one JSON object per line.",
)
def status_command(stream: str, as_json: bool, watch: float | None) -> None:
    """Show a stream's queues (depth, owner, idle time), live workers and dead letters."""
    # keyq.status imports this module to re-export the command: its reader comes in here.
    from keyq.status import StatusReader  # noqa: PLC0415

    try:
        reader = StatusReader(load_settings(), stream)
    except KeyqError as exc:
        _fail(exc)
    try:
        if watch is None:
            _show(reader.collect(), as_json, watching=False)
        else:
            _watch(reader, as_json, watch)
    except KeyqError as exc:
        reader.close()
        _fail(exc)
    except KeyboardInterrupt:
        pass  # Ctrl-C ends --watch; exit 0
    finally:
        reader.close()
