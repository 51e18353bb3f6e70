"""An index of a stream's dead letters in Redis, so that listing, showing and inspecting them
never walks the dead-letter queue (AMQP cannot browse a queue: a walk takes every message).

Whoever dead-letters writes the entry once the copy is confirmed and before the original is
acked (the worker, ``keyq.worker.batch.attempt``): an entry never lags a letter that exists for
longer than that step. Letters RabbitMQ dead-letters by itself (a rejection, a quorum queue's
delivery limit) pass no keyq code: the walks that move letters (redrive, drop, reindex) index
every letter they meet and drop entries of letters that were gone when they began
(``reconcile``), then take out what they removed (``remove``).

An entry is one letter of one key (a letter id is unique only within its key), with how many
copies of it the queue holds. All keys share the stream's hash tag; the scripts build the
per-key and per-reason key names from the index's prefix, all in that one slot.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from keyq.broker.dead_letter_queue import DeadLetterMessage
from keyq.broker.dead_letter_scripts import ADD, MET, PARTS, REMOVE, UNMET
from keyq.broker.redis_keys import StreamKeys

PREVIEW_BYTES = 60
PAYLOAD_KEPT_BYTES = 16_384  # a longer payload is kept cut; ``dlq show --walk`` reads it whole
CHUNK = 500  # entries per script call


def preview(body: bytes, limit: int = PREVIEW_BYTES) -> str:
    """The first ``limit`` bytes as printable text: undecodable bytes and control characters
    shown as ``.``, and ``…`` when the body is longer."""
    text = body[:limit].decode("utf-8", "replace")
    shown = "".join(char if char.isprintable() and char != "\ufffd" else "." for char in text)
    return shown + ("…" if len(body) > limit else "")


def plain(value: object) -> Any:
    """Header values as JSON-ready values (bytes as text, or ``base64:``)."""
    if isinstance(value, Mapping):
        return {str(name): plain(item) for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return "base64:" + base64.b64encode(value).decode()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def entry_name(letter_id: str, key: str | None) -> str:
    """The entry of a letter: its id, then its key in hex (empty for a foreign letter), so
    that the entries of one id sort together (``by-id`` lex ranges)."""
    return f"{letter_id}\x00{'' if key is None else key.encode().hex()}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def letter_fields(letter: DeadLetterMessage) -> dict[str, Any]:
    """One letter's summary, JSON-ready (what ``dlq list`` shows of it)."""
    pack = letter.pack
    return {
        "id": letter.letter_id,
        "key": None if letter.foreign else letter.key,
        "foreign": letter.foreign,
        "producer": letter.producer,
        "seq": letter.seq,
        "reason": letter.reason,
        "attempts": letter.attempts,
        "dead_at_ms": letter.dead_at_ms,
        "dead_queue": letter.dead_queue,
        "published_at_ms": letter.published_at_ms,
        "content_type": letter.content_type,
        "bytes": len(letter.body),
        "preview": preview(letter.body),
        "pack": None
        if pack is None
        else {"message_id": pack.message_id, "events": pack.events, "part": pack.part},
    }


def payload_fields(body: bytes, limit: int | None = None) -> dict[str, Any]:
    """The payload as text when it is UTF-8, else base64; cut to ``limit`` bytes if given."""
    cut = limit is not None and len(body) > limit
    kept = body[:limit] if cut else body
    try:
        payload = kept.decode("utf-8")
        encoding = "utf-8"
    except UnicodeDecodeError:
        payload = base64.b64encode(kept).decode()
        encoding = "base64"
    return {"payload": payload, "payload_encoding": encoding, "payload_cut": cut}


def letter_extra(letter: DeadLetterMessage, limit: int | None = None) -> dict[str, Any]:
    """What ``dlq show`` adds to the summary: every header, the message id, the payload."""
    extra = {
        "key_header": letter.key,
        "message_id": letter.message_id,
        "headers": plain(letter.headers),
        "pack_headers": None if letter.pack is None else plain(letter.pack.headers),
    }
    return extra | payload_fields(letter.body, limit)


@dataclass(frozen=True)
class Page:
    """Entries of a listing in time order, and how many matched in all."""

    rows: list[dict[str, Any]]
    matched: int


