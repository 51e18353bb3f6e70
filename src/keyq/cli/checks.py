"""Checks of command-line values while click parses them, with the very checks the producer
and the operator commands apply later: bad input is refused in one line, exit 2, before any
service is contacted (not reported as an unreachable Redis)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import click

from keyq.broker.errors import InvalidInput, KeyqError
from keyq.broker.naming import check_stream_name, encode_key
from keyq.producer.encoding import encode_event

Callback = Callable[[click.Context, click.Parameter, Any], Any]


def checked(check: Callable[[Any], object]) -> Callback:
    """A click callback running ``check`` on an option's value (on each, when repeated) and
    reporting its ``KeyqError`` as a bad value of that option."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        for item in value if isinstance(value, tuple) else (value,):
            if item is None:
                continue
            try:
                check(item)
            except KeyqError as exc:
                raise click.BadParameter(str(exc), ctx, param) from None
        return value

    return callback


def check_letter_id(text: str) -> None:
    """Dead letters' ids (``producer:seq``, or a digest) hold no blanks."""
    if not text or text != text.strip():
        raise InvalidInput(f"a dead letter's id is a word as dlq list shows it, got {text!r}")


stream_name = checked(check_stream_name)
key_name = checked(encode_key)
letter_id = checked(check_letter_id)

_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number"}


def json_event(ctx: click.Context, param: click.Parameter, value: str) -> dict[str, Any]:
    """``--event`` parsed: a JSON object the producer will accept."""
    try:
        # The standard parser keeps integers whole (orjson's would turn one past 64 bits into
        # a float), so the producer's own check refuses what it cannot send as given.
        event = json.loads(value, parse_constant=_no_constant)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", ctx, param) from None
    if not isinstance(event, dict):
        kind = _JSON_TYPES.get(type(event), "null" if event is None else "a boolean")
        raise click.BadParameter(f"an event must be a JSON object, got {kind}", ctx, param)
    try:
        encode_event(event)
    except KeyqError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return event


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


class FiniteFloat(click.FloatRange):
    """A float range that also refuses nan and infinity, which pass any bound unnoticed."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


NON_NEGATIVE = FiniteFloat(min=0)
POSITIVE = FiniteFloat(min=0, min_open=True)
