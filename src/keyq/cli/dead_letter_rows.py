"""Dead letters for people: what ``keyq dlq list`` and ``show`` and ``keyq inspect`` print, from
the rows of ``keyq.ops.dead_letter_listing``. An event of a pack dead-lettered whole is a row
of its own, with ``pack``: the pack message's id, how many events it holds and the event's
place in it."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from keyq.cli.status import blank, printable


def when(ms: int | None) -> str:
    """A moment as UTC, to the second."""
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
    """One letter whole: its fields, every header, its pack's, and the payload."""
    pack = detail.get("pack")
    lines = [
        f"id            {detail['id']}"
        + ("   (foreign: no keyq key header)" if detail["foreign"] else ""),
        f"position      {blank(detail.get('position'))}",
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
