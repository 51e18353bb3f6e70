"""Keys whose waiting events make no progress, as the janitor's watchdog last found them.

The watchdog (``keyq.janitor.watchdog``) writes one record per stranded key or queue into the
stream's ``stranded`` hash each time it looks, replacing the last set, with a ttl of a few of
its periods, so that a janitor that stopped looking leaves no stale verdict behind. ``keyq
status`` counts them, ``keyq inspect`` says why a key does not move.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import orjson
import redis

from keyq.broker.redis_keys import StreamKeys
from keyq.broker.text import as_text


@dataclass(frozen=True)
class Stranded:
    """One key (or, for events with no key of their own, one queue) that waits and does not
    move: why, since when, and whether the watchdog could do something about it."""

    subject: str  # the key, or the queue name when no single key is concerned
    queue: str
    reason: str
    since_ms: int
    repaired: bool = False

    def to_json(self) -> str:
        return orjson.dumps(
            {
                "subject": self.subject,
                "queue": self.queue,
                "reason": self.reason,
                "since": self.since_ms,
                "repaired": self.repaired,
            }
        ).decode()

    @classmethod
    def from_json(cls, raw: str | bytes) -> Stranded:
        data = orjson.loads(raw)
        return cls(
            subject=str(data.get("subject", "")),
            queue=str(data.get("queue", "")),
            reason=str(data.get("reason", "")),
            since_ms=int(data.get("since", 0)),
            repaired=bool(data.get("repaired", False)),
        )


def stranded_row(entry: Stranded) -> dict[str, object]:
    """One entry as ``keyq status --json`` and ``keyq inspect --json`` show it."""
    return {
        "key": entry.subject,
        "queue": entry.queue,
        "reason": entry.reason,
        "since_ms": entry.since_ms,
        "repaired": entry.repaired,
    }


class StrandedRecord:
    """The stranded hash of one stream."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self._client = client
        self._key = StreamKeys(stream).stranded

    def replace(self, found: Iterable[Stranded], ttl_ms: int) -> None:
        """The watchdog's latest verdict, whole: earlier entries not found again go."""
        mapping = {entry.subject: entry.to_json() for entry in found}
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self._key)
        if mapping:
            pipe.hset(self._key, mapping=mapping)  # type: ignore[arg-type]
            pipe.pexpire(self._key, ttl_ms)
        pipe.execute()

    def all(self) -> dict[str, Stranded]:
        raw = self._client.hgetall(self._key)
        return {as_text(k): Stranded.from_json(v) for k, v in raw.items()}

    def of(self, subject: str) -> Stranded | None:
        raw = self._client.hget(self._key, subject)
        return None if raw is None else Stranded.from_json(raw)

    def count(self) -> int:
        return int(self._client.hlen(self._key))
