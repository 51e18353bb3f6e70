"""Packs (``keyq.broker.packs``) as units: the layout read back exactly, malformed bodies
refused, a worker unpacking one on arrival, and the ack ledger acking it once, when all settle."""

from __future__ import annotations

from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import orjson
import pika
import pytest

from keyq.broker.envelope import HEADER_KEY, HEADER_PRODUCER, HEADER_SEQ
from keyq.broker.packs import (
    HEADER_PACK,
    MAGIC,
    PACK_CONTENT_TYPE,
    MalformedPack,
    PackedEvent,
    decode_pack,
    encode_pack,
    encode_record,
    is_pack,
)
from keyq.broker.settings import load_settings
from keyq.worker.amqp.ack_ledger import AckLedger
from keyq.worker.amqp.deliveries import DeliveryBuffer
from keyq.worker.amqp.queue_channels import unpack

HEADERS: dict[str, Any] = {
    "x-keyq-stream": "orders",
    HEADER_KEY: "k-1",
    HEADER_PRODUCER: "p-1",
    HEADER_SEQ: 7,
    "x-keyq-published-at": 1_700_000_000_123,
    "flag": True,
    "off": False,
    "nothing": None,
    "raw": b"\x00\xffbytes",
    "empty-bytes": b"",
    "big": 2**53 + 1,
    "negative": -3,
    "text": "héllo",
}


def record(body: bytes = b"{}", **headers: Any) -> bytes:
    return encode_record("m-1", "application/json", headers or HEADERS, body)


def test_a_pack_reads_back_every_event_exactly() -> None:
    events = [
        PackedEvent("m-1", "application/json", HEADERS, b'{"n": 1}'),
        PackedEvent(None, None, {}, b""),  # no id, no content type, no header, empty body
        PackedEvent("m-3", "application/octet-stream", {"raw": b"\x01"}, bytes(range(256))),
    ]
    body = encode_pack(
        [encode_record(e.message_id, e.content_type, e.headers, e.body) for e in events]
    )
    assert body.startswith(MAGIC)
    decoded = decode_pack(body)
    assert decoded == events
    # Each type comes back as it went: bytes stay bytes, a bool is not an int.
    headers = decoded[0].headers
    assert headers["raw"] == b"\x00\xffbytes" and isinstance(headers["raw"], bytes)
    assert headers["flag"] is True and headers["off"] is False and headers["nothing"] is None
    assert headers[HEADER_SEQ] == 7 and type(headers[HEADER_SEQ]) is int
    assert is_pack(PACK_CONTENT_TYPE), "the content type names a pack"
    assert not is_pack("application/json") and not is_pack(None)


def meta(value: Any) -> bytes:
    """A record whose meta is ``value`` as JSON, with an empty body."""
    data = orjson.dumps(value)
    return len(data).to_bytes(4, "big") + data + (0).to_bytes(4, "big")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"", "does not start with KQP1"),
        (b"KQP2" + record(), "does not start with KQP1"),
        (MAGIC, "holds no event"),
        (MAGIC + b"\x00\x00", "inside the length of a meta"),
        (MAGIC + (100).to_bytes(4, "big") + b"{}", "runs past the end"),
        (MAGIC + (2).to_bytes(4, "big") + b"{}", "inside the length of a body"),
        (MAGIC + (2).to_bytes(4, "big") + b"{}" + (5).to_bytes(4, "big") + b"ab", "runs past"),
        (MAGIC + record()[:-1], "runs past the end"),
        (MAGIC + record() + b"\x00", "inside the length of a meta"),
        (MAGIC + (3).to_bytes(4, "big") + b"{x}" + (0).to_bytes(4, "big"), "meta is not JSON"),
        (MAGIC + meta([1, 2]), "meta is not a JSON object"),
        (MAGIC + meta({"message_id": 5}), "message_id is not a string"),
        (MAGIC + meta({"content_type": ["x"]}), "content_type is not a string"),
        (MAGIC + meta({"headers": [1]}), "headers is not a JSON object"),
        (MAGIC + meta({"headers": {"a": 1.5}}), "bad header value"),
        (MAGIC + meta({"headers": {"a": [1]}}), "bad header value"),
        (MAGIC + meta({"headers": {"a": {"bytes": "!!"}}}), "bad header value"),
        (MAGIC + meta({"headers": {"a": {"bytes": "AA==", "x": 1}}}), "bad header value"),
        (MAGIC + meta({"headers": {"a": {"other": "AA=="}}}), "bad header value"),
        (MAGIC + record() + meta({"message_id": 1}), "event 2 of the pack"),
    ],
)
def test_a_malformed_pack_is_refused_with_why(body: bytes, words: str) -> None:
    with pytest.raises(MalformedPack, match=words):
        decode_pack(body)


