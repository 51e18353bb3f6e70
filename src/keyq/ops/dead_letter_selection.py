"""Which dead letters a command means: a key's, or those with given ids (every copy of each);
and dropping them.

An id is unique to an event only within its key (a key's seqs are its own), so ids that name
letters of several keys must be narrowed with a key; an id that names nothing is bad input.
The events of a pack dead-lettered whole are letters of their own, but leave the queue only
together (one message, one ack): a removal must take all of them or none (``whole_packs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.broker.dead_letter_queue import DeadLetterMessage, PartialPack, packs_left_partly
from keyq.broker.errors import InvalidInput, KeyqError
from keyq.ops.context import OperatorContext
from keyq.ops.dead_letter_lock import locked_walk


class LetterNotFound(InvalidInput):
    """No letter in the dead-letter queue has the given id."""


def of_key(letters: Sequence[DeadLetterMessage], key: str) -> list[DeadLetterMessage]:
    """The key's letters, in queue order (a foreign letter belongs to no key)."""
    return [letter for letter in letters if not letter.foreign and letter.key == key]


def by_ids(
    letters: Sequence[DeadLetterMessage],
    ids: Sequence[str],
    *,
    key: str | None = None,
    queue: str = "the dead-letter queue",
) -> list[DeadLetterMessage]:
    """Every letter whose id is one of ``ids`` (and whose key is ``key``, if given), in queue
    order. Raises ``LetterNotFound`` for an id that names nothing, ``InvalidInput`` for one
    that names letters of several keys when no key narrows it."""
    wanted = set(ids)
    picked = [
        letter
        for letter in letters
        if letter.letter_id in wanted
        and (key is None or (not letter.foreign and letter.key == key))
    ]
    for letter_id in ids:
        matches = [letter for letter in picked if letter.letter_id == letter_id]
        if not matches:
            where = f" of key {key!r}" if key is not None else ""
            raise LetterNotFound(f"no dead letter {letter_id}{where} in {queue}")
        keys = {letter.key for letter in matches}
        if len(keys) > 1:
            raise InvalidInput(
                f"id {letter_id} names letters of {len(keys)} keys: add --key to choose one"
            )
    return picked


def whole_packs(
    letters: Sequence[DeadLetterMessage],
    picked: Sequence[DeadLetterMessage],
    *,
    queue: str = "the dead-letter queue",
) -> None:
    """Raises ``PartialPack`` when ``picked`` holds some but not all events of a pack in
    ``letters``: it names the pack and the letters left out, and how to take them all."""
    partly = packs_left_partly(letters, picked)
    if not partly:
        return
    events, left = partly[0]
    pack = events[0].pack
    assert pack is not None
    keys = sorted({str(event.key) for event in events if not event.foreign})
    if len(keys) == 1 and all(not event.foreign for event in events):
        how = f"--key {keys[0]} selects all of them"
    else:
        how = "by --id each: its letters are of several keys, or of none"
    raise PartialPack(
        f"pack {pack.message_id or '-'} in {queue} holds {pack.events} letters and is removed "
        f"only whole, but {', '.join(_ids(left))} of it are not selected: select them all ({how})"
    )


def _ids(letters: Sequence[DeadLetterMessage]) -> list[str]:
    return list(dict.fromkeys(letter.letter_id for letter in letters))


class NothingDropped(KeyqError):
    """Nothing matched, or the operator said no (exit 1)."""


def indexed_for_drop(
    index: DeadLetterIndex, key: str | None, ids: Sequence[str]
) -> list[dict[str, Any]]:
    """What the index says a drop will remove (the walk then finds the letters themselves)."""
    if not ids:
        assert key is not None
        return index.of_key(key, None).rows
    return [
        row
        for letter_id in dict.fromkeys(ids)
        for row in index.by_id(letter_id)
        if key is None or row["key"] == key
    ]


def drop(
    ctx: OperatorContext, key: str | None, ids: Sequence[str], wait: float
) -> list[DeadLetterMessage]:
    """Remove for good the letters of ``key`` or with ``ids`` (every copy; whole packs only),
    from the queue, then from the index; every other letter stays in its place."""
    queue = ctx.config.dead_letter_queue
    with ctx.services(), locked_walk(ctx, wait) as walk:
        letters = walk.read()
        if ids:
            picked = by_ids(letters, ids, key=key, queue=queue)
        else:
            assert key is not None
            picked = of_key(letters, key)
            if not picked:
                raise NothingDropped(f"no dead letters of key {key} in {queue}")
        whole_packs(letters, picked, queue=queue)
        walk.ack(picked)
        DeadLetterIndex(ctx.redis, ctx.stream).remove(picked)
    return picked
