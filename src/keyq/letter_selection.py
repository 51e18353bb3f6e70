"""Which dead letters a command means: a key's, or those with given ids (every copy of each).

An id is unique to an event only within its key (a key's seqs are its own), so ids that name
letters of several keys must be narrowed with a key; an id that names nothing is bad input.
The events of a pack dead-lettered whole are letters of their own, but leave the queue only
together (one message, one ack): a removal must take all of them or none (``whole_packs``).
"""

from __future__ import annotations

from collections.abc import Sequence

from keyq.broker.dead_letter_queue import DeadLetterMessage, PartialPack, packs_left_partly
from keyq.broker.errors import InvalidInput


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
