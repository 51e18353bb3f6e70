"""Turning events into message bodies, with every refusal happening before anything is sent."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import orjson

from keyq.broker.envelope import CONTENT_BYTES, CONTENT_JSON
from keyq.broker.errors import InvalidEvent

MAX_DEPTH = 200


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


def encode_event(event: object) -> tuple[bytes, str]:
    """The message body and content type for ``event``: JSON for dicts, as-is for bytes."""
    if isinstance(event, (bytes, bytearray, memoryview)):
        return bytes(event), CONTENT_BYTES
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
