"""``keyq dlq``: list, show, drop, redrive and reindex a stream's dead letters; what each does
is ``keyq.ops``'s (``dead_letter_listing``, ``dead_letter_selection``, ``redrive``,
``bulk_redrive``), what it prints is here.

Listing and showing read the index of dead letters (``keyq.broker.dead_letter_index``) and never
touch the queue but for its depth. Only what moves letters (drop, redrive, reindex) walks the
dead-letter queue, under the stream's dead-letter lock, handing back in place every letter it
does not remove (``keyq.broker.dead_letter_queue``) and bringing the index up to date.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import orjson

from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.broker.errors import InvalidInput
from keyq.cli.checks import NON_NEGATIVE, key_name, letter_id, stream_name
from keyq.cli.dead_letter_rows import render_detail, render_rows
from keyq.cli.errors import OneLineGroup, usage
from keyq.ops.bulk_redrive import BulkRequest, redrive_many
from keyq.ops.context import OperatorContext, check_keys, keys_in_file
from keyq.ops.dead_letter_listing import list_letters, reindex, show_letter
from keyq.ops.dead_letter_selection import NothingDropped, drop, indexed_for_drop
from keyq.ops.redrive import RedriveRequest, redrive

stream_option = click.option("--stream", required=True, callback=stream_name, help="Stream name.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")
wait_option = click.option(
    "--wait",
    type=NON_NEGATIVE,
    default=30.0,
    show_default=True,
    help="Seconds to wait for another command working on the dead-letter queue.",
)


def _echo_json(value: Any) -> None:
    click.echo(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode())


@click.group("dlq", cls=OneLineGroup)
def dead_letters_group() -> None:
    """A stream's dead letters: list, show, drop, redrive."""


@dead_letters_group.command("list")
@stream_option
@click.option("--key", default=None, callback=key_name, help="Only this key's letters.")
@click.option("--reason", default=None, help="Only letters whose reason holds this text.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many.")
@json_option
@click.option("--wait", type=float, default=None, hidden=True)  # kept: the index takes no lock
def list_command(
    *,
    stream: str,
    key: str | None,
    reason: str | None,
    limit: int | None,
    as_json: bool,
    wait: float | None,
) -> None:
    """The dead letters, oldest first, from the index (nothing is consumed or moved)."""
    del wait
    with OperatorContext(stream) as ctx:
        listed = list_letters(ctx, key, reason, limit)
    if as_json:
        _echo_json(listed)
        return
    queue, ready, rows = listed["queue"], listed["ready"], listed["letters"]
    letters, messages = listed["indexed"]["letters"], listed["indexed"]["messages"]
    chosen = "".join(
        f" {what} {value}" for what, value in (("of key", key), ("with reason", reason)) if value
    )
    click.echo(
        f"dead-letter queue {queue}: {ready} messages; the index lists {letters} letters "
        f"({listed['matched']} match{chosen}), {len(rows)} shown, oldest first"
    )
    if ready != messages:
        click.echo(
            f"the queue holds {ready} messages but the index {messages}: letters dead-lettered "
            f"by RabbitMQ itself are indexed by the next redrive or drop, or at once by "
            f"keyq dlq reindex --stream {stream}"
        )
    if rows:
        click.echo(render_rows(rows), nl=False)


@dead_letters_group.command("show")
@stream_option
@click.option(
    "--id", "letter_id", required=True, callback=letter_id, help="The letter's id (from dlq list)."
)
@click.option(
    "--key", default=None, callback=key_name, help="The letter's key, when its id names several."
)
@click.option(
    "--walk",
    "walk_queue",
    is_flag=True,
    help="Read the letter from the queue, not the index (a payload the index keeps cut).",
)
@json_option
@wait_option
def show_command(
    *, stream: str, letter_id: str, key: str | None, walk_queue: bool, as_json: bool, wait: float
) -> None:
    """One letter whole: every header and the payload."""
    with OperatorContext(stream) as ctx:
        queue = ctx.config.dead_letter_queue
        detail = show_letter(ctx, letter_id, key, walk_queue=walk_queue, wait=wait)
    if as_json:
        _echo_json(detail)
        return
    click.echo(render_detail(detail), nl=False)
    if detail.get("payload_cut"):
        click.echo(f"(the index keeps the payload cut; --walk reads it whole from {queue})")
    if detail["copies"] > 1:
        click.echo(f"({detail['copies']} copies of this letter are in {queue})")


@dead_letters_group.command("reindex")
@stream_option
@json_option
@wait_option
def reindex_command(stream: str, as_json: bool, wait: float) -> None:
    """Walk the dead-letter queue once and bring the index in step with it (every letter
    stays in its place)."""
    with OperatorContext(stream) as ctx:
        report = reindex(ctx, wait)
    if as_json:
        _echo_json(report)
        return
    click.echo(
        f"walked {report['queue']}: {report['ready']} messages, {report['letters_met']} "
        f"letters; the index listed {report['indexed_before']['letters']} letters and now "
        f"{report['indexed']['letters']}"
    )


