"""``keyq``: one command for producing, inspecting and (later) running keyq's daemons.

Errors are printed in one line without a traceback, with exit codes scripts can rely on:
0 ok, 1 a runtime failure (service down, timeout), 2 bad usage or configuration.
"""

from __future__ import annotations

import sys
from typing import Any

import click
import orjson

from broker.errors import ConfigurationError, InvalidInput, KeyqError
from broker.settings import Settings, load_settings
from producer import Producer

EXIT_FAILURE = 1
EXIT_USAGE = 2


def _fail(exc: KeyqError) -> None:
    code = EXIT_USAGE if isinstance(exc, (ConfigurationError, InvalidInput)) else EXIT_FAILURE
    click.echo(f"keyq: {exc}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "KEYQ"})
@click.version_option(package_name="keyq")
def cli() -> None:
    """Keyed event streams on RabbitMQ: per-key queues, one worker per key at a time."""


@cli.command("settings")
def show_settings() -> None:
    """Print the effective settings (from KEYQ_* variables) as JSON, without passwords."""
    try:
        settings: Settings = load_settings()
    except KeyqError as exc:
        _fail(exc)
    click.echo(orjson.dumps(settings.describe(), option=orjson.OPT_INDENT_2).decode())


@cli.command("publish")
@click.option("--stream", required=True, help="Stream name.")
@click.option("--key", "keys", multiple=True, required=True, help="Key; repeat for several.")
@click.option("--event", "event_json", required=True, help="The event as a JSON object.")
@click.option("--mode", type=click.Choice(["key", "bucket"]), default=None)
@click.option("--buckets", type=int, default=None)
def publish(
    stream: str, keys: tuple[str, ...], event_json: str, mode: str | None, buckets: int | None
) -> None:
    """Publish one JSON event to each given key and wait until RabbitMQ confirmed them."""
    try:
        event: Any = orjson.loads(event_json)
    except orjson.JSONDecodeError as exc:
        click.echo(f"keyq: --event is not valid JSON: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    try:
        with Producer(stream, mode=mode, buckets=buckets) as producer:
            receipts = [producer.publish(key, event) for key in keys]
    except KeyqError as exc:
        _fail(exc)
    for receipt in receipts:
        click.echo(f"{receipt.key}\t{receipt.queue}\tseq={receipt.seq}")


def main() -> None:
    cli()
