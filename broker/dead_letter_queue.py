"""Reading a stream's dead-letter queue without losing or reordering it.

AMQP cannot browse a queue, so a walk takes the messages that were ready when it started, one
``basic.get`` at a time, on a channel of its own with manual acks, and never acks any of them
unless asked to. At the end every unacked message is requeued at its place in the queue
(``DeadLetterWalk.close``); a process killed mid-walk closes its connection, which does the
same. A letter is removed only by ``ack`` (a drop, or a redrive past its point of no return).

Each letter has an id: ``<producer>:<seq>`` for an event keyq's SDK published (it carries the
key, producer and seq headers), else ``sha256:`` and the first 16 hex digits of the SHA-256 of
its body and its sorted headers, so the same letter gets the same id in every walk.

A pack (``keyq.broker.packs``) that the broker dead-lettered whole (a consumer rejected it, a
quorum queue's delivery limit) is read as its events: each is a letter of its own, with its own
headers, body and id, and ``pack`` says which message it is part of and why that message died.
They share the message's delivery tag, so they leave the queue together or not at all: ``ack``
refuses some of a pack's events without the others. A message labelled as a pack whose body is
not one stays one letter, the whole message.
"""

from __future__ import annotations

import calendar
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

from keyq.broker.backoff import Backoff
from keyq.broker.envelope import (
    HEADER_ATTEMPTS,
    HEADER_DEAD_AT,
    HEADER_DEAD_QUEUE,
    HEADER_DEAD_REASON,
    HEADER_KEY,
    HEADER_PRODUCER,
    HEADER_PUBLISHED_AT,
    HEADER_REDRIVE_ID,
    HEADER_SEQ,
)
from keyq.broker.errors import InvalidInput
from keyq.broker.packs import HEADER_PACK, MalformedPack, decode_pack, is_pack
from keyq.broker.queue_probe import QueueProbe
from keyq.broker.text import as_text

FOREIGN_ID_PREFIX = "sha256:"
FOREIGN_ID_DIGITS = 16
REQUEUE_WAIT_S = 2.0  # at most, for a quorum queue to show the letters requeued
REQUEUE_POLL_S = 0.005  # the first pause between two looks; they grow up to the max
REQUEUE_POLL_MAX_S = 0.1
# Set by the broker, not the sender: a quorum queue counts each time a message comes back to
# it (on 4.3 and later, not a walk's nack), and RabbitMQ 4 also how often it was handed out,
# so these are left out of a letter's id and of a redriven copy.
BROKER_HEADERS = frozenset({"x-delivery-count", "x-acquired-count"})
# Said of a letter by whoever dead-lettered it (and of a copy put back): not the event's own,
# so left out of a letter's id, which two copies of one event then share.
LETTER_HEADERS = frozenset(
    {HEADER_DEAD_REASON, HEADER_DEAD_QUEUE, HEADER_ATTEMPTS, HEADER_DEAD_AT, HEADER_REDRIVE_ID}
)
# What RabbitMQ says of a message it dead-lettered: a list of tables, the latest first.
X_DEATH = "x-death"


class PartialPack(InvalidInput):
    """Some but not all events of a dead-lettered pack were to be removed: a pack is one
    message, acked whole."""


@dataclass(frozen=True)
class PackPart:
    """A letter's place in a pack the broker dead-lettered whole: the pack message's id, how
    many events it holds, this one's place among them (from 1) and the message's own headers
    (why, when and from where it was dead-lettered)."""

    message_id: str | None
    events: int
    part: int
    headers: Mapping[str, Any] = field(default_factory=dict)


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
    pack: PackPart | None = None

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
    def published_at_ms(self) -> int | None:
        return _int(self.headers.get(HEADER_PUBLISHED_AT))

    @property
    def message_headers(self) -> Mapping[str, Any]:
        """The headers of the message that was dead-lettered: the pack's for an event of a
        pack, else the letter's own. Why, when and from where it died are read from them."""
        return self.pack.headers if self.pack is not None else self.headers

    @property
    def reason(self) -> str | None:
        """keyq's ``x-keyq-dead-reason``, else the reason in RabbitMQ's ``x-death`` (such as
        ``rejected`` or ``delivery_limit``)."""
        value = self.message_headers.get(HEADER_DEAD_REASON)
        if value is None:
            value = _latest_death(self.message_headers).get("reason")
        return None if value is None else as_text(value)

    @property
    def dead_queue(self) -> str | None:
        value = self.message_headers.get(HEADER_DEAD_QUEUE)
        if value is None:
            value = _latest_death(self.message_headers).get("queue")
        return None if value is None else as_text(value)

    @property
    def attempts(self) -> int | None:
        return _int(self.message_headers.get(HEADER_ATTEMPTS))

    @property
    def dead_at_ms(self) -> int | None:
        value = self.message_headers.get(HEADER_DEAD_AT)
        if value is None:
            return _ms(_latest_death(self.message_headers).get("time"))
        return _int(value)


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


def _latest_death(headers: Mapping[str, Any]) -> Mapping[str, Any]:
    """The latest entry of RabbitMQ's ``x-death`` header, or nothing."""
    deaths = headers.get(X_DEATH)
    if isinstance(deaths, (list, tuple)) and deaths and isinstance(deaths[0], Mapping):
        return deaths[0]
    return {}


