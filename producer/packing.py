"""Packing: the events of one queue that wait together leave as one message.

The broker's cost is per message, not per event, so when several events of a queue are
waiting to be sent they go as one pack (``keyq.broker.packs``), up to ``pack_max_events`` and
``pack_max_bytes``. A lone event still goes as a message of its own, unchanged. The confirm
window, confirms, returns and re-sends treat a pack as one message that counts its events.

The packer also decides when a queue's events gather (in its lane) for a pack rather than go at
once: while an earlier message of the queue awaits its confirm (then the next pack is as large
as what arrived meanwhile), or for the linger; a full pack goes at once.
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
from keyq.producer.lanes import QueueLane
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

    def count_sent(self, message: Outgoing) -> None:
        if message.events is not None:
            self.packs_sent += 1
            self.events_packed += len(message.events)

    def gathers(self, lane: QueueLane, stalled: bool) -> bool:
        """Whether the lane's next message waits for others to join its pack."""
        return (
            self.enabled
            and not (lane.waits or stalled)
            and bool(lane.inflight or lane.gathering or self.linger_s)
        )

    def gather(self, lane: QueueLane, message: Outgoing, now: float) -> tuple[list[Outgoing], bool]:
        """``message`` gathers in ``lane``: the full packs to send now, and whether a linger
        starts (the first to gather)."""
        size = sum(len(record_of(event)) for event in message.members)
        lane.gather(message, size, now)
        if self.full(lane.gathered_events, lane.gathered_bytes):
            return self.take_gathered(lane, keep_partial=True), False
        return [], bool(self.linger_s) and len(lane.gathering) == 1

    def take_gathered(self, lane: QueueLane, *, keep_partial: bool = False) -> list[Outgoing]:
        """What gathered in ``lane``, packed. With ``keep_partial`` (a pack filled up) only
        full packs are taken; the rest goes on gathering."""
        since = lane.gathered_at
        packs = self.pack(lane.take_gathered())
        if keep_partial and packs and not self.full(packs[-1].count, len(packs[-1].body)):
            rest = packs.pop()
            lane.gather(rest, sum(len(record_of(e)) for e in rest.members), since)
        return packs

    def lingered(self, lane: QueueLane, now: float) -> bool:
        """Nothing of the queue is in flight any more and the linger is over."""
        return not lane.inflight and now - lane.gathered_at >= self.linger_s

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
