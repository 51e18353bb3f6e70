"""A stream's mode and bucket count are fixed at first use and checked ever after."""

from __future__ import annotations

import pytest

from keyq import Producer
from keyq.broker.errors import ConfigurationError, StreamConfigMismatch
from keyq.broker.naming import Mode
from keyq.broker.streams import DEFAULT_BUCKETS, ensure_stream_config, load_stream_config
from tests.conftest import StreamFixture


def test_new_stream_defaults_to_key_mode(stream: StreamFixture) -> None:
    assert load_stream_config(stream.redis, stream.name) is None
    config = ensure_stream_config(stream.redis, stream.name)
    assert config.mode is Mode.KEY and config.buckets is None
    assert load_stream_config(stream.redis, stream.name) == config


def test_bucket_mode_is_recorded_and_adopted(stream: StreamFixture) -> None:
    config = ensure_stream_config(stream.redis, stream.name, "bucket", 12)
    assert (config.mode, config.buckets) == (Mode.BUCKET, 12)
    assert ensure_stream_config(stream.redis, stream.name) == config
    assert ensure_stream_config(stream.redis, stream.name, "bucket") == config
    assert ensure_stream_config(stream.redis, stream.name, buckets=12) == config


def test_bucket_mode_without_count_starts_with_default(stream: StreamFixture) -> None:
    config = ensure_stream_config(stream.redis, stream.name, "bucket")
    assert config.buckets == DEFAULT_BUCKETS


def test_other_mode_is_a_clear_error(stream: StreamFixture) -> None:
    ensure_stream_config(stream.redis, stream.name, "key")
    with pytest.raises(StreamConfigMismatch, match=r"fixed at mode=key.*asked for mode=bucket"):
        ensure_stream_config(stream.redis, stream.name, "bucket", 8)


def test_other_bucket_count_is_a_clear_error(stream: StreamFixture) -> None:
    ensure_stream_config(stream.redis, stream.name, "bucket", 8)
    with pytest.raises(StreamConfigMismatch, match=r"buckets=8.*buckets=16"):
        ensure_stream_config(stream.redis, stream.name, "bucket", 16)
    with pytest.raises(StreamConfigMismatch):
        ensure_stream_config(stream.redis, stream.name, "key")


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
