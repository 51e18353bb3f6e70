"""Putting a key's dead letters back ahead of everything of the key that waits, and unparking it.

The protocol, in the order that makes a run killed anywhere safe to run again:

1. hold the stream's dead-letter lock (``keyq.ops.dead_letter_lock``);
2. walk the dead-letter queue, bring the index of dead letters in step with what it meets
   (``broker.dead_letter_index``) and pick the letters (nothing acked yet);
3. delete the redrive queues of killed runs: recorded in ``StreamKeys.redrives`` but never
   put in a key's aside list;
4. record a fresh redrive queue, declare it, publish the picked letters into it in order,
   confirmed, each with ``x-keyq-redrive-id`` (the worker applies a redrive id once);
5. put the queue at the head of the key's aside list and unpark the key, in one step
   (``KeyControl.put_ahead_and_unpark``): the point of no return;
6. ack the picked letters and take them out of the index; the walk's channel closes and the
   rest go back in place;
7. wake the key's queue so that a worker claims it and drains the redrive queue first.

Killed before 5, the letters are still in the dead-letter queue and the next run deletes the
orphan queue; killed between 5 and 6, the letters are in both, and the copies a later run puts
back carry the same redrive ids.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import pika
import pika.exceptions

from keyq.broker.confirm_window import ConfirmWindow
from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.broker.dead_letter_queue import BROKER_HEADERS, DeadLetterMessage, DeadLetterWalk
from keyq.broker.envelope import (
    CONTENT_JSON,
    HEADER_ATTEMPTS,
    HEADER_DEAD_AT,
    HEADER_DEAD_QUEUE,
    HEADER_DEAD_REASON,
    HEADER_KEY,
    HEADER_PRODUCER,
    HEADER_REDRIVE_ID,
    HEADER_SEQ,
)
from keyq.broker.errors import InvalidInput, KeyqError, LockLost
from keyq.broker.key_control import KeyControl
from keyq.broker.key_wake import wake_keys
from keyq.broker.naming import redrive_queue_name
from keyq.broker.topology import keyed_queue_arguments
from keyq.ops.context import OperatorContext
from keyq.ops.dead_letter_lock import DeadLetterLock
from keyq.ops.dead_letter_selection import by_ids, of_key, whole_packs

DEAD_HEADERS = frozenset(
    {HEADER_DEAD_REASON, HEADER_DEAD_QUEUE, HEADER_ATTEMPTS, HEADER_DEAD_AT, *BROKER_HEADERS}
)
NOT_FOUND = 404


class NothingToRedrive(KeyqError):
    """The key has no dead letters (exit 1: nothing was changed)."""


@dataclass(frozen=True)
class RedriveRequest:
    """``key``: redrive that key's letters. ``letter_id``: one letter (every copy of it), to
    its own key or to ``to_key``, with ``payload`` as its corrected body. ``skip``: only
    unpark ``key`` and wake it."""

    key: str | None = None
    letter_id: str | None = None
    to_key: str | None = None
    payload: bytes | None = None
    skip: bool = False
    wait_s: float = 30.0


@dataclass
class RedriveResult:
    key: str
    letters: int = 0
    ids: list[str] = field(default_factory=list)
    queue: str | None = None
    unparked: bool = False
    woken: list[str] = field(default_factory=list)
    orphans_deleted: list[str] = field(default_factory=list)
    skipped: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "letters": self.letters,
            "ids": self.ids,
            "queue": self.queue,
            "unparked": self.unparked,
            "woken": self.woken,
            "orphans_deleted": self.orphans_deleted,
            "skipped": self.skipped,
        }


def redrive(ctx: OperatorContext, request: RedriveRequest) -> RedriveResult:
    control = KeyControl(ctx.redis, ctx.stream)
    if request.skip:
        assert request.key is not None
        with ctx.services():
            connection = ctx.amqp()  # before any change: RabbitMQ down changes nothing
            result = RedriveResult(key=request.key, skipped=True)
            result.unparked = control.unpark(request.key)
            result.woken = wake_keys(ctx.redis, connection, ctx.config, [request.key])
        return result
    index = DeadLetterIndex(ctx.redis, ctx.stream)
    with ctx.services(), DeadLetterLock(ctx.redis, ctx.stream, wait_s=request.wait_s) as lock:
        started = index.clock_ms()
        walk = DeadLetterWalk(ctx.amqp(), ctx.config.dead_letter_queue)
        try:
            index.reconcile(walk.read(), started)  # the walk meets what the index may lack
            key, picked = _pick(walk, request)
            bodies = [_body(letter, request.payload) for letter in picked]
            result = RedriveResult(key=key, letters=len(picked))
            result.ids = list(dict.fromkeys(letter.letter_id for letter in picked))
            result.orphans_deleted = delete_orphans(ctx, control)
            result.queue = _publish_aside(ctx, key, picked, bodies, request.to_key)
            if lock.lost:
                raise LockLost("the dead-letter lock ran out before the letters were put back")
            control.put_ahead_and_unpark(key, result.queue)  # the point of no return
            result.unparked = True
            walk.ack(picked)
            index.remove(picked)
        finally:
            walk.close()
    with ctx.services():
        result.woken = wake_keys(ctx.redis, ctx.amqp(), ctx.config, [key])
    return result


def _pick(walk: DeadLetterWalk, request: RedriveRequest) -> tuple[str, list[DeadLetterMessage]]:
    """The key the letters go back to, and the letters, in queue order."""
    letters = walk.read()
    if request.letter_id is None:
        assert request.key is not None
        picked = of_key(letters, request.key)
        if not picked:
            raise NothingToRedrive(f"no dead letters of key {request.key} in {walk.queue}")
        whole_packs(letters, picked, queue=walk.queue)
        return request.key, picked
    picked = by_ids(letters, [request.letter_id], key=request.key, queue=walk.queue)
    whole_packs(letters, picked, queue=walk.queue)
    target = request.to_key or picked[0].key
    if request.to_key is None and picked[0].foreign:
        raise InvalidInput(f"letter {request.letter_id} has no key: pass --to-key")
    assert target is not None
    return target, picked


def _body(letter: DeadLetterMessage, payload: bytes | None) -> bytes:
    if payload is None:
        return letter.body
    if (letter.content_type or "").split(";")[0].strip().lower() == CONTENT_JSON:
        try:
            orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise InvalidInput(
                f"the payload file is not valid JSON (the letter is {CONTENT_JSON}): {exc}"
            ) from None
    return payload


def redriven_properties(
    letter: DeadLetterMessage, to_key: str | None = None
) -> pika.BasicProperties:
    """The letter as an event again: its headers without the dead-letter ones, its redrive id,
    its new key if it goes to another one; persistent."""
    headers = {name: value for name, value in letter.headers.items() if name not in DEAD_HEADERS}
    headers[HEADER_REDRIVE_ID] = letter.letter_id
    if to_key is not None and to_key != letter.key:
        headers[HEADER_KEY] = to_key
        # Its seq counted in its old key's sequence; in the new key's it would be taken for
        # one of that producer's events there (and move its mark). It goes by its redrive id.
        headers.pop(HEADER_PRODUCER, None)
        headers.pop(HEADER_SEQ, None)
    return pika.BasicProperties(
        delivery_mode=pika.DeliveryMode.Persistent,
        headers=headers,
        content_type=letter.content_type,
        message_id=letter.message_id,
    )


def _publish_aside(
    ctx: OperatorContext,
    key: str,
    letters: Sequence[DeadLetterMessage],
    bodies: Sequence[bytes],
    to_key: str | None,
) -> str:
    """A fresh redrive queue, recorded before it is declared, holding the letters in order,
    all confirmed."""
    queue = redrive_queue_name(ctx.stream, key, uuid.uuid4().hex[:12])
    ctx.redis.hset(ctx.keys.redrives, queue, key)
    publisher = ConfirmWindow(ctx.amqp())
    publisher.declare(queue, keyed_queue_arguments(ctx.stream, ctx.config.queue_type))
    for letter, body in zip(letters, bodies, strict=True):
        publisher.publish(queue, body, redriven_properties(letter, to_key))
    publisher.wait()
    publisher.close()
    return queue


def delete_orphans(ctx: OperatorContext, control: KeyControl) -> list[str]:
    """Delete the recorded redrive queues that are in no key's aside list (left by a run
    killed before its point of no return, or drained already); returns them."""
    recorded = [str(queue) for queue in ctx.redis.hkeys(ctx.keys.redrives)]
    if not recorded:
        return []
    aside = {queue for queues in control.keys_aside().values() for queue in queues}
    orphans = [queue for queue in recorded if queue not in aside]
    connection = ctx.amqp()
    channel = connection.channel()
    for queue in orphans:
        try:
            channel.queue_delete(queue)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != NOT_FOUND:
                raise
            channel = connection.channel()
        ctx.redis.hdel(ctx.keys.redrives, queue)
    channel.close()
    return orphans
