"""The pure parts of the dead-letter commands: letter ids, previews, selection, redriven copies."""

from __future__ import annotations

import pytest

from keyq.broker.dead_letter_queue import DeadLetterMessage, content_id
from keyq.broker.envelope import (
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
from keyq.dead_letter_listing import letter_row, preview, render_rows
from keyq.letter_selection import LetterNotFound, by_ids, of_key
from keyq.redrive import redriven_properties


def _letter(
    position: int, key: str | None, seq: int | None, body: bytes = b"{}"
) -> DeadLetterMessage:
    headers: dict[str, object] = {HEADER_DEAD_REASON: "boom\nagain", HEADER_ATTEMPTS: 2}
    if key is not None:
        headers[HEADER_KEY] = key
    if seq is not None:
        headers |= {HEADER_PRODUCER: "p", HEADER_SEQ: seq}
    return DeadLetterMessage(position, position + 1, body, headers, "application/json", "m")


def test_a_keyq_letters_id_is_its_producer_and_seq() -> None:
    letter = _letter(0, "k", 7)
    assert letter.letter_id == "p:7" and not letter.foreign and letter.key == "k"


def test_a_foreign_letters_id_is_stable_and_ignores_the_brokers_delivery_count() -> None:
    headers = {"b": b"\x00\xff", "a": 1}
    first = content_id(b"body", headers)
    assert first == content_id(b"body", {"a": 1, "b": b"\x00\xff", "x-delivery-count": 4})
    assert first.startswith("sha256:") and len(first) == 7 + 16
    assert first != content_id(b"body!", headers)
    assert first != content_id(b"body", {"a": 2, "b": b"\x00\xff"})
    assert _letter(0, None, None).foreign and _letter(0, "k", None).foreign


def test_preview_is_printable_and_cut() -> None:
    assert preview(b"ab\x00\ncd") == "ab..cd"
    assert preview(b"\xff\xfeok") == "..ok"
    assert preview(b"x" * 61) == "x" * 60 + "…"
    assert letter_row(_letter(0, None, None))["key"] is None


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
    assert properties.headers == {
        HEADER_KEY: "a",
        HEADER_PRODUCER: "p",
        HEADER_SEQ: 3,
        HEADER_REDRIVE_ID: "p:3",
    }
    assert properties.delivery_mode == 2 and properties.content_type == "application/json"
    assert redriven_properties(letter, "b").headers[HEADER_KEY] == "b"


def test_rows_are_one_line_each() -> None:
    text = render_rows([letter_row(_letter(0, "a", 1)), letter_row(_letter(1, None, None))])
    lines = text.splitlines()
    assert len(lines) == 3 and "boom again" in lines[1] and "(foreign)" in lines[2]