@dead_letters_group.command("drop")
@stream_option
@click.option("--key", default=None, callback=key_name, help="Drop every letter of this key.")
@click.option(
    "--id",
    "letter_ids",
    multiple=True,
    callback=letter_id,
    help="Drop this letter (every copy); repeat.",
)
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

    With --id, --key narrows an id that names letters of several keys. The question is asked
    (from the index) before the dead-letter queue is taken."""
    if key is None and not letter_ids:
        usage("drop needs --key or --id")
    with OperatorContext(stream) as ctx:
        queue = ctx.config.dead_letter_queue
        if not yes:
            with ctx.services():
                rows = indexed_for_drop(DeadLetterIndex(ctx.redis, ctx.stream), key, letter_ids)
            if not _confirmed(rows, queue):
                raise NothingDropped("not confirmed: nothing dropped")
        picked = drop(ctx, key, letter_ids, wait)
    ids = list(dict.fromkeys(letter.letter_id for letter in picked))
    if as_json:
        _echo_json({"stream": stream, "queue": queue, "dropped": len(picked), "ids": ids})
        return
    click.echo(f"dropped {len(picked)} letters from {queue}: {', '.join(ids)}")


def _confirmed(rows: list[dict[str, Any]], queue: str) -> bool:
    copies = sum(int(row.get("copies") or 1) for row in rows)
    click.echo(f"{copies} letters of {queue} will be removed for good:", err=True)
    for row in rows[:20]:
        click.echo(f"  {row['id']}  key {row['key']}  {row['reason']}", err=True)
    if len(rows) > 20:
        click.echo(f"  … and {len(rows) - 20} more", err=True)
    if not rows:
        click.echo("  (the index lists none: the walk removes whatever the queue holds)", err=True)
    return click.confirm("drop them?", default=False, err=True)


@dead_letters_group.command("redrive")
@stream_option
@click.option(
    "--key", default=None, callback=key_name, help="Put back this key's letters (and unpark it)."
)
@click.option(
    "--id",
    "letter_id",
    default=None,
    callback=letter_id,
    help="Put back this one letter (every copy).",
)
@click.option(
    "--to-key", default=None, callback=key_name, help="With --id: the key the letter goes to."
)
@click.option(
    "--payload-file",
    default=None,
    help="With --id: the corrected payload (valid JSON for a JSON letter).",
)
@click.option("--skip", is_flag=True, help="Unpark --key without putting anything back.")
@click.option("--all", "every", is_flag=True, help="Put back every keyed letter, key by key.")
@click.option("--reason", default=None, help="Put back the letters whose reason holds this text.")
@click.option(
    "--keys-file",
    default=None,
    help="Put back the letters of the keys in this file (one a line; - reads stdin).",
)
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
    every: bool,
    reason: str | None,
    keys_file: str | None,
    as_json: bool,
    wait: float,
) -> None:
    """Put a key's dead letters back, in order, ahead of everything of it that waits, and
    unpark it; with --all, --reason or --keys-file, many keys' in one walk. Safe to run again
    after it was killed."""
    bulk = every or reason is not None or keys_file is not None
    if bulk:
        if letter_id is not None or to_key is not None or payload_file is not None or skip:
            usage(
                "--all, --reason and --keys-file go with no --id, --to-key, --payload-file, --skip"
            )
        if every and (reason is not None or keys_file is not None or key is not None):
            usage("--all goes alone: it puts back every keyed letter")
        _redrive_many(stream, key, reason, keys_file, every=every, as_json=as_json, wait=wait)
        return
    if key is None and letter_id is None:
        usage("redrive needs --key, --id, --all, --reason or --keys-file")
    if (to_key is not None or payload_file is not None) and letter_id is None:
        usage("--to-key and --payload-file go with --id")
    if skip and (letter_id is not None or key is None):
        usage("--skip goes with --key alone")
    request = RedriveRequest(
        key=key,
        letter_id=letter_id,
        to_key=to_key,
        payload=_read_payload(payload_file),
        skip=skip,
        wait_s=wait,
    )
    with OperatorContext(stream) as ctx:
        result = redrive(ctx, request)
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


def _redrive_many(
    stream: str,
    key: str | None,
    reason: str | None,
    keys_file: str | None,
    *,
    every: bool,
    as_json: bool,
    wait: float,
) -> None:
    keys = None if keys_file is None else _read_keys(keys_file)
    if key is not None:
        keys = [*(keys or []), key]
    request = BulkRequest(
        every=every,
        reason=reason,
        keys=None if keys is None else tuple(check_keys(keys)),
        wait_s=wait,
    )
    with OperatorContext(stream) as ctx:
        result = redrive_many(ctx, request)
    if as_json:
        _echo_json({"stream": stream} | result.as_dict())
        return
    click.echo(
        f"put {result.letters} letters of {len(result.redriven)} keys back, each key's in "
        "order ahead of its waiting events; those keys unparked"
    )
    for done in result.redriven[:20]:
        click.echo(f"  {done.key}: {done.letters} letters in {done.queue}")
    if len(result.redriven) > 20:
        click.echo(f"  … and {len(result.redriven) - 20} more keys")
    if result.without_letters:
        click.echo(
            f"no dead letters of {len(result.without_letters)} keys of the file: "
            + ", ".join(result.without_letters[:20])
        )
    for skipped, why in result.skipped.items():
        click.echo(f"skipped key {skipped}: {why}")
    if result.orphans_deleted:
        click.echo(f"deleted {len(result.orphans_deleted)} queues of earlier killed redrives")
    click.echo(f"woke {len(result.woken)} queues")


def _read_keys(path: str) -> list[str]:
    keys = keys_in_file(path)
    if not keys:
        raise InvalidInput(f"the keys file {path} names no key")
    return keys
