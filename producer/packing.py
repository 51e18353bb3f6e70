"""Packing: the events of one queue that wait together leave as one message.

The broker's cost is per message, not per event, so when several events of a queue are
waiting to be sent they go as one pack (``keyq.broker.packs``), up to ``pack_max_events`` and
``pack_max_bytes``. A lone event still goes as a message of its own, unchanged. The confirm
window, confirms, returns and re-sends treat a pack as one message that counts its events.
"""

from __future__ import annotations

from collections.abc import Iterable

import pika

from keyq.broker.envelope import HEADER_KEY, HEADER_PRODUCER, HEADER_PUBLISHED_AT, HEADER_STREAM
from keyq.broker.packs import (
    HEADER_PACK,
    MAGIC,
    PACK_CONTENT_TYPE,
    encode_pack,
    encode_record,
)
from keyq.broker.settings import Settings
from keyq.producer.outgoing import Outgoing


class Packer:
    """Groups events by queue, in order, into packs within the settings' bounds."""

    def __init__(self, settings: Settings) -> None:
        self.max_events = settings.pack_max_events
        self.max_bytes = min(settings.pack_max_bytes, settings.max_message_bytes)
        self.linger_s = settings.pack_linger_ms / 1000
        self.packs_sent = 0  # packs sent (one sent again, after a return, counts again)
        self.events_packed = 0  # events sent inside them

    @property
    def enabled(self) -> bool:
        return self.max_events > 1

    def pack(self, messages: Iterable[Outgoing]) -> list[Outgoing]:
        """``messages`` (events or packs) as messages to send: each queue's events in their
        order, packed; queues in the order they first appear."""
        if not self.enabled:
            return list(messages)
        by_queue: dict[str, list[Outgoing]] = {}
        for message in messages:
            by_queue.setdefault(message.queue, []).extend(message.members)
        packed: list[Outgoing] = []
        for events in by_queue.values():
            if len(events) == 1:
                packed.append(events[0])
            else:
                packed.extend(self._chunks(events))
        return packed

    def full(self, events: int, size: int) -> bool:
        """Whether waiting events of one queue (``size``: their records' bytes) fill a pack."""
        return events >= self.max_events or size >= self.max_bytes

    def _chunks(self, events: list[Outgoing]) -> list[Outgoing]:
        chunks: list[Outgoing] = []
        current: list[Outgoing] = []
        size = len(MAGIC)
        for event in events:
            record = record_of(event)
            if current and (len(current) >= self.max_events or size + len(record) > self.max_bytes):
                chunks.append(self._message(current))
                current, size = [], len(MAGIC)
            current.append(event)
            size += len(record)
        if current:
            chunks.append(self._message(current))
        return chunks

    def _message(self, events: list[Outgoing]) -> Outgoing:
        first = events[0]
        if len(events) == 1:
            return first
        first_headers = first.properties.headers or {}
        stamps = [
            stamp
            for event in events
            if isinstance(stamp := (event.properties.headers or {}).get(HEADER_PUBLISHED_AT), int)
        ]
        headers: dict[str, object] = {
            HEADER_STREAM: first_headers.get(HEADER_STREAM),
            HEADER_PRODUCER: first_headers.get(HEADER_PRODUCER),
            HEADER_PACK: len(events),
        }
        if stamps:
            headers[HEADER_PUBLISHED_AT] = min(stamps)  # what lag gauges read from a queue's head
        if all(event.key == first.key for event in events):
            headers[HEADER_KEY] = first.key
        properties = pika.BasicProperties(
            delivery_mode=pika.DeliveryMode.Persistent,
            content_type=PACK_CONTENT_TYPE,
            message_id=f"pack:{first_headers.get(HEADER_PRODUCER)}:{first.number}",
            timestamp=first.properties.timestamp,
            headers=headers,
        )
        body = encode_pack([record_of(event) for event in events])
        for event in events:
            event.record = None  # in the pack's body now; made again if it is ever repacked
        return Outgoing(first.number, first.queue, first.key, body, properties, events=events)


def record_of(event: Outgoing) -> bytes:
    """``event``'s record inside a pack (encoded once, then kept)."""
    if event.record is None:
        properties = event.properties
        event.record = encode_record(
            properties.message_id, properties.content_type, properties.headers or {}, event.body
        )
    return event.record
