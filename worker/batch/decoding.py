"""Turning deliveries into pipeline rows, or into a reason to dead-letter them at once.

A body labelled JSON (``application/json``, or with no content type, as other clients send)
must be UTF-8 JSON text: anything else can never succeed however often it is retried. A body
of any other content type (``application/octet-stream`` for bytes from the SDK, Avro,
Protobuf…) reaches the pipeline as it is, with ``payload`` set only if it happens to be JSON;
a decoder the pipeline passes to ``ctx.state.fold`` decides what it means. A message labelled
as a pack of events that could not be read (``Delivery.malformed``) is dead-lettered whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import orjson

from keyq.broker.envelope import (
    CONTENT_JSON,
    HEADER_KEY,
    HEADER_PREFIX,
    HEADER_PRODUCER,
    HEADER_REDRIVE_ID,
    HEADER_SEQ,
    published_at_ms,
)
from keyq.worker.amqp.deliveries import Delivery


@dataclass(slots=True)
class Event:
    """A decoded delivery: what a pipeline sees of it, and where it came from."""

    delivery: Delivery
    key: str
    producer: str | None
    seq: int | None
    published_at_ms: int | None
    payload: str | None  # the body as JSON text; None when it is not JSON

    @property
    def body(self) -> bytes:
        return self.delivery.body

    @property
    def content_type(self) -> str | None:
        return self.delivery.content_type

    @property
    def user_headers(self) -> dict[str, str]:
        """The publisher's own headers (keyq's left out), as text for the pipeline."""
        return {
            name: _header_text(value)
            for name, value in self.delivery.headers.items()
            if not name.lower().startswith(HEADER_PREFIX)
        }

    @property
    def redrive_id(self) -> str | None:
        return redrive_id_of(self.delivery)


@dataclass(slots=True)
class Undecodable:
    delivery: Delivery
    reason: str
    key: str | None
    producer: str | None
    seq: int | None

    @property
    def redrive_id(self) -> str | None:
        return redrive_id_of(self.delivery)


Item = Event | Undecodable
# A delivery's decoded form within one attempt at a batch.
Decoder = Callable[[Delivery], Item]


def decoder_for(fallback_keys: Mapping[str, str | None]) -> Decoder:
    """``decode`` for one attempt, with each queue's declared key from ``fallback_keys``, and
    each delivery decoded once: the key gate and the plan both read every event, and its
    UTF-8 and JSON checks are most of what decoding costs."""
    seen: dict[int, Item] = {}

    def decoded(delivery: Delivery) -> Item:
        # Keyed by identity: the item holds its delivery, so the id is not reused meanwhile.
        item = seen.get(id(delivery))
        if item is None:
            item = seen[id(delivery)] = decode(delivery, fallback_keys.get(delivery.queue))
        return item

    return decoded


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


def _integer(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    return value if isinstance(value, int) else None


def producer_of(delivery: Delivery) -> str | None:
    """The SDK producer instance that published ``delivery``, if it says."""
    return _text(delivery.headers.get(HEADER_PRODUCER))


def seq_of(delivery: Delivery) -> int | None:
    """Its number among its producer's events of its key, if an SDK producer published it."""
    return _integer(delivery.headers.get(HEADER_SEQ))


def redrive_id_of(delivery: Delivery) -> str | None:
    """The id of the dead letter ``delivery`` was put back from, if it was redriven."""
    return _text(delivery.headers.get(HEADER_REDRIVE_ID))


def decode(delivery: Delivery, fallback_key: str | None = None) -> Event | Undecodable:
    """Decode one delivery; ``fallback_key`` is the registry's key for a key-mode queue."""
    headers = delivery.headers
    key = _text(headers.get(HEADER_KEY)) or fallback_key
    producer = producer_of(delivery)
    seq = _integer(headers.get(HEADER_SEQ))
    if producer is None or seq is None:
        producer, seq = None, None  # not from keyq's SDK: no dedup identity
    if delivery.malformed is not None:
        return Undecodable(delivery, f"malformed pack: {delivery.malformed}", key, producer, seq)
    if key is None:
        return Undecodable(delivery, f"missing header {HEADER_KEY}", None, producer, seq)
    published = published_at_ms(headers)
    if not labelled_json(delivery.content_type):
        return Event(delivery, key, producer, seq, published, json_text(delivery.body))
    try:
        text = delivery.body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Undecodable(
            delivery, f"undecodable payload: not UTF-8 ({exc.reason})", key, producer, seq
        )
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        return Undecodable(delivery, f"undecodable payload: not JSON ({exc})", key, producer, seq)
    return Event(delivery, key, producer, seq, published, text)


def labelled_json(content_type: str | None) -> bool:
    """Whether a body must be JSON: labelled so, or not labelled at all."""
    if not content_type:
        return True
    return content_type.split(";", 1)[0].strip().lower() == CONTENT_JSON


def json_text(body: bytes) -> str | None:
    """``body`` as JSON text if it is UTF-8 JSON, else None."""
    try:
        text = body.decode("utf-8")
        orjson.loads(text)
    except (UnicodeDecodeError, orjson.JSONDecodeError):
        return None
    return text


def _header_text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)
