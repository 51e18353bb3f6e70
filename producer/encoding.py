"""Turning events into message bodies, with every refusal happening before anything is sent."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from keyq.broker.envelope import CONTENT_BYTES, CONTENT_JSON
from keyq.broker.errors import InvalidEvent

MAX_DEPTH = 200


@dataclass(frozen=True, slots=True)
class PreparedEvent:
    """An event checked and encoded for its queue, not yet numbered or sent."""

    queue: str
    key: str
    body: bytes
    content_type: str
    headers: dict[str, Any]


def _check_finite(value: Any, depth: int = 0) -> None:
    """JSON has no NaN or infinity, and orjson would silently turn them into null."""
    if depth > MAX_DEPTH:
        raise InvalidEvent(f"event is nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidEvent(f"event holds {value!r}, which JSON cannot represent")
    elif isinstance(value, dict):
        for item in value.values():
            if isinstance(item, (float, dict, list, tuple)):
                _check_finite(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, (float, dict, list, tuple)):
                _check_finite(item, depth + 1)


def encode_event(event: object, content_type: str | None = None) -> tuple[bytes, str]:
    """The message body and content type for ``event``: JSON for dicts, as-is for bytes
    (labelled ``content_type``, by default ``application/octet-stream``)."""
    if isinstance(event, (bytes, bytearray, memoryview)):
        return bytes(event), check_content_type(content_type or CONTENT_BYTES)
    if content_type is not None and content_type != CONTENT_JSON:
        raise InvalidEvent(f"a dict event is sent as {CONTENT_JSON}; send bytes for {content_type}")
    if not isinstance(event, Mapping):
        raise InvalidEvent(
            f"event must be a dict (sent as JSON) or bytes, got {type(event).__name__}"
        )
    data = event if isinstance(event, dict) else dict(event)
    _check_finite(data)
    try:
        return orjson.dumps(data), CONTENT_JSON
    except (orjson.JSONEncodeError, TypeError) as exc:
        raise InvalidEvent(f"event cannot be serialised to JSON: {exc}") from None


MAX_CONTENT_TYPE_CHARS = 255
MAX_DEDUPE_ID_BYTES = 255


def check_content_type(content_type: object) -> str:
    if not isinstance(content_type, str) or not content_type.strip():
        raise InvalidEvent(f"content_type must be a non-empty string, got {content_type!r}")
    if len(content_type) > MAX_CONTENT_TYPE_CHARS or not content_type.isascii():
        raise InvalidEvent("content_type must be ASCII of at most 255 characters")
    return content_type


def check_dedupe_id(dedupe_id: object) -> str:
    """An application's id for an event: a non-empty string of at most 255 bytes."""
    if not isinstance(dedupe_id, str) or not dedupe_id:
        raise InvalidEvent(f"dedupe_id must be a non-empty string, got {dedupe_id!r}")
    try:
        size = len(dedupe_id.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidEvent("dedupe_id is not valid Unicode text") from None
    if size > MAX_DEDUPE_ID_BYTES:
        raise InvalidEvent(f"dedupe_id is {size} bytes; the limit is {MAX_DEDUPE_ID_BYTES}")
    return dedupe_id
