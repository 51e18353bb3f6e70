"""Stream configuration: a stream's mode, bucket count and queue type, fixed at first use in
Redis.

Every producer and worker of a stream must agree on how keys map to queues; the first one to
use the stream records it with ``SET NX`` and every later one is checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
import redis

from keyq.broker.errors import ConfigurationError, StreamConfigMismatch
from keyq.broker.hashing import bucket_of
from keyq.broker.naming import (
    Mode,
    bucket_queue_name,
    check_stream_name,
    dead_letter_queue_name,
    key_queue_name,
)
from keyq.broker.redis_keys import KEY_PREFIX, StreamKeys

DEFAULT_BUCKETS = 64
MAX_BUCKETS = 65_536
QUEUE_TYPES = ("classic", "quorum")


@dataclass(frozen=True)
class StreamConfig:
    """How one stream maps keys to queues."""

    stream: str
    mode: Mode
    buckets: int | None = None
    queue_type: str = "classic"

    def __post_init__(self) -> None:
        check_stream_name(self.stream)
        if self.queue_type not in QUEUE_TYPES:
            raise ConfigurationError(
                f"queue type must be 'classic' or 'quorum', got {self.queue_type!r}"
            )
        if self.mode.hashes:
            if self.buckets is None or not 1 <= self.buckets <= MAX_BUCKETS:
                raise ConfigurationError(
                    f"{self.mode.value} mode needs 1..{MAX_BUCKETS} buckets, got {self.buckets!r}"
                )
        elif self.buckets is not None:
            raise ConfigurationError("key mode takes no bucket count")

    def queue_for(self, key: str) -> str:
        """The queue producers publish ``key``'s events to (``key`` already validated): in
        auto mode its bucket, whose holder forwards a promoted key's events
        (``broker.routes``)."""
        if self.mode.hashes:
            assert self.buckets is not None
            return bucket_queue_name(self.stream, bucket_of(key, self.buckets))
        return self.own_queue_for(key)

    def own_queue_for(self, key: str) -> str:
        """``key``'s queue of its own (base name): key mode's, or a promoted key's in auto mode."""
        return key_queue_name(self.stream, key, incarnations=self.queue_type == "quorum")

    def holds_own_queues(self) -> bool:
        """Whether keys may have queues of their own, which go idle and are reclaimed."""
        return self.mode is not Mode.BUCKET

    @property
    def dead_letter_queue(self) -> str:
        return dead_letter_queue_name(self.stream)

    def to_json(self) -> str:
        data = {"mode": self.mode.value, "buckets": self.buckets, "queue_type": self.queue_type}
        return orjson.dumps(data).decode()

    @classmethod
    def from_json(cls, stream: str, raw: str) -> StreamConfig:
        data = orjson.loads(raw)
        return cls(
            stream=stream,
            mode=Mode(data["mode"]),
            buckets=data.get("buckets"),
            queue_type=data.get("queue_type", "classic"),  # streams recorded before it existed
        )

    def describe(self) -> str:
        buckets = f", buckets={self.buckets}" if self.buckets else ""
        return f"mode={self.mode.value}{buckets}, queue type {self.queue_type}"


def requested_config(
    stream: str, mode: str | Mode | None, buckets: int | None
) -> StreamConfig | None:
    """The config the caller asks for (checked), or None when it asks for nothing."""
    if mode is None and buckets is None:
        return None
    try:
        chosen = Mode(mode) if mode is not None else Mode.BUCKET
    except ValueError:
        raise ConfigurationError(f"mode must be 'key', 'bucket' or 'auto', got {mode!r}") from None
    if chosen.hashes and buckets is None:
        buckets = DEFAULT_BUCKETS
    if isinstance(buckets, bool) or (buckets is not None and not isinstance(buckets, int)):
        raise ConfigurationError(f"buckets must be an integer, got {buckets!r}")
    return StreamConfig(stream=stream, mode=chosen, buckets=buckets)


def load_stream_config(client: redis.Redis, stream: str) -> StreamConfig | None:
    """The recorded config of ``stream``, or None if nothing has used it yet."""
    raw = client.get(StreamKeys(check_stream_name(stream)).config)
    return None if raw is None else StreamConfig.from_json(stream, str(raw))


def ensure_stream_config(
    client: redis.Redis,
    stream: str,
    mode: str | Mode | None = None,
    buckets: int | None = None,
    queue_type: str | None = None,
) -> StreamConfig:
    """The stream's config, recording the requested one if the stream is new.

    With neither mode nor buckets given, an existing stream's config is adopted and a new
    stream starts in key mode; bucket mode without a count adopts the recorded count or
    starts with ``DEFAULT_BUCKETS``. Likewise without a queue type an existing stream's is
    adopted and a new stream's queues are classic. Asking for anything else than what is
    recorded raises ``StreamConfigMismatch``.
    """
    check_stream_name(stream)
    wanted = requested_config(stream, mode, buckets)
    first = wanted or StreamConfig(stream=stream, mode=Mode.KEY)
    first = StreamConfig(stream, first.mode, first.buckets, queue_type or "classic")
    keys = StreamKeys(stream)
    client.set(keys.config, first.to_json(), nx=True)
    current = load_stream_config(client, stream)
    assert current is not None
    adopts_count = buckets is None and wanted is not None and wanted.mode is current.mode
    other_layout = wanted is not None and (wanted.mode, wanted.buckets) != (
        current.mode,
        current.buckets,
    )
    other_type = queue_type is not None and queue_type != current.queue_type
    if (other_layout and not adopts_count) or other_type:
        layout = wanted if wanted is not None and not adopts_count else current
        asked = StreamConfig(stream, layout.mode, layout.buckets, queue_type or current.queue_type)
        raise StreamConfigMismatch(
            f"stream {stream!r} is fixed at {current.describe()}; this client asked for "
            f"{asked.describe()}"
        )
    return current


def discover_streams(client: redis.Redis) -> list[str]:
    """Every stream with a recorded config."""
    streams = []
    for key in client.scan_iter(match=f"{KEY_PREFIX}:{{*}}:config", count=10_000):
        text = str(key)
        start, end = text.find("{"), text.rfind("}")
        if 0 <= start < end:
            streams.append(text[start + 1 : end])
    return sorted(streams)
