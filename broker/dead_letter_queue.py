"""Reading a stream's dead-letter queue without losing or reordering it.

AMQP cannot browse a queue, so a walk takes the messages that were ready when it started, one
``basic.get`` at a time, on a channel of its own with manual acks, and never acks any of them
unless asked to. At the end every unacked message is handed back to the queue at its place
(``DeadLetterWalk.close``); a process killed mid-walk closes its connection, which does the
same. A letter is
removed only by ``ack`` (a drop, or a redrive past its point of no return).

Each letter has an id: ``<producer>:<seq>`` for an event keyq's SDK published (it carries the
key, producer and seq headers), else ``sha256:`` and the first 16 hex digits of the SHA-256 of
its body and its sorted headers, so the same letter gets the same id in every walk.
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from keyq.broker.envelope import (
    HEADER_ATTEMPTS,
    HEADER_DEAD_AT,
    HEADER_DEAD_QUEUE,
    HEADER_DEAD_REASON,
    HEADER_KEY,
    HEADER_PRODUCER,
    HEADER_REDRIVE_ID,
    HEADER_SEQ,
)
from keyq.broker.text import as_text

NOT_FOUND = 404
FOREIGN_ID_PREFIX = "sha256:"
FOREIGN_ID_DIGITS = 16
HAND_BACK_WAIT_S = 2.0  # at most, for a quorum queue to show the letters handed back
# Set by the broker, not the sender: a quorum queue counts each time a message comes back to
# it (on 4.3 and later, not a walk's nack), and RabbitMQ 4 also how often it was handed out,
# so these are left out of a letter's id and of a redriven copy.
BROKER_HEADERS = frozenset({"x-delivery-count", "x-acquired-count"})
# Said of a letter by whoever dead-lettered it (and of a copy put back): not the event's own,
# so left out of a letter's id, which two copies of one event then share.
LETTER_HEADERS = frozenset(
    {HEADER_DEAD_REASON, HEADER_DEAD_QUEUE, HEADER_ATTEMPTS, HEADER_DEAD_AT, HEADER_REDRIVE_ID}
)


@dataclass(frozen=True)
class DeadLetterMessage:
    """One letter as a walk took it: its place in the walk (``position``, from 0) and the
    delivery tag that acks it on the walk's channel."""

    position: int
    delivery_tag: int
    body: bytes
    headers: Mapping[str, Any] = field(default_factory=dict)
    content_type: str | None = None
    message_id: str | None = None

    @property
    def key(self) -> str | None:
        value = self.headers.get(HEADER_KEY)
        return as_text(value) if value is not None else None

    @property
    def producer(self) -> str | None:
        value = self.headers.get(HEADER_PRODUCER)
        return as_text(value) if value is not None else None

    @property
    def seq(self) -> int | None:
        value = self.headers.get(HEADER_SEQ)
        try:
            return None if value is None else int(as_text(value))
        except ValueError:
            return None

    @property
    def foreign(self) -> bool:
        """Not an event of keyq's SDK: no key, producer or seq header."""
        return self.key is None or self.producer is None or self.seq is None

    @property
    def letter_id(self) -> str:
        if not self.foreign:
            return f"{self.producer}:{self.seq}"
        return content_id(self.body, self.headers)

    @property
    def reason(self) -> str | None:
        value = self.headers.get(HEADER_DEAD_REASON)
        return None if value is None else as_text(value)

    @property
    def dead_queue(self) -> str | None:
        value = self.headers.get(HEADER_DEAD_QUEUE)
        return None if value is None else as_text(value)

    @property
    def attempts(self) -> int | None:
        return _int(self.headers.get(HEADER_ATTEMPTS))

    @property
    def dead_at_ms(self) -> int | None:
        return _int(self.headers.get(HEADER_DEAD_AT))


def content_id(body: bytes, headers: Mapping[str, Any]) -> str:
    """``sha256:`` + 16 hex digits over the body and the headers sorted by name: the same for
    the same letter in every walk, and for two copies of one event dead-lettered twice
    (nothing of a delivery, such as its tag or the broker's delivery count, goes in, nor why
    or when it was dead-lettered)."""
    digest = hashlib.sha256()
    left_out = BROKER_HEADERS | LETTER_HEADERS
    own = {name: value for name, value in headers.items() if name not in left_out}
    digest.update(orjson.dumps(_canonical(own), option=orjson.OPT_SORT_KEYS))
    digest.update(b"\0")
    digest.update(body)
    return FOREIGN_ID_PREFIX + digest.hexdigest()[:FOREIGN_ID_DIGITS]


