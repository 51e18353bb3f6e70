"""docs/reference.md, generated from the code: every setting, command, metric and exit code.

Written by ``python -m keyq.cli.reference docs/reference.md`` (without a path it prints); a test
regenerates it and fails when the file differs, so the reference cannot drift from the code.
The output depends on nothing but the code: no clock, environment, host or folder.
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import NoneType, SimpleNamespace, UnionType
from typing import TYPE_CHECKING, Any, Literal, Union, cast, get_args, get_origin

import annotated_types
import click
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from pydantic.fields import FieldInfo

from keyq.broker.fd_usage import FdUsage
from keyq.broker.settings import env_name
from keyq.broker.stream_figures import StreamFigures
from keyq.broker.worker_report import WorkerReport
from keyq.cli.errors import EXIT_FAILURE, EXIT_USAGE, EXIT_VERDICT
from keyq.cli.root import cli
from keyq.cli.settings import COMPONENTS
from keyq.janitor.config import JanitorSettings
from keyq.janitor.janitor import Janitor
from keyq.janitor.metrics import JanitorMetrics
from keyq.producer.metrics import ProducerMetrics
from keyq.producer.window import ConfirmWindow
from keyq.worker.metrics import WorkerMetrics

if TYPE_CHECKING:
    from keyq.worker.daemon import Worker

REGENERATE = "python -m keyq.cli.reference docs/reference.md"

EXIT_CODES: tuple[tuple[int, str], ...] = (
    (0, "success; a daemon stopped by SIGTERM or Ctrl-C after handing its work back"),
    (
        EXIT_FAILURE,
        "a runtime failure: a service down, credentials refused, a timeout, nothing found "
        "(`keyq state`, `keyq dlq`), or a daemon's shutdown that overran its time",
    ),
    (
        EXIT_USAGE,
        "bad usage, input or configuration, refused before any service is contacted: an "
        "unknown or missing option, a bad value, key, event or id, a pipeline that fails to "
        "import (named with its file and line); a bad setting is named by its environment "
        "variable (`keyq: KEYQ_METRICS_PORT: Input should be a valid integer…`). Found once "
        "Redis answers: a stream nothing has used yet, or one asked for in another mode",
    ),
    (EXIT_VERDICT, "`keyq demo`: some order's state differs from a plain fold of its events"),
)


def _cell(text: str) -> str:
    """Text that stays inside one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _code(value: object) -> str:
    return f"`{value}`"


def _symbolic(text: str) -> str:
    """A default that is this machine's (its name, a folder of it) as what it stands for."""
    if text == socket.gethostname():
        return "<host>"
    for folder, symbol in (
        (os.getcwd(), "<working directory>"),
        (tempfile.gettempdir(), "<temp dir>"),
        (str(Path.home()), "~"),
    ):
        if text == folder or text.startswith(folder + os.sep):
            return symbol + text[len(folder) :]
    return text


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows]
    return [*lines, ""]


# ------------------------------------------------------------------------------- settings

_TYPE_NAMES = {int: "integer", float: "number", str: "string", bool: "boolean", SecretStr: "secret"}


def _setting_type(field: FieldInfo) -> str:
    annotation: Any = field.annotation
    kinds = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    (kind,) = [each for each in kinds if each is not NoneType]
    if get_origin(kind) is Literal:
        text = "one of " + ", ".join(_code(choice) for choice in get_args(kind))
    else:
        text = _TYPE_NAMES[kind]
    low = high = ""
    for bound in field.metadata:
        if isinstance(bound, annotated_types.Ge | annotated_types.Gt):
            low = f"{bound.ge} ≤ " if isinstance(bound, annotated_types.Ge) else f"{bound.gt} < "
        if isinstance(bound, annotated_types.Le | annotated_types.Lt):
            high = f" ≤ {bound.le}" if isinstance(bound, annotated_types.Le) else f" < {bound.lt}"
    if low or high:
        text += f" ({low}x{high})"
    return text + (", or unset" if NoneType in kinds else "")


