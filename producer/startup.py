"""What a producer settles before it connects: its settings, its instance's id, and the type
its queues are declared as (a recorded stream's, checked against what was asked)."""

from __future__ import annotations

import re
import uuid
from typing import Any

import redis

from keyq.broker.connections import open_redis, redis_errors
from keyq.broker.errors import ConfigurationError, StreamConfigMismatch
from keyq.broker.producer_presence import ProducerPresence
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import StreamConfig, load_stream_config

_PRODUCER_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def resolve_settings(settings: Settings | None, **overrides: Any) -> Settings:
    """``settings`` (else the environment's) with the arguments that were given."""
    base = settings.model_dump() if settings is not None else {}
    given = {name: value for name, value in overrides.items() if value is not None}
    resolved: Settings = load_settings(**{**base, **given})
    return resolved


def instance_id(producer_id: str | None) -> str:
    """The full id of this instance: ``producer_id`` with a suffix of its own.

    Sequence numbers start at 1 in every instance: a name reused by a restarted producer
    would make workers take its new events for duplicates of the old ones, so each instance
    adds a suffix of its own to the name it is given."""
    if producer_id is not None and (
        not isinstance(producer_id, str) or not _PRODUCER_ID.fullmatch(producer_id)
    ):
        raise ConfigurationError(
            f"producer_id must be 1-128 characters of A-Z a-z 0-9 _ . -, got {producer_id!r}"
        )
    instance = uuid.uuid4().hex
    return instance if producer_id is None else f"{producer_id}.{instance[:12]}"


def queue_type_for(stream: str, asked: str | None, known: StreamConfig | None) -> str:
    """The type to declare queues as: a stream's own, checked against what was asked."""
    if known is None:
        return asked or "classic"
    if asked is not None and asked != known.queue_type:
        raise StreamConfigMismatch(
            f"stream {stream!r} is fixed at {known.describe()}; this client asked "
            f"for queue type {asked}"
        )
    return known.queue_type


def open_redis_presence(
    settings: Settings, stream: str, producer_id: str
) -> tuple[redis.Redis, ProducerPresence, str]:
    """Redis, the producer announced present there, and the type of the stream's queues."""
    client = open_redis(settings)
    presence = ProducerPresence(client, stream)
    try:
        # The queues must be declared as the stream's type: a recorded stream's, or the asked
        # (else classic) one for a new stream, fixed once both services answer.
        with redis_errors(settings.redis_url):
            known = load_stream_config(client, stream)
            # Present before its first event can be sent: a worker gives up a sequence gap of
            # a producer it cannot see once the gap's queue is drained.
            presence.announce(producer_id, settings.producer_ttl_ms)
        return client, presence, queue_type_for(stream, settings.queue_type, known)
    except BaseException:
        client.close()
        raise