def _canonical(value: object) -> object:
    """Header values as JSON-encodable values, the same every time."""
    if isinstance(value, Mapping):
        return {str(name): _canonical(item) for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(item) for item in value]
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, (decimal.Decimal, datetime.datetime)):
        return {type(value).__name__: str(value)}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return {type(value).__name__: repr(value)}


def _int(value: object) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(as_text(value)) if not isinstance(value, int) else value
    except ValueError:
        return None


class DeadLetterWalk:
    """The letters that were ready in a dead-letter queue when the walk began, in queue order,
    each held unacked on the walk's own channel until ``close``.

    ``connection`` is a blocking connection used from one thread. A queue that does not
    exist (nothing was ever dead-lettered) is an empty walk, ``missing``; pika's errors are
    raised.
    """

    def __init__(self, connection: pika.BlockingConnection, queue: str) -> None:
        self.queue = queue
        self.letters: list[DeadLetterMessage] = []
        self.missing = False
        self.ready_at_start = 0
        self._acked = 0
        self._channel: BlockingChannel | None = connection.channel()
        try:
            declared = self._channel.queue_declare(queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._channel = None
            if exc.reply_code != NOT_FOUND:
                raise
            self.missing = True
            return
        self.ready_at_start = int(declared.method.message_count)

    def read(self, *, stop_after: int | None = None) -> list[DeadLetterMessage]:
        """Take every letter ready at the start, in order, and return them (or the first
        ``stop_after``). Fewer come back when some are held elsewhere meanwhile. All are taken
        even when fewer are wanted: a quorum queue puts what is handed back behind what it
        kept, so handing back only the first few would move them to the end."""
        if self.missing:
            return self.letters
        channel = self._open()
        while len(self.letters) < self.ready_at_start:
            method, properties, body = channel.basic_get(self.queue, auto_ack=False)
            if method is None:
                break
            self.letters.append(
                DeadLetterMessage(
                    position=len(self.letters),
                    delivery_tag=int(method.delivery_tag),
                    body=bytes(body),
                    headers=dict(properties.headers or {}),
                    content_type=properties.content_type,
                    message_id=properties.message_id,
                )
            )
        return self.letters if stop_after is None else self.letters[:stop_after]

    def ack(self, letters: Sequence[DeadLetterMessage]) -> None:
        """Remove these letters from the queue for good (one ack each, never ``multiple``:
        the letters between them stay)."""
        if not letters:
            return
        channel = self._open()
        for letter in letters:
            channel.basic_ack(letter.delivery_tag)
        self._acked += len(letters)

    def close(self) -> None:
        """Hand back every letter not acked, at its place in the queue: with a ``nack`` of
        everything outstanding, then wait (briefly) until the queue shows them again, then
        close the channel. On RabbitMQ 4.3 and later a quorum queue counts a letter handed
        back by a closed channel against its delivery limit (20 by default; then it drops
        the letter) and a nack not; and a quorum queue takes a hand-back asynchronously, so a
        walk right after this one would find letters missing without the wait."""
        channel, self._channel = self._channel, None
        if channel is None or not channel.is_open:
            return
        with contextlib.suppress(pika.exceptions.AMQPError):
            if self._acked < len(self.letters):
                channel.basic_nack(0, multiple=True, requeue=True)
                self._wait_handed_back(channel, self.ready_at_start - self._acked)
            channel.close()

    def _wait_handed_back(self, channel: BlockingChannel, expected: int) -> None:
        deadline = time.monotonic() + HAND_BACK_WAIT_S
        while time.monotonic() < deadline:
            declared = channel.queue_declare(self.queue, passive=True)
            if int(declared.method.message_count) >= expected:
                return
            time.sleep(0.005)

    def _open(self) -> BlockingChannel:
        if self._channel is None or not self._channel.is_open:
            raise pika.exceptions.ChannelWrongStateError("the walk's channel is closed")
        return self._channel

    def __enter__(self) -> DeadLetterWalk:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