def _setting_rows(settings: type[Any], fields: list[str]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for name in fields:
        field: FieldInfo = settings.model_fields[name]
        if not field.description:
            raise ValueError(f"{settings.__name__}.{name} has no description for the reference")
        default = "unset" if field.default is None else _code(_symbolic(str(field.default)))
        rows.append((_code(env_name(name)), _setting_type(field), default, field.description))
    return rows


def settings_section() -> list[str]:
    lines = [
        "## Settings",
        "",
        "Each setting is read from its environment variable, else from a `.env` file in the "
        "working directory (`KEYQ_NAME=value` lines), else it takes its default. `keyq "
        "settings` prints the values in effect and where each came from (`--json` for "
        "scripts). A bad value stops a command or daemon with exit code 2 and one line that "
        "names the variable. The shared settings are read by every component; a worker and a "
        "janitor read their own on top of them.",
        "",
    ]
    for component in COMPONENTS:
        lines += [f"### {component.name.capitalize()}: read by the {component.readers}", ""]
        lines += _table(
            ("variable", "type", "default", "description"),
            _setting_rows(component.settings, component.fields()),
        )
    return lines


# ------------------------------------------------------------------------------- commands


def _walk(
    command: click.Command, name: str, parent: click.Context | None
) -> Iterator[click.Context]:
    ctx = click.Context(command, info_name=name, parent=parent)
    yield ctx
    if isinstance(command, click.Group):
        for child_name in sorted(command.list_commands(ctx)):
            child = command.get_command(ctx, child_name)
            if child is not None and not child.hidden:
                yield from _walk(child, child_name, ctx)


def _value(param: click.Parameter, ctx: click.Context) -> str:
    if isinstance(param, click.Option) and param.is_flag:
        return "flag"
    text = param.make_metavar(ctx)
    kind = param.type
    if isinstance(kind, (click.IntRange, click.FloatRange)):
        low = "" if kind.min is None else f"{kind.min} {'<' if kind.min_open else '≤'} "
        high = "" if kind.max is None else f" {'<' if kind.max_open else '≤'} {kind.max}"
        text += f" ({low}x{high})"
    return text + (", repeatable" if param.multiple else "")


def _default(param: click.Parameter, ctx: click.Context) -> str:
    default = param.get_default(ctx, call=False)
    if param.required or callable(default):
        return "required" if param.required else "computed"
    if isinstance(default, tuple | list) and default:
        return ", ".join(_code(_symbolic(str(each))) for each in default)
    if isinstance(default, str | int | float) and default is not False:
        return _code(_symbolic(str(default)))
    return "—"  # none, an unset flag, or click's own marker for "not given"


def _command_lines(ctx: click.Context) -> list[str]:
    command = ctx.command
    usage = " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)])
    lines = [f"### `{ctx.command_path}`", "", "```", usage, "```", ""]
    lines += [inspect.cleandoc(command.help or "").replace("\b\n", ""), ""]
    rows = [
        (
            ", ".join(_code(name) for name in [*param.opts, *param.secondary_opts]),
            _value(param, ctx),
            _default(param, ctx),
            getattr(param, "help", None) or "",
        )
        for param in command.get_params(ctx)
        if not getattr(param, "hidden", False) and "--help" not in param.opts
    ]
    if rows:
        lines += _table(("option", "value", "default", "help"), rows)
    return lines


def commands_section() -> list[str]:
    lines = [
        "## Commands",
        "",
        "Every command takes `-h`/`--help`. Options not given are read from "
        "`KEYQ_<COMMAND>_<OPTION>` variables too (`KEYQ_WORKER_STREAM`).",
        "",
    ]
    for ctx in _walk(cli, "keyq", None):
        lines += _command_lines(ctx)
    return lines


# -------------------------------------------------------------------------------- metrics


def _producer_rows() -> list[tuple[str, ...]]:
    registry = CollectorRegistry()
    meter = ProducerMetrics(registry).meter("stream")
    window = ConfirmWindow(1)
    meter.watch(window)  # held weakly: ``window`` lives on until the rows are read
    return _metric_rows(registry)


def _worker_registry() -> CollectorRegistry:
    report = WorkerReport(worker="worker", stream="stream")
    worker = SimpleNamespace(
        report=lambda: report,
        is_live=lambda: True,
        is_ready=lambda: True,
        stream="stream",
        worker_id="worker",
        batch_listeners=[],
    )
    return WorkerMetrics(cast("Worker", worker)).registry


def _janitor_registry() -> CollectorRegistry:
    janitor = Janitor(settings=JanitorSettings.model_construct(), janitor_id="janitor")
    janitor.fd_watch.latest = FdUsage(warn_ratio=0.8, used=1, limit=2, node="node")
    janitor.gauges.latest = {"stream": StreamFigures(0, 0, 0.0, 0, 0, 0)}
    janitor.watchdog.latest = {"stream": 0}
    return JanitorMetrics(janitor).registry


def _metric_rows(registry: CollectorRegistry) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for family in registry.collect():
        name = f"{family.name}_total" if family.type == "counter" else family.name
        labels = dict.fromkeys(
            label for sample in family.samples for label in sample.labels if label != "le"
        )
        rows.append((_code(name), family.type, ", ".join(labels), family.documentation))
    return sorted(rows)


def metrics_section() -> list[str]:
    lines = [
        "## Metrics",
        "",
        "A worker and a janitor serve their own on `KEYQ_METRICS_PORT` (`/metrics`); a "
        "producer records into prometheus_client's default registry with "
        "`Producer(..., metrics=True)`, or into the application's with `metrics=registry`.",
        "",
    ]
    for title, rows in (
        ("Producer", _producer_rows()),
        ("Worker", _metric_rows(_worker_registry())),
        ("Janitor", _metric_rows(_janitor_registry())),
    ):
        lines += [f"### {title}", "", *_table(("metric", "type", "labels", "help"), rows)]
    return lines


# ---------------------------------------------------------------------------------- whole


def render() -> str:
    """The whole reference, as docs/reference.md should hold it."""
    lines = [
        "# keyq reference",
        "",
        f"Generated from the code by `{REGENERATE}`: do not edit it by hand. Every setting, "
        "command, metric and exit code; how to use them is in "
        "[usage.md](usage.md) and [operations.md](operations.md).",
        "",
        *settings_section(),
        *commands_section(),
        *metrics_section(),
        "## Exit codes",
        "",
        "Every command ends an error with one line on stderr, `keyq: …`, with no traceback and "
        "no credentials.",
        "",
        *_table(("code", "meaning"), [(str(code), meaning) for code, meaning in EXIT_CODES]),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str]) -> None:
    text = render()
    if argv:
        Path(argv[0]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
