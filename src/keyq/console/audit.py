"""Every action taken from the console, kept newest first in Redis (``CONSOLE_AUDIT``, the last
``AUDIT_KEPT``) and logged: who, from where, what, on which stream and target, and how it ended,
so that operators can see on the page what was changed while they looked away."""

from __future__ import annotations

import logging
from typing import Any

import orjson
import redis

from keyq.broker.clock import now_ms
from keyq.broker.redis_keys import CONSOLE_AUDIT

AUDIT_KEPT = 1000

log = logging.getLogger("keyq.console.audit")


class AuditLog:
    def __init__(self, client: redis.Redis) -> None:
        self._client = client

    def record(
        self, *, who: str, address: str, action: str, stream: str, target: str, outcome: str
    ) -> None:
        entry = {
            "at_ms": now_ms(),
            "who": who,
            "address": address,
            "action": action,
            "stream": stream,
            "target": target,
            "outcome": outcome,
        }
        log.info(
            "console action %s on %r %r by %r from %s: %r",
            action,
            stream,
            target,
            who,
            address,
            outcome,
        )
        pipe = self._client.pipeline(transaction=False)
        pipe.lpush(CONSOLE_AUDIT, orjson.dumps(entry))
        pipe.ltrim(CONSOLE_AUDIT, 0, AUDIT_KEPT - 1)
        pipe.execute()

    def newest(self, limit: int = AUDIT_KEPT) -> list[dict[str, Any]]:
        return [orjson.loads(raw) for raw in self._client.lrange(CONSOLE_AUDIT, 0, limit - 1)]
