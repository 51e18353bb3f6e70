"""``keyq console``: the web page for operating keys (``keyq.console``), served by uvicorn."""

from __future__ import annotations

import click

from keyq.cli.checks import stream_name
from keyq.cli.errors import OneLineCommand

DEFAULT_PORT = 8089


@click.command("console", cls=OneLineCommand)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on. Beyond loopback it needs KEYQ_CONSOLE_TOKEN or "
    "KEYQ_CONSOLE_BASIC_AUTH (user:password).",
)
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    help="A name browsers reach a guarded console by (beyond loopback names and --host); "
    "repeat. Requests addressed to any other name are refused.",
)
@click.option("--read-only", is_flag=True, help="Show everything, offer and accept no action.")
@click.option(
    "--stream",
    "streams",
    multiple=True,
    callback=stream_name,
    help="Stream to show; repeat. Default: every stream in Redis.",
)
@click.option(
    "--log-level",
    type=click.Choice(("debug", "info", "warning", "error"), case_sensitive=False),
    default="info",
    show_default=True,
)
def console_command(
    *,
    host: str,
    port: int,
    allowed_hosts: tuple[str, ...],
    read_only: bool,
    streams: tuple[str, ...],
    log_level: str,
) -> None:
    """Serve the keyq console: streams, workers and the janitor live; a key's whole picture
    with pause, resume, redrive and skip; dead letters paged, shown whole, redriven, edited or
    dropped; stream policy; an audit list of every action taken."""
    import uvicorn  # noqa: PLC0415 - keeps the other commands' startup light

    from keyq.broker.settings import load_settings  # noqa: PLC0415
    from keyq.cli.daemons import configure_logging  # noqa: PLC0415
    from keyq.console.access import Access  # noqa: PLC0415
    from keyq.console.app import create_app  # noqa: PLC0415
    from keyq.console.settings import ConsoleSettings  # noqa: PLC0415

    settings = load_settings(ConsoleSettings)
    access = Access.from_settings(settings, host, read_only=read_only, allowed_hosts=allowed_hosts)
    configure_logging(log_level, "-", "console")
    app = create_app(settings, access, list(streams))
    mode = "read-only" if read_only else "actions on"
    guard = "password required" if access.guarded else "open to loopback"
    click.echo(f"keyq console on http://{host}:{port}/ ({mode}, {guard})", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), log_config=None)
