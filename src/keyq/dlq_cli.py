"""``keyq dlq``: list, show, drop and redrive a stream's dead letters.

Every subcommand walks the dead-letter queue under the stream's dead-letter lock and hands
back, in place, every letter it does not remove (``keyq.broker.dead_letter_queue``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import orjson

from keyq.broker.dead_letter_queue import DeadLetterMessage, DeadLetterWalk
from keyq.broker.errors import InvalidInput, KeyqError
from keyq.command_errors import OneLineGroup, fail, usage
from keyq.dead_letter_listing import letter_detail, letter_row, render_detail, render_rows
from keyq.dlq_lock import DeadLetterLock
from keyq.letter_selection import by_ids, of_key, whole_packs
from keyq.operator_context import OperatorContext, check_keys
from keyq.redrive import RedriveRequest, redrive

stream_option = click.option("--stream", required=True, help="Stream name.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")
wait_option = click.option(
    "--wait",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds to wait for another command working on the dead-letter queue.",
)


def _echo_json(value: Any) -> None:
    click.echo(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode())


def _keys(*keys: str | None) -> None:
    check_keys([key for key in keys if key is not None])


@click.group("dlq", cls=OneLineGroup)
def dlq_group() -> None:
    """A stream's dead letters: list, show, drop, redrive."""


@contextlib.contextmanager
def locked_walk(ctx: OperatorContext, wait: float) -> Iterator[DeadLetterWalk]:
    """A walk of the stream's dead-letter queue, under its lock (one walk at a time)."""
    with (
        DeadLetterLock(ctx.redis, ctx.stream, wait_s=wait),
        DeadLetterWalk(ctx.amqp(), ctx.config.dead_letter_queue) as walk,
    ):
        yield walk


@dlq_group.command("list")
@stream_option
@click.option("--key", default=None, help="Only this key's letters.")
@click.option("--limit", type=int, default=None, help="At most this many letters.")
@json_option
@wait_option
def list_command(
    stream: str, key: str | None, limit: int | None, as_json: bool, wait: float
) -> None:
    """Each dead letter in queue order (nothing is consumed or moved)."""
    if limit is not None and limit <= 0:
        usage(f"--limit must be above 0, got {limit}")
    try:
        _keys(key)
        with OperatorContext(stream) as ctx, ctx.services():
            queue = ctx.config.dead_letter_queue
            with locked_walk(ctx, wait) as walk:
                letters = walk.read()
                ready = walk.ready_at_start
    except KeyqError as exc:
        fail(exc)
    chosen = of_key(letters, key) if key is not None else letters
    rows = [letter_row(letter) for letter in chosen[:limit]]
    if as_json:
        _echo_json({"stream": stream, "queue": queue, "ready": ready, "letters": rows})
        return
    shown = f"{len(rows)} shown" + (f" of key {key}" if key is not None else "")
    packs = len({letter.delivery_tag for letter in letters if letter.pack is not None})
    held = f"{ready} letters"
    if packs:
        held = f"{ready} messages, {len(letters)} letters ({packs} packs shown as their events)"
    click.echo(f"dead-letter queue {queue}: {held}, {shown}")
    if rows:
        click.echo(render_rows(rows), nl=False)


@dlq_group.command("show")
@stream_option
@click.option("--id", "letter_id", required=True, help="The letter's id (from dlq list).")
@click.option("--key", default=None, help="The letter's key, when its id names several.")
@json_option
@wait_option
def show_command(stream: str, letter_id: str, key: str | None, as_json: bool, wait: float) -> None:
    """One letter whole: every header and the full payload."""
    try:
        _keys(key)
        with OperatorContext(stream) as ctx, ctx.services():
            queue = ctx.config.dead_letter_queue
            with locked_walk(ctx, wait) as walk:
                picked = by_ids(walk.read(), [letter_id], key=key, queue=queue)
    except KeyqError as exc:
        fail(exc)
    detail = letter_detail(picked[0]) | {"copies": len(picked)}
    if as_json:
        _echo_json(detail)
        return
    click.echo(render_detail(detail), nl=False)
    if len(picked) > 1:
        click.echo(f"({len(picked)} copies of this letter are in {queue})")


