"""``keyq state``: a key's committed state and exactly-once marks, read straight from Redis."""

from __future__ import annotations

from typing import Any

import orjson

from keyq.broker.connections import open_redis, redis_errors
from keyq.broker.naming import check_stream_name, encode_key
from keyq.broker.settings import Settings, load_settings
from keyq.worker.batch.state_store import StateStore


def read_state(stream: str, key: str) -> tuple[bool, Any, dict[str, Any]]:
    """(found, state, marks) of a key, straight from Redis."""
    check_stream_name(stream)
    encode_key(key)
    settings: Settings = load_settings()
    client = open_redis(settings)
    with redis_errors(settings.redis_url):
        store = StateStore(client, stream)
        raw = store.states([key]).get(key)
        marks = store.get_marks(key)
    client.close()
    value = None if raw is None else orjson.loads(raw)
    return raw is not None, value, {"producers": marks.seqs, "applied": marks.applied}
