"""How every ``keyq`` command ends on an error: one line ``keyq: ...`` on stderr, no traceback,
and an exit code a script can rely on: 2 for bad usage, input or configuration (refused before
any service is contacted), 1 for a runtime failure (a service down, a timeout), 3 for a demo
whose verdict failed."""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import click

from keyq.broker.errors import ConfigurationError, InvalidInput, KeyqError

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_VERDICT = 3


def one_line(text: str) -> str:
    """``text`` with its lines joined: a message from a library may span several."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def exit_with(message: str, code: int) -> NoReturn:
    click.echo(f"keyq: {one_line(message)}", err=True)
    sys.exit(code)


def fail(exc: KeyqError) -> NoReturn:
    code = EXIT_USAGE if isinstance(exc, (ConfigurationError, InvalidInput)) else EXIT_FAILURE
    exit_with(str(exc), code)


def usage(message: str) -> NoReturn:
    """Bad usage that click's own checks do not catch (options that go together)."""
    exit_with(message, EXIT_USAGE)


def _click_failure(exc: click.ClickException) -> NoReturn:
    message = exc.format_message()
    if isinstance(exc, click.UsageError) and exc.ctx is not None:
        message = f"{message.rstrip('.')} (see {exc.ctx.command_path} --help)"
    exit_with(message, exc.exit_code)


class OneLineErrors(click.Command):
    """Ends usage errors (a missing, unknown or malformed option, an unknown command), the
    ``KeyqError``s a command lets through and an abort in one line each. Only the outermost
    command of a run catches: its subcommands' errors pass through its own ``invoke``."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.exceptions.NoArgsIsHelpError:
            raise  # the help text itself, as asked for
        except click.ClickException as exc:
            _click_failure(exc)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.ClickException as exc:
            _click_failure(exc)
        except KeyqError as exc:
            fail(exc)
        except (click.Abort, KeyboardInterrupt):
            exit_with("aborted", EXIT_FAILURE)


class OneLineCommand(OneLineErrors):
    """A command whose errors are one line each."""


class OneLineGroup(OneLineErrors, click.Group):
    """A group whose errors, and its commands' and subgroups', are one line each."""

    command_class = OneLineCommand
    group_class = type  # subgroups are OneLineGroups too
