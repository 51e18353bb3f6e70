"""The console's dead letters: a page of the index (``broker.dead_letter_index``) by stream, key
or reason, and one letter with its headers and payload drawn for people: JSON pretty-printed,
other UTF-8 text as it is, anything else as hex beside its printable text. Nothing here walks
the dead-letter queue but ``whole`` for a letter whose payload the index keeps cut."""

from __future__ import annotations

import base64
from typing import Any

import orjson

from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.ops.context import OperatorContext, check_keys
from keyq.ops.dead_letter_listing import show_letter

PAGE_SIZE = 50
HEX_WIDTH = 16
DEAD_LETTER_WAIT_S = 10.0


def letters_page(
    ctx: OperatorContext, *, key: str | None, reason: str | None, page: int
) -> dict[str, Any]:
    """One page of letters, oldest first, with how many match in all."""
    offset = max(0, page) * PAGE_SIZE
    with ctx.services():
        index = DeadLetterIndex(ctx.redis, ctx.stream)
        if key is not None:
            key = check_keys([key])[0]
        if reason is not None:
            found = index.with_reason(reason, offset + PAGE_SIZE, key)
            rows, matched = found.rows[offset:], found.matched
        elif key is not None:
            found = index.of_key(key, PAGE_SIZE, offset)
            rows, matched = found.rows, found.matched
        else:
            found = index.page(PAGE_SIZE, offset)
            rows, matched = found.rows, found.matched
        letters, messages = index.counts()
    return {
        "letters": rows,
        "matched": matched,
        "page": page,
        "pages": max(1, -(-matched // PAGE_SIZE)),
        "indexed": letters,
        "messages": messages,
    }


def letter(ctx: OperatorContext, letter_id: str, key: str | None, *, whole: bool) -> dict[str, Any]:
    """One letter with its payload drawn (see ``drawn``); ``whole`` reads it from the queue."""
    found = show_letter(ctx, letter_id, key, walk_queue=whole, wait=DEAD_LETTER_WAIT_S)
    return found | {"drawn": drawn(found)}


def drawn(found: dict[str, Any]) -> dict[str, Any]:
    """The payload as the page shows it: ``json`` (pretty), ``text`` or ``hex`` rows."""
    payload = str(found.get("payload") or "")
    if found.get("payload_encoding") == "base64":
        body = base64.b64decode(payload)
        return {"kind": "hex", "rows": hex_rows(body), "editable": ""}
    try:
        pretty = orjson.dumps(orjson.loads(payload), option=orjson.OPT_INDENT_2).decode()
    except orjson.JSONDecodeError:
        return {"kind": "text", "text": payload, "editable": payload}
    return {"kind": "json", "text": pretty, "editable": payload}


def hex_rows(body: bytes) -> list[dict[str, str]]:
    rows = []
    for start in range(0, len(body), HEX_WIDTH):
        chunk = body[start : start + HEX_WIDTH]
        rows.append(
            {
                "offset": f"{start:08x}",
                "hex": " ".join(f"{byte:02x}" for byte in chunk),
                "text": "".join(chr(byte) if 32 <= byte < 127 else "." for byte in chunk),
            }
        )
    return rows
