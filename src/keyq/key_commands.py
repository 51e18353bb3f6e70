"""``keyq pause``, ``keyq resume`` and ``keyq stream set|show``: what an operator sets on keys
and on a stream, in Redis, for workers to honour at their next tick."""

from __future__ import annotations

from typing import Any

import click
import orjson

from keyq.broker.errors import InvalidInput
from keyq.broker.key_control import KeyControl
from keyq.broker.key_wake import wake_keys
from keyq.broker.stream_policy import (
    POISON_POLICIES,
    StreamPolicies,
    StreamPolicy,
    check_dedupe_window,
    check_rate_limit,
)
from keyq.cli_checks import key_name, stream_name
from keyq.command_errors import OneLineCommand, OneLineGroup, usage
from keyq.operator_context import OperatorContext, check_keys, keys_in_file

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


def read_keys(keys: tuple[str, ...], keys_file: str | None) -> list[str]:
    """The keys of ``--key`` and ``--keys-file`` together, in order, each once, checked."""
    named = list(keys)
    if keys_file is not None:
        named += keys_in_file(keys_file)
    return list(dict.fromkeys(check_keys(named)))


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
    with OperatorContext(stream) as ctx, ctx.services():
        if whole_stream:
            StreamPolicies(ctx.redis, ctx.stream).set_paused(True)
            changed: list[str] = []
        else:
            changed = KeyControl(ctx.redis, ctx.stream).pause(names)
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
    with OperatorContext(stream) as ctx, ctx.services():
        if whole_stream:
            StreamPolicies(ctx.redis, ctx.stream).set_paused(False)
            changed: list[str] = []
            woken: list[str] = []
        else:
            connection = ctx.amqp()  # before any change: RabbitMQ down changes nothing
            changed = KeyControl(ctx.redis, ctx.stream).resume(names)
            woken = wake_keys(ctx.redis, connection, ctx.config, changed)
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
    with OperatorContext(stream) as ctx, ctx.services():
        policies = StreamPolicies(ctx.redis, ctx.stream)
        if poison_policy is not None:
            policies.set_poison_policy(poison_policy)
        if rate_limit is not None:
            policies.set_rate_limit(limit)
        if dedupe_window is not None:
            policies.set_dedupe_window(dedupe_window)
        policy = policies.load()
    click.echo(_describe(stream, policy))


@stream_group.command("show")
@stream_option
@json_option
def stream_show_command(stream: str, as_json: bool) -> None:
    """A stream's layout and operator settings, and how many keys are paused or parked."""
    with OperatorContext(stream) as ctx, ctx.services():
        policy = StreamPolicies(ctx.redis, ctx.stream).load()
        control = KeyControl(ctx.redis, ctx.stream)
        paused, parked = control.paused(), control.parked()
        config = ctx.config
    shown = {
        "stream": stream,
        "mode": config.mode.value,
        "buckets": config.buckets,
        "queue_type": config.queue_type,
        "poison_policy": policy.poison_policy,
        "rate_limit": policy.rate_limit,
        "dedupe_window_s": policy.dedupe_window_s,
        "paused": policy.paused,
        "paused_keys": len(paused),
        "parked_keys": len(parked),
    }
    if as_json:
        _echo_json(shown)
        return
    click.echo(f"{_describe(stream, policy)}   ({config.describe()})")
    click.echo(f"paused keys {len(paused)}   parked keys {len(parked)}")


def _describe(stream: str, policy: StreamPolicy) -> str:
    limit = "none" if policy.rate_limit is None else f"{policy.rate_limit:g}/s per key"
    paused = "   PAUSED" if policy.paused else ""
    return (
        f"stream {stream}: poison policy {policy.poison_policy}, rate limit {limit}, "
        f"dedupe window {policy.dedupe_window_s} s{paused}"
    )
