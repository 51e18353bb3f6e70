"""What ``keyq dlq list``, ``show`` and ``reindex`` read: the index of dead letters
(``keyq.broker.dead_letter_index``), the queue's depth, and, for ``show --walk`` and
``reindex``, one walk of the dead-letter queue under its lock. Letters come out as JSON-ready
rows; ``keyq.cli.dead_letter_rows`` draws them for people."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from keyq.broker.dead_letter_index import DeadLetterIndex, letter_extra, letter_fields
from keyq.broker.dead_letter_queue import DeadLetterMessage
from keyq.broker.errors import InvalidInput
from keyq.broker.queue_probe import QueueProbe
from keyq.ops.context import OperatorContext
from keyq.ops.dead_letter_lock import locked_walk
from keyq.ops.dead_letter_selection import LetterNotFound, by_ids


def letter_row(letter: DeadLetterMessage) -> dict[str, Any]:
    """One letter's summary as a walk met it, JSON-ready."""
    return {"position": letter.position} | letter_fields(letter)


def letter_detail(letter: DeadLetterMessage) -> dict[str, Any]:
    """One letter whole, as a walk met it: its summary, every header, the message id and the
    full payload (as text when it is UTF-8, else base64)."""
    return detail_of(letter_row(letter) | letter_extra(letter))


def detail_of(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A summary with its extra fields (``broker.dead_letter_index.letter_extra``) as
    ``show`` prints them: the pack's headers inside ``pack``."""
    detail = {name: value for name, value in fields.items() if name != "preview"}
    pack_headers = detail.pop("pack_headers", None)
    if detail.get("pack") is not None:
        detail["pack"] = dict(detail["pack"]) | {"headers": pack_headers or {}}
    return detail


def queue_depth(ctx: OperatorContext) -> int | None:
    """Messages ready in the dead-letter queue (one passive declare), None if it is missing."""
    probe = QueueProbe(ctx.amqp().channel)
    try:
        counts = probe.counts(ctx.config.dead_letter_queue)
    finally:
        probe.close()
    return None if counts is None else counts.ready


def list_letters(
    ctx: OperatorContext, key: str | None, reason: str | None, limit: int | None
) -> dict[str, Any]:
    """The letters the index lists (of ``key``, with ``reason``), oldest first, with the
    queue's depth and whether the index is in step with it."""
    with ctx.services():
        index = DeadLetterIndex(ctx.redis, ctx.stream)
        if reason is not None:
            page = index.with_reason(reason, limit, key)
        elif key is not None:
            page = index.of_key(key, limit)
        else:
            page = index.page(limit)
        letters, messages = index.counts()
        ready = queue_depth(ctx) or 0
    return {
        "stream": ctx.stream,
        "queue": ctx.config.dead_letter_queue,
        "ready": ready,
        "indexed": {"letters": letters, "messages": messages, "in_step": ready == messages},
        "matched": page.matched,
        "letters": [{"position": place} | row for place, row in enumerate(page.rows)],
    }


def show_letter(
    ctx: OperatorContext, letter_id: str, key: str | None, *, walk_queue: bool, wait: float
) -> dict[str, Any]:
    """One letter whole, from the index, or (``walk_queue``) read from the queue itself."""
    queue = ctx.config.dead_letter_queue
    with ctx.services():
        if walk_queue:
            with locked_walk(ctx, wait) as walk:
                picked = by_ids(walk.read(), [letter_id], key=key, queue=queue)
            return letter_detail(picked[0]) | {"copies": len(picked)}
        index = DeadLetterIndex(ctx.redis, ctx.stream)
        entries = [row for row in index.by_id(letter_id) if key is None or row["key"] == key]
    if not entries:
        where = f" of key {key!r}" if key is not None else ""
        raise LetterNotFound(f"no dead letter {letter_id}{where} in the index of {queue}")
    if len(entries) > 1:
        raise InvalidInput(
            f"id {letter_id} names letters of {len(entries)} keys: add --key to choose one"
        )
    return detail_of(entries[0])


def reindex(ctx: OperatorContext, wait: float) -> dict[str, Any]:
    """Walk the dead-letter queue once, bringing the index in step; what it met."""
    with ctx.services():
        index = DeadLetterIndex(ctx.redis, ctx.stream)
        before = index.counts()
        with locked_walk(ctx, wait) as walk:
            met, ready = len(walk.read()), walk.ready_at_start
        after = index.counts()
    return {
        "stream": ctx.stream,
        "queue": ctx.config.dead_letter_queue,
        "ready": ready,
        "letters_met": met,
        "indexed_before": {"letters": before[0], "messages": before[1]},
        "indexed": {"letters": after[0], "messages": after[1]},
    }
