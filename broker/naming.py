"""Names: streams, keys and the queues they map to.

A queue name must be valid for AMQP (at most 255 bytes), must never be shared by two keys of a
key-mode stream, and must not collide across streams or with the dead-letter queue. Keys made
of plain characters appear in the name so operators can read them; any other key is replaced
by its SHA-256, under a different marker so the two namespaces cannot meet.
"""

from __future__ import annotations

import hashlib
import re
from enum import StrEnum

from keyq.broker.errors import InvalidKey, InvalidStreamName

MAX_QUEUE_NAME_BYTES = 255
MAX_KEY_BYTES = 4096
QUEUE_PREFIX = "keyq"
# A key-mode quorum queue deleted by the janitor comes back under a new name, its base name
# followed by "~" and its incarnation (see ``incarnation_name``). "~" appears in no base name.
INCARNATION_MARK = "~"
INCARNATION_ROOM = 11  # "~" and up to ten digits, kept free in quorum base names

_STREAM_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_PLAIN_KEY_RE = re.compile(r"[A-Za-z0-9_.:-]+")


class Mode(StrEnum):
    """How a stream maps keys to queues; fixed at the stream's first use."""

    KEY = "key"
    BUCKET = "bucket"
    AUTO = "auto"  # a key in its bucket until promoted to a queue of its own (broker.routes)

    @property
    def hashes(self) -> bool:
        """Whether keys share hash buckets' queues (bucket and auto mode)."""
        return self is not Mode.KEY


def check_stream_name(stream: object) -> str:
    """Stream names go into queue names and into Redis hash tags ``{stream}``."""
    if not isinstance(stream, str) or not _STREAM_RE.fullmatch(stream):
        raise InvalidStreamName(
            f"invalid stream name {stream!r}: use 1-64 characters from A-Z a-z 0-9 _ -, "
            "starting with a letter or digit"
        )
    return stream


def encode_key(key: object) -> bytes:
    """The key's UTF-8 bytes, after checking it is a usable key."""
    if not isinstance(key, str):
        raise InvalidKey(f"key must be a str, got {type(key).__name__}")
    if not key:
        raise InvalidKey("key must not be empty")
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidKey("key is not valid Unicode text (it has a lone surrogate)") from None
    if len(encoded) > MAX_KEY_BYTES:
        raise InvalidKey(f"key is {len(encoded)} bytes in UTF-8; the limit is {MAX_KEY_BYTES}")
    return encoded


def stream_prefix(stream: str) -> str:
    return f"{QUEUE_PREFIX}.{stream}."


def key_queue_name(stream: str, key: str, *, incarnations: bool = False) -> str:
    """The key-mode queue of ``key``: readable when the key is plain, a digest otherwise.
    With ``incarnations`` (quorum streams) the name leaves room for an incarnation suffix."""
    prefix = stream_prefix(stream)
    room = MAX_QUEUE_NAME_BYTES - (INCARNATION_ROOM if incarnations else 0)
    if _PLAIN_KEY_RE.fullmatch(key) and len(prefix) + 2 + len(key) <= room:
        return f"{prefix}k.{key}"
    return f"{prefix}h.{hashlib.sha256(encode_key(key)).hexdigest()}"


def incarnation_name(base: str, incarnation: int) -> str:
    """The name of a queue's ``incarnation``: the base name itself for the first (0).

    RabbitMQ can leave a replica of a deleted quorum queue behind on a node that was down
    during the delete, and bring it back over a queue declared later under the same name
    (docs/operations.md, "Deleting quorum queues"). So a deleted key-mode quorum queue is
    never declared again under its name: the next one is ``<base>~1``, then ``<base>~2``.
    """
    return base if incarnation == 0 else f"{base}{INCARNATION_MARK}{incarnation}"


def base_queue_name(queue: str) -> str:
    """The base name of any incarnation of a queue (``incarnation_name``'s inverse)."""
    base, mark, number = queue.rpartition(INCARNATION_MARK)
    return base if mark and number.isdigit() else queue


def incarnation_of(queue: str) -> int:
    """Which incarnation of its base name ``queue`` is (0: the base name itself)."""
    _base, mark, number = queue.rpartition(INCARNATION_MARK)
    return int(number) if mark and number.isdigit() else 0


def bucket_queue_name(stream: str, bucket: int) -> str:
    return f"{stream_prefix(stream)}b.{bucket:05d}"


def dead_letter_queue_name(stream: str) -> str:
    return f"{stream_prefix(stream)}dlq"


def key_digest(key: str) -> str:
    """A short, fixed-length name for ``key`` inside queue names (any key fits)."""
    return hashlib.sha256(encode_key(key)).hexdigest()[:32]


def aside_queue_name(stream: str, key: str, token: str) -> str:
    """A queue ``key``'s events are set aside in while it is paused or parked (``token`` is
    new each time: a deleted quorum queue's name is never declared again)."""
    return f"{stream_prefix(stream)}a.{key_digest(key)}.{token}"


def redrive_queue_name(stream: str, key: str, token: str) -> str:
    """The queue one redrive puts ``key``'s dead letters back in, ahead of its other events."""
    return f"{stream_prefix(stream)}r.{key_digest(key)}.{token}"


def is_aside_queue(stream: str, queue: str) -> bool:
    """Whether ``queue`` is one a key's events wait in aside (``aside_queue_name``) or one a
    redrive put its dead letters back in (``redrive_queue_name``)."""
    prefix = stream_prefix(stream)
    return queue.startswith(prefix) and queue[len(prefix) : len(prefix) + 2] in ("a.", "r.")


def is_bucket_queue(stream: str, queue: str) -> bool:
    """Whether ``queue`` is one of the stream's bucket queues (``bucket_queue_name``)."""
    prefix = stream_prefix(stream)
    return queue.startswith(prefix) and queue[len(prefix) : len(prefix) + 2] == "b."


def is_stream_queue(stream: str, queue: str) -> bool:
    """Whether ``queue`` is one of the stream's keyed queues (not its dead-letter queue)."""
    prefix = stream_prefix(stream)
    return queue.startswith(prefix) and queue[len(prefix) : len(prefix) + 2] in ("k.", "h.", "b.")
