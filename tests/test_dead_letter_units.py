"""The pure parts of the dead-letter commands: ids, previews, selection, redriven copies, packs."""

from __future__ import annotations

import datetime

import pika
import pytest

from keyq.broker.dead_letter_index import preview
from keyq.broker.dead_letter_queue import (
    DeadLetterMessage,
    PartialPack,
    content_id,
    letters_of,
    packs_left_partly,
)
from keyq.broker.envelope import (
    CONTENT_JSON,
    HEADER_ATTEMPTS,
    HEADER_DEAD_AT,
    HEADER_DEAD_QUEUE,
    HEADER_DEAD_REASON,
    HEADER_KEY,
    HEADER_PRODUCER,
    HEADER_REDRIVE_ID,
    HEADER_SEQ,
)
from keyq.broker.errors import InvalidInput
from keyq.broker.packs import (
    HEADER_PACK,
    PACK_CONTENT_TYPE,
    decode_pack,
    encode_pack,
    encode_record,
)
from keyq.cli.dead_letter_rows import render_detail, render_rows
from keyq.ops.dead_letter_listing import letter_detail, letter_row
from keyq.ops.dead_letter_selection import LetterNotFound, by_ids, of_key, whole_packs
from keyq.ops.redrive import redriven_properties
from keyq.worker.amqp.dead_letters import packed
from keyq.worker.amqp.deliveries import Delivery


def _redriven(seq: int) -> dict[str, object]:
    """The headers of event ``seq``'s redriven copy (of key a, producer p)."""
    return {HEADER_KEY: "a", HEADER_PRODUCER: "p", HEADER_SEQ: seq, HEADER_REDRIVE_ID: f"p:{seq}"}


def _letter(
    position: int, key: str | None, seq: int | None, body: bytes = b"{}"
) -> DeadLetterMessage:
    headers: dict[str, object] = {HEADER_DEAD_REASON: "boom\nagain", HEADER_ATTEMPTS: 2}
    if key is not None:
        headers[HEADER_KEY] = key
    if seq is not None:
        headers |= {HEADER_PRODUCER: "p", HEADER_SEQ: seq}
    return DeadLetterMessage(position, position + 1, body, headers, "application/json", "m")


def test_letter_ids_previews_and_rows() -> None:
    letter = _letter(0, "k", 7)
    assert letter.letter_id == "p:7" and not letter.foreign and letter.key == "k"
    # a foreign letter's id is stable and ignores the broker's delivery count
    headers = {"b": b"\x00\xff", "a": 1}
    first = content_id(b"body", headers)
    assert first == content_id(b"body", {"a": 1, "b": b"\x00\xff", "x-delivery-count": 4})
    assert first.startswith("sha256:") and len(first) == 7 + 16
    assert first != content_id(b"body!", headers)
    assert first != content_id(b"body", {"a": 2, "b": b"\x00\xff"})
    assert _letter(0, None, None).foreign and _letter(0, "k", None).foreign
    # previews are printable and cut; rows one line each
    assert preview(b"ab\x00\ncd") == "ab..cd"
    assert preview(b"\xff\xfeok") == "..ok"
    assert preview(b"x" * 61) == "x" * 60 + "…"
    assert letter_row(_letter(0, None, None))["key"] is None
    text = render_rows([letter_row(_letter(0, "a", 1)), letter_row(_letter(1, None, None))])
    lines = text.splitlines()
    assert len(lines) == 3 and "boom again" in lines[1] and "(foreign)" in lines[2]


def test_selection_by_key_and_by_id() -> None:
    letters = [_letter(0, "a", 1), _letter(1, "b", 1), _letter(2, "a", 2), _letter(3, None, None)]
    assert [letter.position for letter in of_key(letters, "a")] == [0, 2]
    assert [letter.position for letter in by_ids(letters, ["p:2"])] == [2]
    assert [letter.position for letter in by_ids(letters, ["p:1"], key="b")] == [1]
    with pytest.raises(InvalidInput, match="add --key"):
        by_ids(letters, ["p:1"])
    with pytest.raises(LetterNotFound):
        by_ids(letters, ["p:9"])
    with pytest.raises(LetterNotFound):
        by_ids(letters, ["p:2"], key="b")


def test_a_redriven_copy_loses_the_dead_letter_headers_and_gains_its_redrive_id() -> None:
    letter = _letter(0, "a", 3)
    letter.headers[HEADER_DEAD_QUEUE] = "q"  # type: ignore[index]
    letter.headers[HEADER_DEAD_AT] = 5  # type: ignore[index]
    letter.headers["x-delivery-count"] = 2  # type: ignore[index]
    properties = redriven_properties(letter)
    assert properties.headers == _redriven(3)
    assert properties.delivery_mode == 2 and properties.content_type == "application/json"
    assert redriven_properties(letter, "b").headers[HEADER_KEY] == "b"


