"""Dead letters as rows for people and for ``--json``: what ``keyq dlq list`` and ``show`` and
``keyq inspect`` print. An event of a pack dead-lettered whole is a row of its own, with
``pack``: the pack message's id, how many events it holds and the event's place in it."""

from __future__ import annotations

import base64
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from keyq.broker.dead_letter_queue import DeadLetterMessage
from keyq.status_table import blank, printable

PREVIEW_BYTES = 60


def preview(body: bytes, limit: int = PREVIEW_BYTES) -> str:
    """The first ``limit`` bytes as printable text: undecodable bytes and control characters
    shown as ``.``, and ``…`` when the body is longer."""
    text = body[:limit].decode("utf-8", "replace")
    shown = "".join(char if char.isprintable() and char != "\ufffd" else "." for char in text)
    return shown + ("…" if len(body) > limit else "")


def letter_row(letter: DeadLetterMessage) -> dict[str, Any]:
    """One letter's summary, JSON-ready."""
    return {
        "position": letter.position,
        "id": letter.letter_id,
        "key": None if letter.foreign else letter.key,
        "foreign": letter.foreign,
        "producer": letter.producer,
        "seq": letter.seq,
        "reason": letter.reason,
        "attempts": letter.attempts,
        "dead_at_ms": letter.dead_at_ms,
        "dead_queue": letter.dead_queue,
        "published_at_ms": letter.published_at_ms,
        "content_type": letter.content_type,
        "bytes": len(letter.body),
        "preview": preview(letter.body),
        "pack": _pack(letter),
    }


def _pack(letter: DeadLetterMessage) -> dict[str, Any] | None:
    if letter.pack is None:
        return None
    return {
        "message_id": letter.pack.message_id,
        "events": letter.pack.events,
        "part": letter.pack.part,
    }


def letter_detail(letter: DeadLetterMessage) -> dict[str, Any]:
    """One letter whole: its summary, every header, the message id and the full payload
    (as text when it is UTF-8, else base64)."""
    row = letter_row(letter)
    del row["preview"]
    try:
        payload: str = letter.body.decode("utf-8")
        encoding = "utf-8"
    except UnicodeDecodeError:
        payload = base64.b64encode(letter.body).decode()
        encoding = "base64"
    if letter.pack is not None:
        row["pack"] |= {"headers": _plain(letter.pack.headers)}
    return row | {
        "key_header": letter.key,
        "message_id": letter.message_id,
        "headers": _plain(letter.headers),
        "payload": payload,
        "payload_encoding": encoding,
    }


def _plain(value: object) -> Any:
    if isinstance(value, Mapping):
        return {str(name): _plain(item) for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return "base64:" + base64.b64encode(value).decode()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def when(ms: int | None) -> str:
    if ms is None:
        return "-"
    at = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
    return at.strftime("%Y-%m-%d %H:%M:%S") + "Z"


def render_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows as tab-separated lines with a header: greppable, one letter a line."""
    titles = ("#", "id", "key", "producer", "seq", "attempts", "dead at", "from", "type")
    lines = ["\t".join(titles) + "\treason\tpayload"]
    for row in rows:
        key = "(foreign)" if row["foreign"] else printable(row["key"])
        cells = (
            _position(row),
            row["id"],
            key,
            blank(row["producer"]),
            blank(row["seq"]),
            blank(row["attempts"]),
            when(row["dead_at_ms"]),
            blank(row["dead_queue"]),
            blank(row["content_type"]),
            _one_line(row["reason"]),
            row["preview"],
        )
        lines.append("\t".join(cells))
    return "\n".join(lines) + "\n"


def _position(row: Mapping[str, Any]) -> str:
    """The row's place; for an event of a pack, also which of the pack's events it is."""
    pack = row.get("pack")
    if not pack:
        return str(row["position"])
    return f"{row['position']} pack {pack['part']}/{pack['events']}"


def render_detail(detail: Mapping[str, Any]) -> str:
    pack = detail.get("pack")
    lines = [
        f"id            {detail['id']}"
        + ("   (foreign: no keyq key header)" if detail["foreign"] else ""),
        f"position      {detail['position']}",
        f"key           {printable(detail['key_header'])}",
        f"producer/seq  {blank(detail['producer'])} / {blank(detail['seq'])}",
        f"published at  {when(detail['published_at_ms'])}",
        f"reason        {_one_line(detail['reason'])}",
        f"attempts      {blank(detail['attempts'])}",
        f"dead at       {when(detail['dead_at_ms'])}",
        f"from queue    {blank(detail['dead_queue'])}",
        f"content type  {blank(detail['content_type'])}",
        f"message id    {blank(detail['message_id'])}",
        "headers:",
        *(f"  {name}: {value!r}" for name, value in sorted(detail["headers"].items())),
    ]
    if pack:
        lines += [
            f"pack          event {pack['part']} of {pack['events']} of message "
            f"{blank(pack['message_id'])} (dead-lettered whole; removed only whole)",
            "pack headers:",
            *(f"  {name}: {value!r}" for name, value in sorted(pack["headers"].items())),
        ]
    lines += [
        f"payload ({detail['bytes']} bytes, {detail['payload_encoding']}):",
        detail["payload"],
    ]
    return "\n".join(lines) + "\n"


def _one_line(text: str | None) -> str:
    if text is None:
        return "-"
    return " ".join(text.split())
