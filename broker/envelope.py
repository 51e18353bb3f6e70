"""What travels with every event: the AMQP headers keyq sets, and the checks on user headers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from keyq.broker.errors import InvalidHeaders

HEADER_PREFIX = "x-keyq-"
HEADER_STREAM = "x-keyq-stream"
HEADER_KEY = "x-keyq-key"
HEADER_PRODUCER = "x-keyq-producer"
HEADER_SEQ = "x-keyq-seq"
HEADER_PUBLISHED_AT = "x-keyq-published-at"
HEADER_DEAD_REASON = "x-keyq-dead-reason"
HEADER_DEAD_QUEUE = "x-keyq-dead-queue"
HEADER_ATTEMPTS = "x-keyq-attempts"
HEADER_DEAD_AT = "x-keyq-dead-at"  # when it was dead-lettered (ms since epoch)
HEADER_REDRIVE_ID = "x-keyq-redrive-id"  # set on an event put back from the dead letters
HEADER_DEDUPE_ID = "x-keyq-dedupe-id"  # the application's id for an event (idempotence)

CONTENT_JSON = "application/json"
CONTENT_BYTES = "application/octet-stream"

# What pika can encode in an AMQP table (it has no float encoding).
_HEADER_VALUE_TYPES = (str, bytes, int, bool, type(None))


def published_at_ms(headers: Mapping[str, Any]) -> int | None:
    """When the producer published the event (``x-keyq-published-at``, ms since the epoch),
    if the headers say so as an integer (a bool is not one)."""
    stamp = headers.get(HEADER_PUBLISHED_AT)
    return stamp if isinstance(stamp, int) and not isinstance(stamp, bool) else None


def header_bytes(headers: Mapping[str, Any]) -> int:
    """About how many bytes ``headers`` take on the wire (checked headers only)."""
    size = 0
    for name, value in headers.items():
        size += len(name.encode("utf-8")) + 6
        if isinstance(value, str):
            size += len(value.encode("utf-8"))
        elif isinstance(value, bytes):
            size += len(value)
        else:
            size += 9
    return size


def check_user_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """User headers as a plain dict, refusing keyq's reserved names and odd value types."""
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise InvalidHeaders(f"headers must be a mapping, got {type(headers).__name__}")
    checked: dict[str, Any] = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not name:
            raise InvalidHeaders(f"header names must be non-empty strings, got {name!r}")
        try:
            encoded_name = name.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidHeaders(f"header name {name!r} is not valid Unicode text") from None
        if len(encoded_name) > 255:
            raise InvalidHeaders("header names are limited to 255 bytes")
        if name.lower().startswith(HEADER_PREFIX):
            raise InvalidHeaders(f"header {name!r} uses the reserved prefix {HEADER_PREFIX!r}")
        if not isinstance(value, _HEADER_VALUE_TYPES):
            raise InvalidHeaders(
                f"header {name!r} must be str, bytes, int, bool or None "
                "(send floats as strings); "
                f"got {type(value).__name__}"
            )
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and not (-(2**63) <= value < 2**63)
        ):
            raise InvalidHeaders(f"header {name!r} is an integer outside 64 bits")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidHeaders(f"header {name!r} is not valid Unicode text") from None
        checked[name] = value
    return checked