class DeadLetterIndex:
    """The index of one stream's dead letters (see the module docstring)."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self._client = client
        self._keys = StreamKeys(stream)
        self._prefix = self._keys.dead_letter_index_prefix
        self._parts = [self._keys.dead_letter_index(part) for part in PARTS]
        self._add = client.register_script(ADD)
        self._remove = client.register_script(REMOVE)
        self._met = client.register_script(MET)
        self._unmet = client.register_script(UNMET)

    def _key(self, part: str) -> str:
        return self._keys.dead_letter_index(part)

    # ---- writing ----------------------------------------------------------------------------

    def clock_ms(self) -> int:
        """Redis' time in ms: a walk's start, on the clock entries are stamped with."""
        seconds, micros = self._client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def add(self, letters: Sequence[DeadLetterMessage]) -> None:
        """Index letters just put in the dead-letter queue (a copy each)."""
        grouped = _grouped(letters)
        for chunk in _chunks(list(grouped.values()), CHUNK):
            self._add(keys=self._parts, args=[self._prefix, *_entry_args(chunk)])

    def remove(self, letters: Sequence[DeadLetterMessage]) -> None:
        """Take out letters a walk removed from the queue (each copy once)."""
        grouped = _grouped(letters)
        args: list[Any] = []
        for name, (_letter, copies, _weight) in grouped.items():
            args += [name, copies]
        for chunk in _chunks(args, 2 * CHUNK):
            self._remove(keys=self._parts, args=[self._prefix, *chunk])

    def reconcile(self, letters: Sequence[DeadLetterMessage], started_ms: int) -> None:
        """After a walk that began at ``started_ms`` (``clock_ms``) and met ``letters``, every
        letter that was ready then: index those it lacks, set each entry's copies, drop the
        entries of letters that were gone before it began."""
        grouped = _grouped(letters)
        for chunk in _chunks(list(grouped.values()), CHUNK):
            self._met(keys=self._parts, args=[self._prefix, started_ms, *_entry_args(chunk)])
        known = self._client.zrange(self._key("by-time"), 0, -1)
        unmet = [str(name) for name in known if name not in grouped]
        for names in _chunks(unmet, CHUNK):
            self._unmet(keys=self._parts, args=[self._prefix, started_ms, *names])

    # ---- reading ----------------------------------------------------------------------------

    def counts(self) -> tuple[int, int]:
        """(letters, messages) the index lists: copies counted, a pack one message."""
        letters, messages = self._client.hmget(self._key("counts"), ["letters", "messages"])
        return max(0, int(letters or 0)), max(0, int(messages or 0))

    def page(self, limit: int | None, offset: int = 0) -> Page:
        """The oldest ``limit`` entries (all if None) past the first ``offset``."""
        return self._page_of(self._key("by-time"), limit, offset)

    def of_key(self, key: str, limit: int | None, offset: int = 0) -> Page:
        """The key's oldest ``limit`` entries past the first ``offset``."""
        page = self._page_of(self._key(f"key:{_digest(key)}"), limit, offset)
        return Page([row for row in page.rows if row["key"] == key], page.matched)

    def with_reason(self, text: str, limit: int | None, key: str | None = None) -> Page:
        """The oldest ``limit`` entries whose reason holds ``text`` (of ``key``, if given),
        through the distinct reasons, never the entries."""
        if key is not None:
            rows = [row for row in self.of_key(key, None).rows if text in (row["reason"] or "")]
            return Page(rows[:limit], len(rows))
        reasons = {str(d): str(r) for d, r in self._client.hgetall(self._key("reasons")).items()}
        sets = [self._key(f"reason:{d}") for d, reason in reasons.items() if text in reason]
        pipe = self._client.pipeline(transaction=False)
        for name in sets:
            pipe.zcard(name)
            pipe.zrange(name, 0, -1 if limit is None else limit - 1, withscores=True)
        answers = pipe.execute()
        matched = sum(int(count) for count in answers[0::2])
        scored = sorted((score, str(name)) for found in answers[1::2] for name, score in found)
        names = [name for _score, name in scored][:limit]
        return Page(self._rows(names), matched)

    def by_id(self, letter_id: str) -> list[dict[str, Any]]:
        """Every entry of ``letter_id`` (one per key), each with its details."""
        low, high = f"[{letter_id}\x00", f"({letter_id}\x01"
        names = [str(name) for name in self._client.zrangebylex(self._key("by-id"), low, high)]
        return self.details(names)

    def details(self, names: Sequence[str]) -> list[dict[str, Any]]:
        """Rows with headers and payload of the entries ``names``."""
        if not names:
            return []
        extras = dict(
            zip(names, self._client.hmget(self._key("details"), list(names)), strict=True)
        )
        return [
            row | (orjson.loads(extra) if (extra := extras.get(row["entry"])) else {})
            for row in self._rows(list(names))
        ]

    def _page_of(self, name: str, limit: int | None, offset: int = 0) -> Page:
        pipe = self._client.pipeline(transaction=False)
        pipe.zcard(name)
        pipe.zrange(name, offset, -1 if limit is None else offset + limit - 1)
        matched, names = pipe.execute()
        return Page(self._rows([str(entry) for entry in names]), int(matched))

    def _rows(self, names: list[str]) -> list[dict[str, Any]]:
        if not names:
            return []
        pipe = self._client.pipeline(transaction=False)
        pipe.hmget(self._key("rows"), names)
        pipe.hmget(self._key("copies"), names)
        rows, copies = pipe.execute()
        found = []
        for name, row, count in zip(names, rows, copies, strict=True):
            if row is None:
                continue  # taken out meanwhile
            fields = orjson.loads(row)
            for private in ("kd", "rd", "w"):
                fields.pop(private, None)
            found.append(fields | {"entry": name, "copies": int(count or 0)})
        return found


def _grouped(
    letters: Iterable[DeadLetterMessage],
) -> dict[str, tuple[DeadLetterMessage, int, int]]:
    """Entry -> (its first letter, copies, messages per copy: 1, or 0 for a pack's events
    but the first, so that a pack counts once)."""
    grouped: dict[str, tuple[DeadLetterMessage, int, int]] = {}
    for letter in letters:
        name = entry_name(letter.letter_id, None if letter.foreign else letter.key)
        weight = 1 if letter.pack is None or letter.pack.part == 1 else 0
        first, copies, _weight = grouped.get(name, (letter, 0, weight))
        grouped[name] = (first, copies + 1, weight)
    return grouped


def _entry_args(entries: Sequence[tuple[DeadLetterMessage, int, int]]) -> list[Any]:
    args: list[Any] = []
    for letter, copies, weight in entries:
        fields = letter_fields(letter)
        key, reason = fields["key"], fields["reason"]
        private = {
            "kd": "" if key is None else _digest(key),
            "rd": "" if reason is None else _digest(reason),
            "w": weight,
        }
        row = orjson.dumps(fields | private)
        detail = orjson.dumps(letter_extra(letter, PAYLOAD_KEPT_BYTES))
        score = int(fields["dead_at_ms"] or 0)  # pika reads a long as an int that prints "…L"
        args += [entry_name(fields["id"], key), score, row, detail, copies, reason or ""]
    return args


def _chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
