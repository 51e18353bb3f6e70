"""Packs on the real broker: a queue's waiting events leave together, and every event lands
once, in its key's order, with everything it was published with (the worker's side is in
tests/test_packed_deliveries.py, the I/O thread's in tests/test_producer_packing.py)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pika
from pika.adapters.blocking_connection import BlockingChannel

from keyq import Producer
from keyq.broker.envelope import HEADER_KEY, HEADER_PRODUCER, HEADER_SEQ
from keyq.broker.hashing import bucket_of
from keyq.broker.naming import bucket_queue_name, key_queue_name
from keyq.broker.packs import HEADER_PACK, PackedEvent, decode_pack, is_pack
from tests.conftest import StreamFixture
from tests.helpers import as_applied, sent_again


def _messages(channel: BlockingChannel, queue: str) -> list[list[PackedEvent]]:
    """Each message of ``queue`` (acked) as the events it carries."""
    found: list[list[PackedEvent]] = []
    while True:
        method, properties, body = channel.basic_get(queue, auto_ack=True)
        if method is None:
            return found
        headers: dict[str, Any] = dict(properties.headers or {})
        if is_pack(properties.content_type):
            events = decode_pack(body)
            assert headers[HEADER_PACK] == len(events)
            found.append(events)
        else:
            found.append(
                [PackedEvent(properties.message_id, properties.content_type, headers, body)]
            )


def test_a_burst_leaves_in_packs_and_lands_whole_in_order(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    keys = [f"acct-{i}" for i in range(8)]
    with Producer(stream.name, mode="key", settings=stream.settings) as producer:
        receipts = []
        for n in range(4000):
            key = keys[n % len(keys)]
            receipts.append(producer.publish(key, {"n": n}, headers={"trace": f"t{n}"}))
        producer.flush(30)
        stats = dict(producer.stats)
        producer_id = producer.producer_id
    assert all(receipt.published for receipt in receipts)
    assert stats["packs"] > 0 and stats["events_in_packs"] > stats["packs"], stats
    channel = amqp.channel()
    messages = copies = 0
    for index, key in enumerate(keys):
        found = _messages(channel, key_queue_name(stream.name, key))
        messages += len(found)
        assert all(len(events) <= 20 for events in found)  # the default bound
        landed = [event for message in found for event in message]
        events, again = as_applied(landed, lambda event: int(event.headers[HEADER_SEQ]))
        copies += again
        assert [e.headers[HEADER_SEQ] for e in events] == list(range(1, 501))
        assert [e.body for e in events] == [b'{"n":%d}' % n for n in range(index, 4000, 8)]
        assert all(e.headers[HEADER_KEY] == key for e in events)
        assert all(e.headers[HEADER_PRODUCER] == producer_id for e in events)
        assert all(e.content_type == "application/json" for e in events)
        assert [e.headers["trace"] for e in events] == [f"t{n}" for n in range(index, 4000, 8)]
        assert [e.message_id for e in events] == [
            f"{producer_id}:{n + 1}" for n in range(index, 4000, 8)
        ]
    assert messages < 4000 / 2, "a burst of 500 events per key should travel in packs"
    assert copies <= sent_again(stats), f"{copies} copies, {stats}"


def test_bucket_packs_carry_each_event_with_its_own_key_and_payload(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    keys = [f"device-{i}" for i in range(30)]
    published: dict[str, list[bytes]] = defaultdict(list)
    with Producer(stream.name, mode="bucket", buckets=2, settings=stream.settings) as producer:
        for n in range(2000):
            key = keys[n % len(keys)]
            body = bytes([n % 256]) * (n % 7) + b"\x00end"
            receipt = producer.publish(
                key, body, content_type="application/x-test", headers={"raw": body}
            )
            assert receipt.queue == bucket_queue_name(stream.name, bucket_of(key, 2))
            published[key].append(body)
        producer.flush(30)
        stats = dict(producer.stats)
    channel = amqp.channel()
    landed: dict[str, list[bytes]] = defaultdict(list)
    last_seq: dict[str, int] = defaultdict(int)  # a copy sent again is dropped as a worker does
    copies = 0
    mixed = False
    for bucket in range(2):
        for events in _messages(channel, bucket_queue_name(stream.name, bucket)):
            mixed |= len({event.headers[HEADER_KEY] for event in events}) > 1
            for event in events:
                key = str(event.headers[HEADER_KEY])
                assert bucket_of(key, 2) == bucket
                assert event.content_type == "application/x-test"
                assert event.headers["raw"] == event.body  # a bytes header kept as bytes
                seq = int(event.headers[HEADER_SEQ])
                if seq <= last_seq[key]:
                    copies += 1
                    continue
                last_seq[key] = seq
                landed[key].append(event.body)
    assert mixed, "a bucket's pack holds several keys' events"
    assert landed == published  # each key's events, in order
    assert copies <= sent_again(stats), f"{copies} copies, {stats}"
    assert stream.redis.zcard(stream.keys.registry) == 2  # the buckets' queues registered


def test_packing_off_sends_each_event_alone(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    settings = stream.settings.model_copy(update={"pack_max_events": 1})
    with Producer(stream.name, mode="key", settings=settings) as producer:
        for n in range(500):
            producer.publish("only", {"n": n})
        producer.flush(30)
        assert producer.stats["packs"] == 0
    found = _messages(amqp.channel(), key_queue_name(stream.name, "only"))
    assert len(found) == 500 and all(len(events) == 1 for events in found)