def arrival(tag: int, body: bytes, content_type: str | None, **headers: Any) -> Any:
    method = SimpleNamespace(delivery_tag=tag, redelivered=True)
    properties = pika.BasicProperties(
        content_type=content_type, message_id=f"msg-{tag}", headers=headers or None
    )
    return method, properties, body


def test_a_pack_arrives_as_one_delivery_per_event_in_order() -> None:
    events = [({**HEADERS, HEADER_SEQ: seq}, f'{{"n": {seq}}}'.encode()) for seq in (1, 2, 3)]
    body = encode_pack([encode_record(f"m-{h[HEADER_SEQ]}", None, h, b) for h, b in events])
    method, properties, _ = arrival(9, body, PACK_CONTENT_TYPE, **{HEADER_PACK: 3})
    deliveries = unpack("q", 4, method, properties, body)
    assert [(d.part, d.parts) for d in deliveries] == [(0, 3), (1, 3), (2, 3)]
    for delivery, (headers, event_body) in zip(deliveries, events, strict=True):
        assert (delivery.queue, delivery.channel_epoch, delivery.delivery_tag) == ("q", 4, 9)
        assert delivery.redelivered is True
        assert delivery.headers == headers and HEADER_PACK not in delivery.headers
        assert delivery.body == event_body
        assert delivery.message_id == f"m-{headers[HEADER_SEQ]}"
        assert delivery.content_type is None and delivery.malformed is None


def test_a_message_not_a_pack_or_a_malformed_pack_is_one_delivery() -> None:
    method, properties, body = arrival(3, b'{"n": 1}', "application/json", **{HEADER_KEY: "k"})
    [delivery] = unpack("q", 1, method, properties, body)
    assert (delivery.part, delivery.parts, delivery.malformed) == (0, 1, None)
    assert delivery.headers == {HEADER_KEY: "k"} and delivery.body == b'{"n": 1}'
    assert delivery.message_id == "msg-3" and delivery.content_type == "application/json"
    # A malformed pack is one delivery of the whole message, too.
    body = MAGIC + record()[:-2]
    method, properties, _ = arrival(5, body, PACK_CONTENT_TYPE, **{HEADER_PACK: 1})
    [delivery] = unpack("q", 1, method, properties, body)
    assert delivery.body == body and delivery.content_type == PACK_CONTENT_TYPE
    assert delivery.headers == {HEADER_PACK: 1} and (delivery.part, delivery.parts) == (0, 1)
    assert delivery.malformed is not None and "runs past the end" in delivery.malformed


def test_the_buffer_keeps_a_packs_events_in_order_and_counts_its_messages() -> None:
    body = encode_pack([record(b"{}", **{**HEADERS, HEADER_SEQ: n}) for n in range(4)])
    method, properties, _ = arrival(2, body, PACK_CONTENT_TYPE)
    pack = unpack("q", 1, method, properties, body)
    single = unpack("q", 1, *arrival(3, b"{}", None))
    buffer = DeliveryBuffer()
    buffer.add_all(pack)
    buffer.add_all(single)
    assert (len(buffer), buffer.messages("q")) == (5, 2)
    taken = buffer.take(10, 0, 0)
    assert [(d.delivery_tag, d.part) for d in taken] == [(2, 0), (2, 1), (2, 2), (2, 3), (3, 0)]
    # Two of the pack's events wait for an earlier seq; the rest goes back unsettled.
    buffer.defer([taken[3], taken[1]])
    assert (buffer.deferred("q"), buffer.deferred_messages("q"), buffer.messages("q")) == (2, 1, 1)
    buffer.put_back([taken[4], taken[2], taken[0]])
    assert buffer.messages("q") == 2
    # The parked ones rejoin in (epoch, tag, part) order, ahead of what is ready, in order.
    again = buffer.take(10, 0, 0)
    assert [(d.delivery_tag, d.part) for d in again] == [(2, 1), (2, 3), (2, 0), (2, 2), (3, 0)]


