"""Putting back the dead letters of many keys in one walk of the dead-letter queue: every keyed
letter (``--all``), those whose reason holds a text (``--reason``), those of listed keys
(``--keys-file``).

Each key keeps the protocol of ``keyq.ops.redrive``, in chunks of keys so that a thousand keys cost
a few round trips per chunk rather than several per key: the chunk's redrive queues are
recorded (one pipeline) and declared, the letters published into them with confirms tracked in
a window (``broker.confirm_window``), then each key's queue is put at the head of its aside list
and the key unparked (``KeyControl.put_ahead_and_unpark``: the key's point of no return). The
letters of the keys past it are acked once the walk is done, and every key's queue is woken in
one call. Killed anywhere, a run again finds what a single-key redrive would: letters still in
the dead-letter queue (put back again under the same redrive ids, applied once), orphan redrive
queues (deleted).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from keyq.broker.confirm_window import ConfirmWindow
from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.broker.dead_letter_queue import DeadLetterMessage, DeadLetterWalk, packs_left_partly
from keyq.broker.errors import LockLost
from keyq.broker.key_control import KeyControl
from keyq.broker.key_wake import wake_keys
from keyq.broker.naming import redrive_queue_name
from keyq.broker.topology import keyed_queue_arguments
from keyq.ops.context import OperatorContext
from keyq.ops.dead_letter_lock import DeadLetterLock
from keyq.ops.redrive import NothingToRedrive, delete_orphans, redriven_properties

CHUNK_KEYS = 200  # keys whose letters are published before any of them is put back


@dataclass(frozen=True)
class BulkRequest:
    """Which letters: every keyed one (``every``), or those of ``keys``, and/or those whose
    reason holds ``reason``."""

    every: bool = False
    reason: str | None = None
    keys: tuple[str, ...] | None = None
    wait_s: float = 30.0

    def wants(self, letter: DeadLetterMessage) -> bool:
        if letter.foreign or letter.key is None:
            return False  # a letter without a key goes back only by --id --to-key
        if self.keys is not None and letter.key not in self._key_set:
            return False
        return self.reason is None or self.reason in (letter.reason or "")

    @property
    def _key_set(self) -> frozenset[str]:
        return frozenset(self.keys or ())


@dataclass
class KeyRedriven:
    key: str
    letters: int
    ids: list[str]
    queue: str


@dataclass
class BulkResult:
    redriven: list[KeyRedriven] = field(default_factory=list)
    without_letters: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    woken: list[str] = field(default_factory=list)
    orphans_deleted: list[str] = field(default_factory=list)

    @property
    def letters(self) -> int:
        return sum(done.letters for done in self.redriven)

    def as_dict(self) -> dict[str, Any]:
        return {
            "keys": len(self.redriven),
            "letters": self.letters,
            "redriven": [vars(done) for done in self.redriven],
            "without_letters": self.without_letters,
            "skipped": self.skipped,
            "woken": self.woken,
            "orphans_deleted": self.orphans_deleted,
        }


def redrive_many(ctx: OperatorContext, request: BulkRequest) -> BulkResult:
    """Put back the letters ``request`` selects, key by key, in one walk (module docstring)."""
    control = KeyControl(ctx.redis, ctx.stream)
    index = DeadLetterIndex(ctx.redis, ctx.stream)
    result = BulkResult()
    with ctx.services(), DeadLetterLock(ctx.redis, ctx.stream, wait_s=request.wait_s) as lock:
        started = index.clock_ms()
        walk = DeadLetterWalk(ctx.amqp(), ctx.config.dead_letter_queue)
        done: list[DeadLetterMessage] = []
        try:
            letters = walk.read()
            index.reconcile(letters, started)
            groups = _select(letters, request, result)
            if not groups:
                raise NothingToRedrive(f"no dead letters to put back in {walk.queue}")
            result.orphans_deleted = delete_orphans(ctx, control)
            publisher = ConfirmWindow(ctx.amqp())
            try:
                for chunk in _chunks(list(groups.items())):
                    queues = _publish_chunk(ctx, publisher, chunk)
                    for key, picked in chunk:
                        if lock.lost:
                            raise LockLost("the dead-letter lock ran out before all keys were done")
                        control.put_ahead_and_unpark(key, queues[key])  # the key's no return
                        ids = list(dict.fromkeys(letter.letter_id for letter in picked))
                        result.redriven.append(KeyRedriven(key, len(picked), ids, queues[key]))
                        done.extend(picked)
            except BaseException:
                with contextlib.suppress(Exception):
                    _ack_done(walk, index, letters, done)  # keys past their point of no return
                raise
            publisher.close()
            _ack_done(walk, index, letters, done)
        finally:
            walk.close()
    with ctx.services():
        keys = [done_key.key for done_key in result.redriven]
        result.woken = wake_keys(ctx.redis, ctx.amqp(), ctx.config, keys)
    return result


def _select(
    letters: Sequence[DeadLetterMessage], request: BulkRequest, result: BulkResult
) -> dict[str, list[DeadLetterMessage]]:
    """The letters to put back, by key in the order keys first appear, each key's in queue
    order. A key one of whose letters is in a pack with letters not selected is skipped (a
    pack leaves the queue whole), and said so."""
    picked = [letter for letter in letters if request.wants(letter)]
    while partly := packs_left_partly(letters, picked):
        for events, _left in partly:
            for event in events:
                if request.wants(event) and event.key not in result.skipped:
                    assert event.key is not None
                    result.skipped[event.key] = (
                        "a pack holds letters of it and letters not selected: "
                        "put them back by --id each"
                    )
        picked = [letter for letter in picked if letter.key not in result.skipped]
    groups: dict[str, list[DeadLetterMessage]] = {}
    for letter in picked:
        assert letter.key is not None
        groups.setdefault(letter.key, []).append(letter)
    if request.keys is not None:
        result.without_letters = [
            key
            for key in dict.fromkeys(request.keys)
            if key not in groups and key not in result.skipped
        ]
    return groups


def _chunks(
    groups: list[tuple[str, list[DeadLetterMessage]]],
) -> list[list[tuple[str, list[DeadLetterMessage]]]]:
    return [groups[start : start + CHUNK_KEYS] for start in range(0, len(groups), CHUNK_KEYS)]


def _publish_chunk(
    ctx: OperatorContext,
    publisher: ConfirmWindow,
    chunk: Sequence[tuple[str, list[DeadLetterMessage]]],
) -> dict[str, str]:
    """A fresh redrive queue per key, recorded before it is declared, with the key's letters in
    order, all confirmed; key -> queue."""
    queues = {key: redrive_queue_name(ctx.stream, key, uuid.uuid4().hex[:12]) for key, _ in chunk}
    pipe = ctx.redis.pipeline(transaction=False)
    for key, queue in queues.items():
        pipe.hset(ctx.keys.redrives, queue, key)
    pipe.execute()
    arguments = keyed_queue_arguments(ctx.stream, ctx.config.queue_type)
    for queue in queues.values():
        publisher.declare(queue, arguments)
    for key, picked in chunk:
        for letter in picked:
            publisher.publish(queues[key], letter.body, redriven_properties(letter))
    publisher.wait()
    return queues


def _ack_done(
    walk: DeadLetterWalk,
    index: DeadLetterIndex,
    letters: Sequence[DeadLetterMessage],
    done: Sequence[DeadLetterMessage],
) -> None:
    """Remove the letters of the keys past their point of no return (a pack only when all its
    events are among them) from the queue, then from the index."""
    partly = packs_left_partly(letters, done)
    held = {event.delivery_tag for events, _left in partly for event in events}
    removable = [letter for letter in done if letter.delivery_tag not in held]
    if removable:
        walk.ack(removable)
        index.remove(removable)
