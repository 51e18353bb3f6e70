"""How an operator command ends on an error: one line ``keyq: ...`` on stderr, exit 2 for bad
usage or input, 1 for a runtime failure."""

from __future__ import annotations

import sys
from typing import NoReturn

import click

from keyq.broker.errors import ConfigurationError, InvalidInput, KeyqError

EXIT_FAILURE = 1
EXIT_USAGE = 2


def fail(exc: KeyqError) -> NoReturn:
    code = EXIT_USAGE if isinstance(exc, (ConfigurationError, InvalidInput)) else EXIT_FAILURE
    click.echo(f"keyq: {exc}", err=True)
    sys.exit(code)


def usage(message: str) -> NoReturn:
    """Bad usage that click's own checks do not catch (options that go together)."""
    click.echo(f"keyq: {message}", err=True)
    sys.exit(EXIT_USAGE)


class OneLineCommand(click.Command):
    """A command whose usage errors (a missing or malformed option) are one line, exit 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            usage(exc.format_message())


class OneLineGroup(click.Group):
    """A group whose commands are ``OneLineCommand``s."""

    command_class = OneLineCommand

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            usage(exc.format_message())

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            usage(exc.format_message())