def test_the_amqp_prefetch_counts_messages_of_up_to_pack_max_events() -> None:
    settings = load_settings(pack_max_events=20)
    assert settings.amqp_prefetch(40) == 2
    assert settings.amqp_prefetch(1000) == 50
    assert settings.amqp_prefetch(3) == 1  # never 0: that would be no limit at all
    assert load_settings(pack_max_events=1).amqp_prefetch(40) == 40


def test_a_pack_is_acked_once_every_event_is_settled_each_counted_once_if_in_range() -> None:
    ledger = AckLedger()
    ledger.delivered(1, 3)
    assert ledger.settle([(1, 0), (1, 2)]) == (0, [])
    assert len(ledger) == 1
    assert ledger.settle([(1, 1)]) == (1, [])
    assert len(ledger) == 0
    ledger = AckLedger()
    ledger.delivered(1, 2)
    assert ledger.settle([(1, 0), (1, 0)]) == (0, [])
    assert ledger.settle([(1, 0)]) == (0, [])  # again: part 1 still unsettled
    assert ledger.settle([(1, 1)]) == (1, [])
    assert ledger.settle([(1, 0), (1, 1)]) == (0, [])  # acked already: never twice
    ledger.delivered(2, 2)
    assert ledger.settle([(2, 5), (9, 0)]) == (0, []), "a part out of range or a tag unknown"
    assert ledger.settle([(2, 0), (2, 1)]) == (2, [])


def test_a_multiple_ack_runs_across_packs_and_stops_at_one_with_an_event_waiting() -> None:
    ledger = AckLedger()
    ledger.delivered(1, 2)
    ledger.delivered(2, 3)
    ledger.delivered(3)
    ledger.delivered(4, 2)
    # Tag 2's last event waits for an earlier seq: 1 goes with multiple, 3 and 4 alone.
    assert ledger.settle([(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (4, 0), (4, 1)]) == (1, [3, 4])
    # Once it is settled, its own tag covers the run (3 and 4 are acked already).
    assert ledger.settle([(2, 2)]) == (2, [])
    ledger.delivered(5, 2)
    ledger.delivered(6)
    assert ledger.settle([(6, 0), (5, 1), (5, 0)]) == (6, [])


@pytest.mark.parametrize(
    "declared",
    [
        2,
        4,
        "2",
        "many",
        True,
        2.5,
        float("nan"),
        float("inf"),
        Decimal("NaN"),
        "²",
        "①",
        "9" * 5000,
    ],
    ids=lambda value: repr(value)[:12],
)
def test_a_pack_whose_count_header_disagrees_with_its_body_is_malformed(declared: Any) -> None:
    """A body that lost or gained events on the way is not read as the events it holds."""
    body = encode_pack([record(b"{}", **{**HEADERS, HEADER_SEQ: n}) for n in range(3)])
    with pytest.raises(MalformedPack, match="header says"):
        decode_pack(body, declared)
    method, properties, _ = arrival(5, body, PACK_CONTENT_TYPE, **{HEADER_PACK: declared})
    [delivery] = unpack("q", 1, method, properties, body)
    assert delivery.malformed is not None and delivery.body == body


@pytest.mark.parametrize("declared", [3, "3", b"3", " 3 ", 3.0, Decimal("3"), None])
def test_a_pack_whose_count_header_agrees_or_is_absent_is_read(declared: Any) -> None:
    body = encode_pack([record(b"{}", **{**HEADERS, HEADER_SEQ: n}) for n in range(3)])
    assert len(decode_pack(body, declared)) == 3
