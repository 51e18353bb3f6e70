"""Finding keys for the console: one key's whole picture (``keyq.ops.inspection``, what ``keyq
inspect`` prints), or the keys that begin with a prefix, looked for among those with state,
those paused or parked, and, in key mode, those with a queue, until ``FOUND_LIMIT`` are found."""

from __future__ import annotations

import re
from typing import Any

from keyq.broker.naming import Mode
from keyq.broker.text import as_text
from keyq.ops.context import OperatorContext, check_keys
from keyq.ops.inspection import inspect_key

FOUND_LIMIT = 50
SCAN_COUNT = 5000
_GLOB_SPECIAL = re.compile(r"([\\*?\[\]])")


def key_picture(ctx: OperatorContext, key: str) -> dict[str, Any]:
    return inspect_key(ctx, check_keys([key])[0])


def keys_with_prefix(ctx: OperatorContext, prefix: str) -> list[str]:
    """Up to ``FOUND_LIMIT`` known keys starting with ``prefix``, sorted."""
    client, keys = ctx.redis, ctx.keys
    match = _GLOB_SPECIAL.sub(r"\\\1", prefix) + "*"
    found: set[str] = set()
    with ctx.services():
        for name in (keys.state, keys.parked_keys, keys.paused_keys):
            for field, _value in client.hscan_iter(name, match=match, count=SCAN_COUNT):
                found.add(as_text(field))
                if len(found) >= FOUND_LIMIT:
                    return sorted(found)
        if ctx.config.mode is Mode.KEY:
            for _queue, original in client.hscan_iter(keys.queue_keys, count=SCAN_COUNT):
                if (text := as_text(original)).startswith(prefix):
                    found.add(text)
                    if len(found) >= FOUND_LIMIT:
                        break
    return sorted(found)
