"""``keyq inspect``: one key's picture (``keyq.key_inspection``), for people or as JSON."""

from __future__ import annotations

from typing import Any

import click
import orjson

from keyq.cli_checks import NON_NEGATIVE, key_name, stream_name
from keyq.command_errors import OneLineCommand
from keyq.dead_letter_listing import render_rows, when
from keyq.key_inspection import inspect_key
from keyq.operator_context import OperatorContext


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
)
def inspect_command(stream: str, key: str, as_json: bool, wait: float) -> None:
    """Where a key stands: its queue, holder, pause and park, aside queues, gaps, state,
    marks, oldest waiting event and dead letters."""
    with OperatorContext(stream) as ctx:
        found = inspect_key(ctx, key, dlq_wait_s=wait)
    if as_json:
        click.echo(orjson.dumps(found, option=orjson.OPT_INDENT_2).decode())
        return
    click.echo(render_inspection(found), nl=False)


def render_inspection(found: dict[str, Any]) -> str:
    queue = found["queue"]
    lines = [f"key {found['key']!r} of stream {found['stream']} ({found['mode']} mode)"]
    if not found["known"]:
        lines.append("the key has no state: nothing of it was seen (no queue, state or letters)")
    depth = "missing" if not queue["exists"] else f"{queue['depth']} ready"
    lines.append(
        f"queue         {queue['name']}  ({depth}"
        + (", being retired" if queue["retiring"] else "")
        + ")"
    )
    stranded = found.get("stranded")
    if stranded is not None:
        lines.append(f"STRANDED      {stranded['reason']}")
    holder = found["holder"]
    if holder is None:
        lines.append("held by       nobody")
    else:
        alive = "" if holder["alive"] else " (not alive)"
        lines.append(
            f"held by       {holder['worker']}{alive} token {holder['token']} "
            f"at {holder['host'] or '-'}:{holder['pid'] or '-'}"
        )
    paused = found["paused_since_ms"]
    lines.append(
        "paused        "
        + ("no" if paused is None else f"since {when(paused)}")
        + ("   (the whole stream is paused)" if found["stream_paused"] else "")
    )
    parked = found["parked"]
    lines.append(
        "parked        "
        + (
            "no"
            if parked is None
            else f"at producer {parked['producer']} seq {parked['seq']} since "
            f"{when(parked['at_ms'])}: {parked['reason']}"
        )
    )
    limit = found["rate_limit"]
    lines.append(
        f"stream        poison policy {found['poison_policy']}, rate limit "
        + ("none" if limit is None else f"{limit:g}/s per key")
    )
    aside = found["aside"]
    lines.append(
        "aside         "
        + (
            ", ".join(
                f"{row['queue']} ({'missing' if row['depth'] is None else row['depth']})"
                for row in aside
            )
            or "none"
        )
    )
    if found["gaps"]:
        for gap in found["gaps"]:
            lines.append(
                f"gap           producer {gap['producer']} waiting for seq "
                f"{gap['first']}..{gap['last']} for {gap['waited_s']}s"
            )
    else:
        lines.append(
            "gaps          " + ("none" if found["gaps_known"] else "unknown (no holder report)")
        )
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
