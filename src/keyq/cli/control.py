"""``keyq pause``, ``keyq resume``, ``keyq key promote`` and ``keyq stream set|show``: what an
operator sets on keys and on a stream (``keyq.ops.control`` and ``keyq.ops.routes`` set it), and
what the commands print."""

from __future__ import annotations

from typing import Any

import click
import orjson

from keyq.broker.errors import InvalidInput
from keyq.broker.stream_policy import (
    POISON_POLICIES,
    StreamPolicy,
    check_dedupe_window,
    check_rate_limit,
)
from keyq.cli.checks import key_name, stream_name
from keyq.cli.errors import OneLineCommand, OneLineGroup, usage
from keyq.ops.context import OperatorContext, read_keys
from keyq.ops.control import pause, resume, set_policy, stream_view
from keyq.ops.routes import PromotionRefused, promote, refusal

stream_option = click.option("--stream", required=True, callback=stream_name, help="Stream name.")
keys_option = click.option(
    "--key", "keys", multiple=True, callback=key_name, help="A key; repeat for several."
)
keys_file_option = click.option(
    "--keys-file",
    default=None,
    help="A file of keys, one a line (blank lines ignored; - for stdin).",
)
all_option = click.option("--all", "whole_stream", is_flag=True, help="The whole stream.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


def _chosen(keys: tuple[str, ...], keys_file: str | None, whole_stream: bool) -> list[str]:
    if whole_stream == bool(keys or keys_file):
        usage("give --key/--keys-file or --all")
    return [] if whole_stream else read_keys(keys, keys_file)


def _echo_json(value: Any) -> None:
    click.echo(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode())


@click.command("pause", cls=OneLineCommand)
@stream_option
@keys_option
@keys_file_option
@all_option
@json_option
def pause_command(
    stream: str, keys: tuple[str, ...], keys_file: str | None, whole_stream: bool, as_json: bool
) -> None:
    """Stop applying keys' events (or the whole stream's) until resumed; nothing is lost,
    their events wait."""
    names = _chosen(keys, keys_file, whole_stream)
    with OperatorContext(stream) as ctx:
        changed = pause(ctx, names, whole_stream=whole_stream)
    if as_json:
        _echo_json({"stream": stream, "all": whole_stream, "keys": names, "paused": changed})
    elif whole_stream:
        click.echo(f"stream {stream} paused")
    else:
        click.echo(f"paused {len(changed)} keys ({len(names) - len(changed)} were paused already)")


@click.command("resume", cls=OneLineCommand)
@stream_option
@keys_option
@keys_file_option
@all_option
@json_option
def resume_command(
    stream: str, keys: tuple[str, ...], keys_file: str | None, whole_stream: bool, as_json: bool
) -> None:
    """Apply paused keys' events again (or the stream's), waking their queues."""
    names = _chosen(keys, keys_file, whole_stream)
    with OperatorContext(stream) as ctx:
        changed, woken = resume(ctx, names, whole_stream=whole_stream)
    if as_json:
        _echo_json(
            {
                "stream": stream,
                "all": whole_stream,
                "keys": names,
                "resumed": changed,
                "woken": woken,
            }
        )
    elif whole_stream:
        click.echo(f"stream {stream} resumed")
    else:
        click.echo(
            f"resumed {len(changed)} keys ({len(names) - len(changed)} were not paused); "
            f"woke {len(woken)} queues"
        )


@click.group("key", cls=OneLineGroup)
def key_group() -> None:
    """A key's route in an auto-mode stream: its bucket, or a queue of its own."""


@key_group.command("promote")
@click.argument("keys", nargs=-1, required=True, callback=key_name, metavar="KEY...")
@stream_option
@json_option
def key_promote_command(keys: tuple[str, ...], stream: str, as_json: bool) -> None:
    """Give keys of an auto-mode stream a queue of their own now: their bucket's holder
    forwards their events there, in order. A key whose events wait aside in its bucket is
    refused (exit 1) until they are drained."""
    names = read_keys(keys, None)
    with OperatorContext(stream) as ctx:
        done = promote(ctx, names)
    if as_json:
        _echo_json(
            {
                "stream": stream,
                "promoted": done.rows(),
                "refused": done.refused,
                "woken": done.woken,
            }
        )
    else:
        for row in done.rows():
            move = f"move {row['move']}"
            if row["already"]:
                click.echo(
                    f"{row['key']}: already promoted to {row['queue']} (epoch {row['epoch']}, "
                    f"{move}, why {row['why']})"
                )
            else:
                click.echo(f"{row['key']}: promoted to {row['queue']} at epoch {row['epoch']}")
    if done.refused:
        raise PromotionRefused(refusal(done.refused))


@click.group("stream", cls=OneLineGroup)
def stream_group() -> None:
    """A stream's operator settings: poison policy, rate limit per key."""


def _rate_limit(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise InvalidInput(
            f"--rate-limit must be a number of events per second or none, got {text!r}"
        ) from None
    return check_rate_limit(value)


@stream_group.command("set")
@stream_option
@click.option("--poison-policy", default=None, help=f"One of {', '.join(POISON_POLICIES)}.")
@click.option("--rate-limit", default=None, help="Events per second per key, or none.")
@click.option(
    "--dedupe-window",
    type=int,
    default=None,
    help="Seconds a dedupe id is remembered at least (60 s to 30 days; default a day).",
)
def stream_set_command(
    stream: str, poison_policy: str | None, rate_limit: str | None, dedupe_window: int | None
) -> None:
    """Change a stream's poison policy, rate limit or dedupe window; workers follow within a
    second."""
    if poison_policy is None and rate_limit is None and dedupe_window is None:
        usage("nothing to set: give --poison-policy, --rate-limit or --dedupe-window")
    if poison_policy is not None:
        StreamPolicy(poison_policy=poison_policy)
    if dedupe_window is not None:
        check_dedupe_window(dedupe_window)
    limit = _rate_limit(rate_limit) if rate_limit is not None else None
    with OperatorContext(stream) as ctx:
        policy = set_policy(
            ctx,
            poison_policy=poison_policy,
            rate_limit=limit,
            set_rate_limit=rate_limit is not None,
            dedupe_window=dedupe_window,
        )
    click.echo(_describe(stream, policy))


@stream_group.command("show")
@stream_option
@json_option
def stream_show_command(stream: str, as_json: bool) -> None:
    """A stream's layout and operator settings, and how many keys are paused or parked."""
    with OperatorContext(stream) as ctx:
        shown, policy = stream_view(ctx)
    if as_json:
        _echo_json(shown)
        return
    click.echo(f"{_describe(stream, policy)}   ({ctx.config.describe()})")
    click.echo(f"paused keys {shown['paused_keys']}   parked keys {shown['parked_keys']}")


def _describe(stream: str, policy: StreamPolicy) -> str:
    limit = "none" if policy.rate_limit is None else f"{policy.rate_limit:g}/s per key"
    paused = "   PAUSED" if policy.paused else ""
    return (
        f"stream {stream}: poison policy {policy.poison_policy}, rate limit {limit}, "
        f"dedupe window {policy.dedupe_window_s} s{paused}"
    )
