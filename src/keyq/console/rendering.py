"""How the console's templates draw figures: ages, times, numbers and JSON. Every filter
returns plain text, which Jinja2's autoescape then escapes like anything else on the page."""

from __future__ import annotations

import datetime
from typing import Any

import jinja2
import orjson

MINUTE_S = 60
HOUR_S = 3600


def age(value: float | None, unit: str = "ms") -> str:
    """``1.2 s``, ``4 min``, ``2.5 h`` from ms (or s); a dash for nothing."""
    if value is None:
        return "—"
    seconds = float(value) / (1000 if unit == "ms" else 1)
    if seconds < MINUTE_S:
        return f"{seconds:.1f} s"
    if seconds < HOUR_S:
        return f"{seconds / MINUTE_S:.0f} min"
    return f"{seconds / HOUR_S:.1f} h"


def when(ms: int | None) -> str:
    """A time in ms since the epoch, in UTC."""
    if not ms:
        return "—"
    moment = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def count(value: int | float | None) -> str:
    if value is None:
        return "—"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.1f}"


def pretty(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()


def register_filters(environment: jinja2.Environment) -> None:
    environment.filters.update({"age": age, "when": when, "count": count, "pretty": pretty})
