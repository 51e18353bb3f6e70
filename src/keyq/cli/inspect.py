"""``keyq inspect``: one key's picture (``keyq.ops.inspection``), for people or as JSON."""

from __future__ import annotations

from typing import Any

import click
import orjson

from keyq.cli.checks import NON_NEGATIVE, key_name, stream_name
from keyq.cli.dead_letter_rows import render_rows, when
from keyq.cli.errors import OneLineCommand
from keyq.ops.context import OperatorContext
from keyq.ops.inspection import inspect_key

ROUTE_CHANGES_PRINTED = 5  # of an auto-mode key's latest route changes


@click.command("inspect", cls=OneLineCommand)
@click.option("--stream", required=True, callback=stream_name, help="Stream name.")
@click.option("--key", required=True, callback=key_name, help="The key.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option(
    "--wait",
    type=NON_NEGATIVE,
    default=30.0,
    show_default=True,
    help="Seconds to wait for a command working on the dead-letter queue.",
)  # kept for scripts: the index of dead letters is read without the dead-letter lock
def inspect_command(stream: str, key: str, as_json: bool, wait: float) -> None:
    """Where a key stands: its route (auto mode), queue, holder, pause and park, aside
    queues, gaps, state, marks, oldest waiting event and dead letters."""
    del wait
    with OperatorContext(stream) as ctx:
        found = inspect_key(ctx, key)
    if as_json:
        click.echo(orjson.dumps(found, option=orjson.OPT_INDENT_2).decode())
        return
    click.echo(render_inspection(found), nl=False)


def render_inspection(found: dict[str, Any]) -> str:
    """The picture for people: one line per fact, then the key's dead letters."""
    lines = [f"key {found['key']!r} of stream {found['stream']} ({found['mode']} mode)"]
    if not found["known"]:
        lines.append("the key has no state: nothing of it was seen (no queue, state or letters)")
    lines += _where(found) + _flow(found)
    oldest = found["oldest_waiting"]
    age = oldest["age_ms"]
    lines.append(
        "oldest event  "
        + (f"{age / 1000:.1f}s old" if age is not None else "-")
        + (f"  ({oldest['note']})" if oldest.get("note") else "")
    )
    lines.append("state         " + orjson.dumps(found["state"]).decode())
    lines.append("marks         " + orjson.dumps(found["marks"]).decode())
    letters = found["dead_letters"]
    lines.append(f"dead letters  {found.get('dead_letters_total', len(letters))}")
    text = "\n".join(lines) + "\n"
    if letters:
        text += render_rows(letters)
    return text


def _where(found: dict[str, Any]) -> list[str]:
    """The key's route (auto mode), its queue, whether it is stranded, and who holds it; for
    a promoted key its bucket too, then its latest route changes."""
    route = found.get("route")
    own = route is not None and route["to"] == "own"
    lines = [] if route is None else [_route_line(route)]
    queue = found["queue"]
    depth = "missing" if not queue["exists"] else f"{queue['depth']} ready"
    lines.append(
        ("own queue     " if own else "queue         ")
        + f"{queue['name']}  ({depth}"
        + (", being retired" if queue["retiring"] else "")
        + ")"
    )
    stranded = found.get("stranded")
    if stranded is not None:
        lines.append(f"STRANDED      {stranded['reason']}")
    lines.append("held by       " + _held_by(found["holder"]))
    if route is not None and route["bucket_queue"] is not None:
        bucket = route["bucket_queue"]
        ready = "missing" if not bucket["exists"] else f"{bucket['depth']} ready, all its keys"
        lines.append(f"bucket        {bucket['name']}  ({ready}), forwards the key's events")
        lines.append("  held by     " + _held_by(bucket["holder"]))
    if route is not None:
        lines += [
            f"route change  {when(change['at_ms'])} {change['what']} epoch {change['epoch']}"
            + (f" ({change['why']})" if change.get("why") else "")
            for change in route["changes"][:ROUTE_CHANGES_PRINTED]
        ]
    return lines


def _route_line(route: dict[str, Any]) -> str:
    """Where an auto-mode key's events are applied from."""
    if route["to"] == "bucket":
        return f"route         bucket {route['bucket']} (not promoted)"
    return (
        f"route         own queue {route['queue']} since {when(route['since_ms'])}, epoch "
        f"{route['epoch']}, move {route['move']}, why {route['why']}"
    )


def _held_by(holder: dict[str, Any] | None) -> str:
    if holder is None:
        return "nobody"
    alive = "" if holder["alive"] else " (not alive)"
    return (
        f"{holder['worker']}{alive} token {holder['token']} "
        f"at {holder['host'] or '-'}:{holder['pid'] or '-'}"
    )


def _flow(found: dict[str, Any]) -> list[str]:
    """What stops or slows the key: pause, park, the stream's policy, aside queues, gaps."""
    paused, parked, limit = found["paused_since_ms"], found["parked"], found["rate_limit"]
    lines = [
        "paused        "
        + ("no" if paused is None else f"since {when(paused)}")
        + ("   (the whole stream is paused)" if found["stream_paused"] else ""),
        "parked        "
        + (
            "no"
            if parked is None
            else f"at producer {parked['producer']} seq {parked['seq']} since "
            f"{when(parked['at_ms'])}: {parked['reason']}"
        ),
        f"stream        poison policy {found['poison_policy']}, rate limit "
        + ("none" if limit is None else f"{limit:g}/s per key"),
        "aside         "
        + (
            ", ".join(
                f"{row['queue']} ({'missing' if row['depth'] is None else row['depth']})"
                for row in found["aside"]
            )
            or "none"
        ),
    ]
    lines += [
        f"gap           producer {gap['producer']} waiting for seq "
        f"{gap['first']}..{gap['last']} for {gap['waited_s']}s"
        for gap in found["gaps"]
    ]
    if not found["gaps"]:
        lines.append(
            "gaps          " + ("none" if found["gaps_known"] else "unknown (no holder report)")
        )
    return lines