def _ms(value: object) -> int | None:
    """An AMQP timestamp (pika reads it as a naive UTC datetime) in ms since the epoch."""
    if not isinstance(value, datetime.datetime):
        return None
    if value.tzinfo is not None:
        return int(value.timestamp() * 1000)
    return calendar.timegm(value.utctimetuple()) * 1000


def letters_of(
    position: int,
    delivery_tag: int,
    body: bytes,
    properties: pika.BasicProperties,
) -> list[DeadLetterMessage]:
    """A dead-lettered message as letters: a pack's events, in order, or the message alone
    (also when it is labelled as a pack but is not one)."""
    headers = dict(properties.headers or {})
    whole = DeadLetterMessage(
        position, delivery_tag, body, headers, properties.content_type, properties.message_id
    )
    if not is_pack(properties.content_type):
        return [whole]
    try:
        events = decode_pack(body, headers.get(HEADER_PACK))
    except MalformedPack:
        return [whole]
    return [
        DeadLetterMessage(
            position,
            delivery_tag,
            event.body,
            event.headers,
            event.content_type,
            event.message_id,
            PackPart(properties.message_id, len(events), part, headers),
        )
        for part, event in enumerate(events, start=1)
    ]


def packs_left_partly(
    letters: Sequence[DeadLetterMessage], picked: Sequence[DeadLetterMessage]
) -> list[tuple[list[DeadLetterMessage], list[DeadLetterMessage]]]:
    """Each pack of ``letters`` some but not all of whose events are in ``picked``: (its
    events, those not picked), in queue order."""
    chosen = {_part_of(letter) for letter in picked if letter.pack is not None}
    touched = {tag for tag, _part in chosen}
    packs: dict[int, list[DeadLetterMessage]] = {}
    for letter in letters:
        if letter.pack is not None and letter.delivery_tag in touched:
            packs.setdefault(letter.delivery_tag, []).append(letter)
    found = []
    for events in packs.values():
        left = [event for event in events if _part_of(event) not in chosen]
        if left:
            found.append((events, left))
    return found


def _part_of(letter: DeadLetterMessage) -> tuple[int, int]:
    return letter.delivery_tag, 0 if letter.pack is None else letter.pack.part


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
        self._taken = 0  # messages taken (a pack is one message, several letters)
        self._acked = 0  # messages acked
        self._probe = QueueProbe(connection.channel)
        counts = self._probe.counts(queue)
        self.missing = counts is None
        self.ready_at_start = 0 if counts is None else counts.ready
        self._channel: BlockingChannel | None = None if counts is None else connection.channel()

    def read(self, *, stop_after: int | None = None) -> list[DeadLetterMessage]:
        """Take every message ready at the start, in order, and return its letters (or the
        first ``stop_after``): a pack's events, or the message alone; the letters of one
        message share its ``position``. Fewer come back when some are held elsewhere
        meanwhile. All are taken even when fewer are wanted: a quorum queue puts what is
        requeued behind what it kept, so requeuing only the first few would move them to the
        end."""
        if self.missing:
            return self.letters
        channel = self._open()
        while self._taken < self.ready_at_start:
            method, properties, body = channel.basic_get(self.queue, auto_ack=False)
            if method is None:
                break
            self.letters.extend(
                letters_of(self._taken, int(method.delivery_tag), bytes(body), properties)
            )
            self._taken += 1
        return self.letters if stop_after is None else self.letters[:stop_after]

    def ack(self, letters: Sequence[DeadLetterMessage]) -> None:
        """Remove these letters from the queue for good (one ack per message, never
        ``multiple``: the letters between them stay). A pack goes whole: ``PartialPack``,
        and nothing acked, when some of its events are not among ``letters``."""
        if not letters:
            return
        partly = packs_left_partly(self.letters, letters)
        if partly:
            events, left = partly[0]
            raise PartialPack(
                f"{len(left)} of the {len(events)} events of a pack are not to be removed "
                "with the rest: a pack is removed whole or not at all"
            )
        channel = self._open()
        tags = list(dict.fromkeys(letter.delivery_tag for letter in letters))
        for tag in tags:
            channel.basic_ack(tag)
        self._acked += len(tags)

    def close(self) -> None:
        """Requeue every letter not acked, at its place in the queue: with a ``nack`` of
        everything outstanding, then wait (briefly) until the queue shows them again, then
        close the channels. On RabbitMQ 4.3 and later a quorum queue counts a letter
        requeued by a closed channel against its delivery limit (20 by default; then it
        drops the letter) and a nack not; and a quorum queue requeues asynchronously, so a
        walk right after this one would find letters missing without the wait."""
        channel, self._channel = self._channel, None
        if channel is not None and channel.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                if self._acked < self._taken:
                    channel.basic_nack(0, multiple=True, requeue=True)
                    self._wait_requeued(self.ready_at_start - self._acked)
                channel.close()
        self._probe.close()

    def _wait_requeued(self, expected: int) -> None:
        deadline = time.monotonic() + REQUEUE_WAIT_S
        backoff = Backoff(REQUEUE_POLL_S, REQUEUE_POLL_MAX_S)
        while time.monotonic() < deadline:
            counts = self._probe.counts(self.queue)
            if counts is None or counts.ready >= expected:
                return
            time.sleep(backoff.next())

    def _open(self) -> BlockingChannel:
        if self._channel is None or not self._channel.is_open:
            raise pika.exceptions.ChannelWrongStateError("the walk's channel is closed")
        return self._channel

    def __enter__(self) -> DeadLetterWalk:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
