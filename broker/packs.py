"""A pack: several events of one queue in one AMQP message, and how to read one.

The broker spends about the same CPU on a message of one event as on a message of fifty, so a
producer sends the events of a queue that wait together as one message. Each event inside
keeps what it would have had as a message of its own: its message id, content type, headers
(key, producer, seq, ...) and body. The layout is plain so that consumers in other languages
can read it (docs/pack-format.md):

    body    = MAGIC record+
    record  = u32 meta_length, meta (UTF-8 JSON), u32 body_length, body
    meta    = {"message_id": str | null, "content_type": str | null, "headers": {...}}

Lengths are unsigned 32-bit big-endian. Header values are JSON strings, integers, booleans or
null; a bytes value is ``{"bytes": "<base64>"}``. The message itself has content type
``PACK_CONTENT_TYPE`` and the header ``x-keyq-pack`` (the number of events).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import orjson

from keyq.broker.errors import KeyqError

PACK_CONTENT_TYPE = "application/vnd.keyq.pack"
HEADER_PACK = "x-keyq-pack"  # on a pack: how many events it holds
MAGIC = b"KQP1"
MAX_COUNT_DIGITS = 18  # a count header longer than this is no count
_LENGTH = struct.Struct(">I")
# A record's fixed cost: its two lengths.
RECORD_OVERHEAD = 2 * _LENGTH.size


class MalformedPack(KeyqError):
    """A message labelled as a pack whose body is not one (it is dead-lettered whole)."""


@dataclass(frozen=True, slots=True)
class PackedEvent:
    """One event read from a pack: what a message of its own would have carried."""

    message_id: str | None
    content_type: str | None
    headers: dict[str, Any]
    body: bytes


def is_pack(content_type: str | None) -> bool:
    return content_type == PACK_CONTENT_TYPE


def encode_record(
    message_id: str | None, content_type: str | None, headers: Mapping[str, Any], body: bytes
) -> bytes:
    """One event's record; a pack's body is ``MAGIC`` followed by its records."""
    meta = orjson.dumps(
        {
            "message_id": message_id,
            "content_type": content_type,
            "headers": {name: _header_to_json(value) for name, value in headers.items()},
        }
    )
    return b"".join((_LENGTH.pack(len(meta)), meta, _LENGTH.pack(len(body)), body))


def encode_pack(records: list[bytes]) -> bytes:
    return MAGIC + b"".join(records)


def decode_pack(body: bytes, declared: object = None) -> list[PackedEvent]:
    """The events of a pack, in order; ``MalformedPack`` says what is wrong with it.
    ``declared`` is the message's ``x-keyq-pack`` header, if it has one: a body that holds
    another number of events lost or gained some on the way, and is not read."""
    if not body.startswith(MAGIC):
        raise MalformedPack("not a keyq pack: it does not start with KQP1")
    view = memoryview(body)
    offset = len(MAGIC)
    events: list[PackedEvent] = []
    while offset < len(body):
        meta_bytes, offset = _chunk(view, offset, "meta")
        event_body, offset = _chunk(view, offset, "body")
        try:
            meta = orjson.loads(meta_bytes)
        except orjson.JSONDecodeError as exc:
            raise MalformedPack(
                f"event {len(events) + 1} of the pack: meta is not JSON: {exc}"
            ) from None
        events.append(_event(meta, event_body, len(events) + 1))
    if not events:
        raise MalformedPack("the pack holds no event")
    if declared is not None and _count(declared) != len(events):
        raise MalformedPack(
            f"the pack's {HEADER_PACK} header says {declared!r} events, its body holds "
            f"{len(events)}"
        )
    return events


def _count(declared: object) -> int | None:
    """The event count an ``x-keyq-pack`` header gives: an integer, its ASCII decimal text,
    or a whole-valued float or decimal (as some clients send numbers); None for anything
    else, which no pack's body matches."""
    if isinstance(declared, bool):
        return None
    if isinstance(declared, int):
        return declared
    if isinstance(declared, bytes):
        declared = declared.decode("ascii", "replace")
    if isinstance(declared, str):
        text = declared.strip()
        digits = text.isascii() and text.isdigit() and len(text) <= MAX_COUNT_DIGITS
        return int(text) if digits else None
    if isinstance(declared, float | Decimal):
        try:
            whole = int(declared)
        except (ValueError, OverflowError, ArithmeticError):  # nan, inf
            return None
        return whole if whole == declared else None
    return None


def _chunk(view: memoryview, offset: int, what: str) -> tuple[bytes, int]:
    end = offset + _LENGTH.size
    if end > len(view):
        raise MalformedPack(f"the pack ends inside the length of a {what}")
    (length,) = _LENGTH.unpack(view[offset:end])
    if end + length > len(view):
        raise MalformedPack(f"a {what} of {length} bytes runs past the end of the pack")
    return bytes(view[end : end + length]), end + length


def _event(meta: object, body: bytes, number: int) -> PackedEvent:
    if not isinstance(meta, dict):
        raise MalformedPack(f"event {number} of the pack: meta is not a JSON object")
    message_id = meta.get("message_id")
    content_type = meta.get("content_type")
    headers = meta.get("headers", {})
    if message_id is not None and not isinstance(message_id, str):
        raise MalformedPack(f"event {number} of the pack: message_id is not a string")
    if content_type is not None and not isinstance(content_type, str):
        raise MalformedPack(f"event {number} of the pack: content_type is not a string")
    if not isinstance(headers, dict):
        raise MalformedPack(f"event {number} of the pack: headers is not a JSON object")
    try:
        decoded = {str(name): _header_from_json(value) for name, value in headers.items()}
    except (ValueError, TypeError) as exc:
        raise MalformedPack(f"event {number} of the pack: bad header value: {exc}") from None
    return PackedEvent(message_id, content_type, decoded, body)


def _header_to_json(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": base64.b64encode(value).decode("ascii")}
    return value


def _header_from_json(value: Any) -> Any:
    if isinstance(value, dict):
        encoded = value.get("bytes")
        if len(value) != 1 or not isinstance(encoded, str):
            raise ValueError('an object header value must be {"bytes": "<base64>"}')
        return base64.b64decode(encoded, validate=True)
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    raise ValueError(f"{type(value).__name__} is not a header value")
