"""A stream's figures as the janitor that leads it last measured them (``janitor.stream_gauges``),
kept in Redis with a ttl so that readers other than its metrics (``keyq console``) see them
without asking the broker, and see none once no janitor measures."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from keyq.broker.clock import now_ms
from keyq.broker.redis_keys import StreamKeys


@dataclass(frozen=True)
class StreamFigures:
    """One stream as last measured; None where it could not be measured."""

    dead_letters: int | None
    ready_events: int | None
    oldest_event_age_s: float | None
    parked_keys: int
    paused_keys: int
    live_workers: int


@dataclass(frozen=True)
class MeasuredFigures:
    """Figures with who measured them and when."""

    figures: StreamFigures
    janitor: str
    at_ms: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.figures) | {"janitor": self.janitor, "at_ms": self.at_ms}


class FiguresRecord:
    """The stream's ``figures`` key: written by its leading janitor each pass it measures."""

    def __init__(self, client: redis.Redis, stream: str) -> None:
        self._client = client
        self._key = StreamKeys(stream).figures

    def write(self, figures: StreamFigures, janitor: str, ttl_s: float) -> None:
        value = dataclasses.asdict(figures) | {"janitor": janitor, "at_ms": now_ms()}
        self._client.set(self._key, orjson.dumps(value), px=max(1000, int(ttl_s * 1000)))

    def read(self) -> MeasuredFigures | None:
        return parse_figures(self._client.get(self._key))


def parse_figures(raw: str | bytes | None) -> MeasuredFigures | None:
    """A record as read; None when missing or not one."""
    if raw is None:
        return None
    try:
        data = orjson.loads(raw)
        names = [field.name for field in dataclasses.fields(StreamFigures)]
        figures = StreamFigures(**{name: data.get(name) for name in names})
        return MeasuredFigures(figures, str(data.get("janitor", "")), int(data.get("at_ms", 0)))
    except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError):
        return None
