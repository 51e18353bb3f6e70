"""``keyq pause``, ``keyq resume`` and ``keyq stream set|show`` on a real Redis (and RabbitMQ
for the queues a resume wakes)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pika
import pytest

from keyq.broker.key_control import KeyControl, ParkedKey
from keyq.broker.stream_policy import StreamPolicies, StreamPolicy
from keyq.ops.context import keys_in_file, read_keys
from tests.conftest import StreamFixture
from tests.helpers import queue_depth
from tests.operator_helpers import keyq, one_line_error, record_stream


def test_pause_and_resume_keys_from_options_and_a_file(
    stream: StreamFixture, amqp: pika.BlockingConnection, tmp_path: Path
) -> None:
    record_stream(stream)
    control = KeyControl(stream.redis, stream.name)
    listed = tmp_path / "keys.txt"
    listed.write_text("b\n\nc:1\nb\n")
    result = keyq("pause", "--stream", stream.name, "--key", "a", "--keys-file", str(listed))
    assert result.exit_code == 0, result.stderr
    assert "paused 3 keys" in result.stdout
    assert set(control.paused()) == {"a", "b", "c:1"}
    again = keyq("pause", "--stream", stream.name, "--key", "a", "--json")
    assert orjson.loads(again.stdout)["paused"] == []
    result = keyq("resume", "--stream", stream.name, "--key", "a", "--key", "zz", "--json")
    assert result.exit_code == 0, result.stderr
    done = orjson.loads(result.stdout)
    assert done["resumed"] == ["a"] and done["woken"] == [f"keyq.{stream.name}.k.a"]
    assert set(control.paused()) == {"b", "c:1"}
    own = f"keyq.{stream.name}.k.a"
    assert queue_depth(amqp, own) == 0
    assert stream.redis.zscore(stream.keys.registry, own) is not None
    assert stream.redis.hget(stream.keys.queue_keys, own) == "a"
    assert stream.redis.zscore(stream.keys.woken, own) is not None


def test_stream_set_and_show(stream: StreamFixture) -> None:
    record_stream(stream, mode="bucket")
    control = KeyControl(stream.redis, stream.name)
    control.pause(["a", "b"])
    control.park("c", ParkedKey(at_ms=1, reason="poison", producer="p", seq=4))
    result = keyq(
        "stream", "set", "--stream", stream.name, "--poison-policy", "park", "--rate-limit", "2.5"
    )
    assert result.exit_code == 0, result.stderr
    assert "poison policy park, rate limit 2.5/s per key" in result.stdout
    policies = StreamPolicies(stream.redis, stream.name)
    assert policies.load() == StreamPolicy(poison_policy="park", rate_limit=2.5)
    shown = orjson.loads(keyq("stream", "show", "--stream", stream.name, "--json").stdout)
    config = {"stream": stream.name, "mode": "bucket", "buckets": 4, "queue_type": "classic"}
    policy = {"poison_policy": "park", "rate_limit": 2.5, "dedupe_window_s": 86_400}
    assert shown == config | policy | {"paused": False, "paused_keys": 2, "parked_keys": 1}
    assert keyq("stream", "set", "--stream", stream.name, "--rate-limit", "none").exit_code == 0
    assert policies.load().rate_limit is None
    set_window = keyq("stream", "set", "--stream", stream.name, "--dedupe-window", "3600")
    assert set_window.exit_code == 0, set_window.stderr
    assert policies.load().dedupe_window_s == 3600
    too_short = keyq("stream", "set", "--stream", stream.name, "--dedupe-window", "5")
    assert "dedupe window must be 60 s to 30 days" in one_line_error(too_short, 2)
    assert policies.load().dedupe_window_s == 3600
    text = keyq("stream", "show", "--stream", stream.name)
    assert "rate limit none" in text.stdout and "parked keys 1" in text.stdout


def test_bad_input_changes_nothing_then_the_whole_stream_pauses_and_status_shows_it(
    stream: StreamFixture, tmp_path: Path
) -> None:
    record_stream(stream)
    name = stream.name
    bad_file = tmp_path / "keys.txt"
    bad_file.write_text("ok\n" + "x" * 5000 + "\n")
    cases = [
        ("pause", "--stream", "t-never-used", "--key", "a"),
        ("pause", "--stream", "no.dots", "--key", "a"),
        ("pause", "--stream", name, "--key", ""),
        ("pause", "--stream", name, "--key", "a", "--all"),
        ("pause", "--stream", name),
        ("pause", "--stream", name, "--keys-file", str(bad_file)),
        ("pause", "--stream", name, "--keys-file", str(tmp_path / "missing")),
        ("resume", "--stream", name, "--key", "x" * 5000),
        ("resume", "--stream", "t-never-used", "--all"),
        ("stream", "set", "--stream", name),
        ("stream", "set", "--stream", name, "--poison-policy", "drop"),
        ("stream", "set", "--stream", name, "--rate-limit", "0"),
        ("stream", "set", "--stream", name, "--rate-limit", "-3"),
        ("stream", "set", "--stream", name, "--rate-limit", "nan"),
        ("stream", "set", "--stream", name, "--rate-limit", "fast"),
        ("stream", "set", "--stream", name, "--poison-policy", "park", "--rate-limit", "0"),
        ("stream", "set", "--stream", "t-never-used", "--poison-policy", "park"),
        ("stream", "show", "--stream", "t-never-used"),
        ("stream", "show"),
    ]
    for args in cases:
        one_line_error(keyq(*args), 2)
    missing = one_line_error(keyq("stream", "show", "--stream", "t-never-used"), 2)
    assert missing == "keyq: stream t-never-used does not exist"
    assert not stream.redis.exists(stream.keys.paused_keys, stream.keys.policy)
    assert not stream.redis.exists("keyq:{t-never-used}:config", "keyq:{t-never-used}:policy")
    # the whole stream paused, and the policy in the status
    policies = StreamPolicies(stream.redis, stream.name)
    KeyControl(stream.redis, stream.name).pause(["a"])
    assert keyq("stream", "set", "--stream", stream.name, "--rate-limit", "3").exit_code == 0
    assert keyq("pause", "--stream", stream.name, "--all").exit_code == 0
    assert policies.load().paused, "pause --all did not pause the stream"
    shown = orjson.loads(keyq("stream", "show", "--stream", stream.name, "--json").stdout)
    assert shown["paused"] is True, "stream show does not say paused"
    status = orjson.loads(keyq("status", "--stream", stream.name, "--json").stdout)
    stopped = {"paused": True, "paused_keys": 1, "parked_keys": 0}
    assert status["policy"] == {"poison_policy": "skip", "rate_limit": 3.0} | stopped
    text = keyq("status", "--stream", stream.name).stdout
    assert "poison policy skip   rate limit 3/s per key   paused keys 1   parked keys 0" in text
    assert "STREAM PAUSED" in text
    assert keyq("resume", "--stream", stream.name, "--all").exit_code == 0
    assert not policies.load().paused, "resume --all left the stream paused"


def test_read_keys_keeps_order_drops_repeats_and_keeps_each_keys_spaces(tmp_path: Path) -> None:
    listed = tmp_path / "keys"
    listed.write_text("b\r\na\n\n  \nb\n")
    assert read_keys(("c", "a"), str(listed)) == ["c", "a", "b"]
    assert read_keys(("k",), None) == ["k"]
    listed.write_text(" padded \nplain\r\n\n   \nlast")
    assert keys_in_file(str(listed)) == [" padded ", "plain", "last"]


def test_rabbitmq_down_is_exit_1_and_changes_nothing(
    stream: StreamFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    record_stream(stream)
    control = KeyControl(stream.redis, stream.name)
    control.pause(["a"])
    control.park("a", ParkedKey(at_ms=1, reason="poison", producer="p", seq=1))
    monkeypatch.setenv("KEYQ_AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2F")
    monkeypatch.setenv("KEYQ_CONNECT_TIMEOUT", "2")
    for args in (
        ("resume", "--stream", stream.name, "--key", "a"),
        ("dlq", "redrive", "--stream", stream.name, "--key", "a", "--skip"),
        ("dlq", "redrive", "--stream", stream.name, "--key", "a"),
        ("dlq", "list", "--stream", stream.name),
        ("inspect", "--stream", stream.name, "--key", "a"),
    ):
        assert "cannot reach RabbitMQ" in one_line_error(keyq(*args), 1)
    assert set(control.paused()) == {"a"} and set(control.parked()) == {"a"}
    assert not stream.redis.exists(stream.keys.redrive_lock, stream.keys.redrives)
