"""``keyq settings``: every component's effective settings, each with where it came from.

A value comes from its ``KEYQ_*`` environment variable (``env``), else from ``.env`` in the
working directory (``.env``), else it is the ``default``: the order the settings classes read
them in, so what is shown is what a process started here would use. Passwords are hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import click
import orjson
from pydantic_settings import DotEnvSettingsSource, EnvSettingsSource

from keyq.broker.errors import KeyqError
from keyq.broker.settings import Settings, env_name, load_settings
from keyq.cli.errors import OneLineCommand, fail
from keyq.console.settings import ConsoleSettings
from keyq.janitor.config import JanitorSettings
from keyq.worker.config import WorkerSettings


@dataclass(frozen=True)
class Component:
    """A part of keyq, the settings class it loads, and who reads the fields it declares."""

    name: str
    settings: type[Settings]
    readers: str

    def fields(self) -> list[str]:
        """The fields this component's class declares itself (the shared ones are shared's)."""
        inherited = set() if self.settings is Settings else set(Settings.model_fields)
        return sorted(set(self.settings.model_fields) - inherited)

    def effective(self) -> dict[str, dict[str, Any]]:
        """Each field's variable, value as shown to people, and source."""
        shown = load_settings(self.settings).describe()
        # The environment wins over .env, as in the settings classes themselves.
        found = {
            **dict.fromkeys(DotEnvSettingsSource(self.settings)(), ".env"),
            **dict.fromkeys(EnvSettingsSource(self.settings)(), "env"),
        }
        return {
            field: {
                "variable": env_name(field),
                "value": shown[field],
                "source": found.get(field, "default"),
            }
            for field in self.fields()
        }


COMPONENTS: tuple[Component, ...] = (
    Component("shared", Settings, "producer, worker, janitor and the operator commands"),
    Component("worker", WorkerSettings, "worker"),
    Component("janitor", JanitorSettings, "janitor"),
    Component("console", ConsoleSettings, "console"),
)


def _lines(shown: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """One aligned table for all components, a heading before each one's rows."""
    rows = {
        name: [
            (row["variable"], "unset" if row["value"] is None else str(row["value"]), row["source"])
            for row in fields.values()
        ]
        for name, fields in shown.items()
    }
    every = [row for component in rows.values() for row in component]
    wide = [max(len(row[column]) for row in every) for column in (0, 1)]
    lines = []
    for component in COMPONENTS:
        lines.append(f"{component.name} (read by the {component.readers}):")
        lines += [
            f"  {name:<{wide[0]}}  {value:<{wide[1]}}  {source}"
            for name, value, source in rows[component.name]
        ]
    return lines


@click.command("settings", cls=OneLineCommand)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print them as JSON: component -> setting -> variable, value, source.",
)
def settings_command(as_json: bool) -> None:
    """Print every component's effective settings, each with its source (env, .env or
    default), without passwords."""
    try:
        shown = {component.name: component.effective() for component in COMPONENTS}
    except KeyqError as exc:
        fail(exc)
    if as_json:
        click.echo(orjson.dumps(shown, option=orjson.OPT_INDENT_2).decode())
        return
    click.echo("\n".join(_lines(shown)))
