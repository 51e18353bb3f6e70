"""Finding keys for the console: one key's whole picture (``keyq.ops.inspection``, what ``keyq
inspect`` prints), or the keys that begin with a prefix, looked for among those with state,
those paused, parked or promoted, and, in key and auto mode, those with a queue of their own,
until ``FOUND_LIMIT`` are found."""

from __future__ import annotations

import re
from typing import Any, cast

from keyq.broker.text import as_text
from keyq.ops.context import OperatorContext, check_keys
from keyq.ops.inspection import inspect_key

FOUND_LIMIT = 50
SCAN_COUNT = 5000
SCAN_BUDGET = 200_000  # entries read at most, over every hash, by one search
_GLOB_SPECIAL = re.compile(r"([\\*?\[\]])")


def key_picture(ctx: OperatorContext, key: str) -> dict[str, Any]:
    return inspect_key(ctx, check_keys([key])[0])


def keys_with_prefix(ctx: OperatorContext, prefix: str) -> tuple[list[str], bool]:
    """Up to ``FOUND_LIMIT`` known keys starting with ``prefix``, sorted, and whether the
    search looked everywhere (it reads at most ``SCAN_BUDGET`` entries)."""
    client, keys = ctx.redis, ctx.keys
    match = _GLOB_SPECIAL.sub(r"\\\1", prefix) + "*"
    found: set[str] = set()
    budget = SCAN_BUDGET
    with ctx.services():
        for name in (keys.state, keys.parked_keys, keys.paused_keys, keys.routes):
            cursor = None
            while cursor != 0 and budget > 0 and len(found) < FOUND_LIMIT:
                cursor, fields = client.hscan(name, cursor or 0, match=match, count=SCAN_COUNT)
                budget -= SCAN_COUNT
                found.update(as_text(field) for field in fields)
        cursor = None if ctx.config.holds_own_queues() else 0
        while cursor != 0 and budget > 0 and len(found) < FOUND_LIMIT:
            cursor, names = client.hscan(keys.queue_keys, cursor or 0, count=SCAN_COUNT)
            budget -= SCAN_COUNT
            originals = cast(dict[str, str], names).values()
            found.update(text for raw in originals if (text := as_text(raw)).startswith(prefix))
    return sorted(found)[:FOUND_LIMIT], budget > 0 or len(found) >= FOUND_LIMIT
