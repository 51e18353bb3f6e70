"""A stream's mode and bucket count are fixed at first use and checked ever after."""

from __future__ import annotations

from typing import Any

import pytest

from keyq import Producer
from keyq.broker.errors import ConfigurationError, StreamConfigMismatch
from keyq.broker.naming import Mode, key_queue_name
from keyq.broker.streams import DEFAULT_BUCKETS, ensure_stream_config, load_stream_config
from keyq.broker.topology import keyed_queue_arguments
from tests.conftest import StreamFixture


def test_a_new_stream_defaults_to_key_mode_and_another_mode_is_a_clear_error(
    stream: StreamFixture,
) -> None:
    assert load_stream_config(stream.redis, stream.name) is None
    config = ensure_stream_config(stream.redis, stream.name)
    assert config.mode is Mode.KEY and config.buckets is None
    assert load_stream_config(stream.redis, stream.name) == config
    with pytest.raises(StreamConfigMismatch, match=r"fixed at mode=key.*asked for mode=bucket"):
        ensure_stream_config(stream.redis, stream.name, "bucket", 8)


def test_bucket_mode_is_recorded_and_adopted_and_another_count_is_a_clear_error(
    stream: StreamFixture,
) -> None:
    config = ensure_stream_config(stream.redis, stream.name, "bucket", 12)
    assert (config.mode, config.buckets) == (Mode.BUCKET, 12)
    assert ensure_stream_config(stream.redis, stream.name) == config
    assert ensure_stream_config(stream.redis, stream.name, "bucket") == config
    assert ensure_stream_config(stream.redis, stream.name, buckets=12) == config
    with pytest.raises(StreamConfigMismatch, match=r"buckets=12.*buckets=16"):
        ensure_stream_config(stream.redis, stream.name, "bucket", 16)
    with pytest.raises(StreamConfigMismatch):
        ensure_stream_config(stream.redis, stream.name, "key")


def test_bucket_mode_without_count_starts_with_default(stream: StreamFixture) -> None:
    assert ensure_stream_config(stream.redis, stream.name, "bucket").buckets == DEFAULT_BUCKETS


@pytest.mark.parametrize(
    ("mode", "buckets"),
    [("queue", None), ("bucket", 0), ("bucket", -1), ("key", 4), ("bucket", "8")],
)
def test_invalid_requests(stream: StreamFixture, mode: str, buckets: object) -> None:
    with pytest.raises(ConfigurationError):
        ensure_stream_config(stream.redis, stream.name, mode, buckets)  # type: ignore[arg-type]
    assert load_stream_config(stream.redis, stream.name) is None


def test_producer_with_other_mode_fails_before_publishing(stream: StreamFixture) -> None:
    ensure_stream_config(stream.redis, stream.name, "bucket", 4)
    with pytest.raises(StreamConfigMismatch):
        Producer(stream.name, mode="key", settings=stream.settings)
    with Producer(stream.name, settings=stream.settings) as producer:
        assert producer.config.buckets == 4


def test_queue_type_is_recorded_adopted_and_checked(stream: StreamFixture) -> None:
    config = ensure_stream_config(stream.redis, stream.name, "key", queue_type="quorum")
    assert config.queue_type == "quorum"
    assert ensure_stream_config(stream.redis, stream.name).queue_type == "quorum"
    assert ensure_stream_config(stream.redis, stream.name, "key").queue_type == "quorum"
    with pytest.raises(StreamConfigMismatch, match=r"queue type quorum.*queue type classic"):
        ensure_stream_config(stream.redis, stream.name, queue_type="classic")


def test_a_stream_recorded_without_a_queue_type_is_classic(stream: StreamFixture) -> None:
    stream.redis.set(stream.keys.config, '{"mode": "key", "buckets": null}')
    assert ensure_stream_config(stream.redis, stream.name).queue_type == "classic"
    with pytest.raises(StreamConfigMismatch):
        ensure_stream_config(stream.redis, stream.name, queue_type="quorum")


def test_an_unknown_queue_type_is_refused(stream: StreamFixture) -> None:
    with pytest.raises(ConfigurationError, match="queue type"):
        ensure_stream_config(stream.redis, stream.name, queue_type="stream")
    assert load_stream_config(stream.redis, stream.name) is None


def test_producers_declare_the_streams_queue_type(stream: StreamFixture, amqp: Any) -> None:
    """The first producer fixes quorum; a later one that asks for nothing declares quorum
    queues with the delivery limit (RabbitMQ accepts a redeclaration only with the same
    arguments), and one that asks for classic fails before declaring anything."""
    with Producer(stream.name, mode="key", queue_type="quorum", settings=stream.settings) as p:
        p.publish("acct-1", {"n": 1})
        p.flush()
    with Producer(stream.name, settings=stream.settings) as later:
        later.publish("acct-2", {"n": 1})
        later.flush()
    channel = amqp.channel()
    for key in ("acct-1", "acct-2"):
        queue = key_queue_name(stream.name, key)
        channel.queue_declare(
            queue, durable=True, arguments=keyed_queue_arguments(stream.name, "quorum")
        )
        assert keyed_queue_arguments(stream.name, "quorum")["x-delivery-limit"] >= 100
    with pytest.raises(StreamConfigMismatch, match="queue type classic"):
        Producer(stream.name, queue_type="classic", settings=stream.settings)