@dlq_group.command("drop")
@stream_option
@click.option("--key", default=None, help="Drop every letter of this key.")
@click.option("--id", "letter_ids", multiple=True, help="Drop this letter (every copy); repeat.")
@click.option("--yes", is_flag=True, help="Do not ask.")
@json_option
@wait_option
def drop_command(
    *,
    stream: str,
    key: str | None,
    letter_ids: tuple[str, ...],
    yes: bool,
    as_json: bool,
    wait: float,
) -> None:
    """Remove letters for good; every other letter stays, in its place.

    With --id, --key narrows an id that names letters of several keys."""
    if key is None and not letter_ids:
        usage("drop needs --key or --id")
    try:
        _keys(key)
        with OperatorContext(stream) as ctx, ctx.services():
            queue = ctx.config.dead_letter_queue
            with locked_walk(ctx, wait) as walk:
                letters = walk.read()
                picked = _to_drop(letters, key, letter_ids, queue)
                if not yes and not _confirmed(picked, queue):
                    raise NothingDropped("not confirmed: nothing dropped")
                walk.ack(picked)
    except KeyqError as exc:
        fail(exc)
    ids = list(dict.fromkeys(letter.letter_id for letter in picked))
    if as_json:
        _echo_json({"stream": stream, "queue": queue, "dropped": len(picked), "ids": ids})
        return
    click.echo(f"dropped {len(picked)} letters from {queue}: {', '.join(ids)}")


class NothingDropped(KeyqError):
    """Nothing matched, or the operator said no (exit 1)."""


def _to_drop(
    letters: list[DeadLetterMessage], key: str | None, ids: tuple[str, ...], queue: str
) -> list[DeadLetterMessage]:
    if ids:
        picked = by_ids(letters, ids, key=key, queue=queue)
    else:
        assert key is not None
        picked = of_key(letters, key)
        if not picked:
            raise NothingDropped(f"no dead letters of key {key} in {queue}")
    whole_packs(letters, picked, queue=queue)
    return picked


def _confirmed(picked: list[DeadLetterMessage], queue: str) -> bool:
    click.echo(f"{len(picked)} letters of {queue} will be removed for good:", err=True)
    for letter in picked[:20]:
        click.echo(f"  {letter.letter_id}  key {letter.key}  {letter.reason}", err=True)
    if len(picked) > 20:
        click.echo(f"  … and {len(picked) - 20} more", err=True)
    return click.confirm("drop them?", default=False, err=True)


@dlq_group.command("redrive")
@stream_option
@click.option("--key", default=None, help="Put back this key's letters (and unpark it).")
@click.option("--id", "letter_id", default=None, help="Put back this one letter (every copy).")
@click.option("--to-key", default=None, help="With --id: the key the letter goes to.")
@click.option(
    "--payload-file",
    default=None,
    help="With --id: the corrected payload (valid JSON for a JSON letter).",
)
@click.option("--skip", is_flag=True, help="Unpark --key without putting anything back.")
@json_option
@wait_option
def redrive_command(
    *,
    stream: str,
    key: str | None,
    letter_id: str | None,
    to_key: str | None,
    payload_file: str | None,
    skip: bool,
    as_json: bool,
    wait: float,
) -> None:
    """Put a key's dead letters back, in order, ahead of everything of it that waits, and
    unpark it. Safe to run again after it was killed."""
    if key is None and letter_id is None:
        usage("redrive needs --key or --id")
    if (to_key is not None or payload_file is not None) and letter_id is None:
        usage("--to-key and --payload-file go with --id")
    if skip and (letter_id is not None or key is None):
        usage("--skip goes with --key alone")
    try:
        _keys(key, to_key)
        payload = _read_payload(payload_file)
        request = RedriveRequest(
            key=key,
            letter_id=letter_id,
            to_key=to_key,
            payload=payload,
            skip=skip,
            wait_s=wait,
        )
        with OperatorContext(stream) as ctx:
            result = redrive(ctx, request)
    except KeyqError as exc:
        fail(exc)
    if as_json:
        _echo_json({"stream": stream} | result.as_dict())
        return
    if result.skipped:
        state = "unparked" if result.unparked else "was not parked"
        click.echo(f"key {result.key} {state}; dead letters left as they are")
    else:
        click.echo(
            f"put {result.letters} letters of key {result.key} back ({', '.join(result.ids)}) "
            f"in {result.queue}, ahead of its waiting events; key unparked"
        )
    if result.orphans_deleted:
        click.echo(f"deleted {len(result.orphans_deleted)} queues of earlier killed redrives")
    click.echo(f"woke {', '.join(result.woken)}")


def _read_payload(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read the payload file {path}: {exc.strerror}") from None