def _pack_letters(
    seqs: list[int], keys: list[str] | None = None, message_headers: dict[str, object] | None = None
) -> list[DeadLetterMessage]:
    headers = [
        {HEADER_KEY: key, HEADER_PRODUCER: "p", HEADER_SEQ: seq}
        for key, seq in zip(keys or ["a"] * len(seqs), seqs, strict=True)
    ]
    records = [
        encode_record(f"p:{n}", CONTENT_JSON, of, b'{"n":%d}' % of[HEADER_SEQ])
        for n, of in enumerate(headers, start=1)
    ]
    properties = pika.BasicProperties(
        content_type=PACK_CONTENT_TYPE,
        message_id="pack:p:1",
        headers={HEADER_PACK: len(seqs), HEADER_PRODUCER: "p", **(message_headers or {})},
    )
    return letters_of(4, 9, encode_pack(records), properties)


def test_a_pack_is_read_as_its_events_with_its_reason_unless_malformed() -> None:
    death = {"reason": "rejected", "queue": "keyq.s.k.a", "time": datetime.datetime(2024, 1, 2)}
    events = _pack_letters([3, 4, 5], message_headers={"x-death": [death]})
    assert [letter.letter_id for letter in events] == ["p:3", "p:4", "p:5"]
    assert {(letter.position, letter.delivery_tag) for letter in events} == {(4, 9)}
    assert [letter.body for letter in events] == [b'{"n":3}', b'{"n":4}', b'{"n":5}']
    first = events[0]
    assert first.pack is not None and (first.pack.message_id, first.pack.events) == ("pack:p:1", 3)
    assert [letter.pack.part for letter in events if letter.pack] == [1, 2, 3]
    assert first.key == "a" and first.content_type == "application/json"
    assert first.message_id == "p:1" and HEADER_PACK not in first.headers
    # why and when it died: the message's (here only RabbitMQ's x-death)
    assert first.reason == "rejected" and first.dead_queue == "keyq.s.k.a"
    assert first.dead_at_ms == 1704153600000
    row = letter_row(first)
    assert row["pack"] == {"message_id": "pack:p:1", "events": 3, "part": 1}
    assert row["reason"] == "rejected" and row["preview"] == '{"n":3}'
    assert render_rows([row]).splitlines()[1].startswith("4 pack 1/3\tp:3\ta\t")
    detail = letter_detail(events[1])
    assert detail["pack"]["headers"][HEADER_PACK] == 3 and detail["payload"] == '{"n":4}'
    assert "event 2 of 3 of message pack:p:1" in render_detail(detail | {"copies": 1})
    # a redriven copy is the event alone: its own headers and its redrive id
    assert redriven_properties(events[1]).headers == _redriven(4)
    keyq_reason = _pack_letters([1], message_headers={HEADER_DEAD_REASON: "malformed"})
    assert keyq_reason[0].reason == "malformed"
    # a malformed pack is one foreign letter
    properties = pika.BasicProperties(
        content_type=PACK_CONTENT_TYPE, headers={HEADER_PACK: 2, HEADER_KEY: "a"}
    )
    [letter] = letters_of(0, 1, b"KQP1\x00\x00", properties)
    assert letter.pack is None and letter.foreign and letter.letter_id.startswith("sha256:")
    assert letter.body == b"KQP1\x00\x00" and letter.content_type == PACK_CONTENT_TYPE


def test_a_selection_takes_a_pack_whole_or_is_refused() -> None:
    single = _letter(0, "a", 1)
    events = _pack_letters([2, 3, 4])
    letters = [single, *events]
    whole_packs(letters, [single, *events])
    whole_packs(letters, [single])
    assert packs_left_partly(letters, [events[1]]) == [(events, [events[0], events[2]])]
    with pytest.raises(PartialPack) as refused:
        whole_packs(letters, by_ids(letters, ["p:3"]), queue="q")
    assert str(refused.value) == (
        "pack pack:p:1 in q holds 3 letters and is removed only whole, but p:2, p:4 of it are "
        "not selected: select them all (--key a selects all of them)"
    )
    mixed = _pack_letters([1, 2], keys=["a", "b"])
    with pytest.raises(PartialPack, match="by --id each"):
        whole_packs(mixed, of_key(mixed, "a"))


def test_a_promoted_keys_forwarded_events_go_as_packs_that_unpack_to_them() -> None:
    """Forwarded copies are packed (at most ``most`` events, about ``most_bytes``), each
    event keeping its headers, message id, content type and body, with the key."""
    of_p = {HEADER_PRODUCER: "p"}
    deliveries = [
        Delivery("q", 1, n, False, {**of_p, HEADER_SEQ: n}, CONTENT_JSON, f"m{n}", b'{"n": %d}' % n)
        for n in range(1, 46)
    ]
    messages = packed(deliveries, "k1", 20, 1_000_000)
    assert [properties.headers["x-keyq-pack"] for _, properties in messages[:2]] == [20, 20]
    events = [event for body, _ in messages[:3] for event in decode_pack(body)]
    assert [event.headers["x-keyq-seq"] for event in events] == list(range(1, 46))
    assert {event.headers["x-keyq-key"] for event in events} == {"k1"}
    assert [event.message_id for event in events[:2]] == ["m1", "m2"]
    assert events[44].body == b'{"n": 45}'
    alone = packed(deliveries[:1], "k1", 20, 1_000_000)
    assert alone[0][0] == b'{"n": 1}' and alone[0][1].headers["x-keyq-key"] == "k1"
    by_bytes = packed(deliveries[:10], "k1", 20, 150)
    assert len(by_bytes) > 1  # cut by size too
