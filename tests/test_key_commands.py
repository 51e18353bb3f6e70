"""``keyq pause``, ``keyq resume``, ``keyq stream set|show`` and ``keyq inspect`` (one key's
picture) on a real Redis and RabbitMQ set up by hand."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pika
import pytest

from keyq.broker.clock import now_ms
from keyq.broker.envelope import (
    CONTENT_JSON,
    HEADER_KEY,
    HEADER_PRODUCER,
    HEADER_PUBLISHED_AT,
    HEADER_SEQ,
)
from keyq.broker.key_control import KeyControl, ParkedKey
from keyq.broker.packs import HEADER_PACK, PACK_CONTENT_TYPE, encode_pack, encode_record
from keyq.broker.registry import QueueRegistry
from keyq.broker.stream_policy import StreamPolicies, StreamPolicy
from keyq.broker.topology import keyed_queue_arguments
from keyq.broker.worker_report import GapReport, WorkerReport
from keyq.ops.context import keys_in_file, read_keys
from tests.conftest import StreamFixture
from tests.helpers import queue_depth
from tests.operator_helpers import (
    dead_letter,
    ids_in,
    keyq,
    keyq_json,
    letters_for,
    one_line_error,
    record_stream,
)


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


def _publish(
    channel: pika.adapters.blocking_connection.BlockingChannel,
    queue: str,
    key: str,
    seqs: list[int],
    at: int,
) -> None:
    for seq in seqs:
        headers = {HEADER_KEY: key, HEADER_PRODUCER: "p1", HEADER_SEQ: seq, HEADER_PUBLISHED_AT: at}
        properties = pika.BasicProperties(
            headers=headers, content_type=CONTENT_JSON, delivery_mode=2
        )
        channel.basic_publish("", queue, orjson.dumps({"seq": seq}), properties)


def _inspect(stream: str, key: str) -> dict[str, object]:
    return keyq_json("inspect", "--stream", stream, "--key", key)


def test_inspect_shows_everything_about_a_key_and_refuses_bad_input(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    record_stream(stream)
    # a key never seen, and bad input
    found = _inspect(stream.name, "nobody")
    assert found["known"] is False
    assert found["queue"]["exists"] is False and found["dead_letters"] == []  # type: ignore[index]
    assert found["state"] is None and found["parked"] is None and found["aside"] == []
    text = keyq("inspect", "--stream", stream.name, "--key", "nobody")
    assert text.exit_code == 0 and "the key has no state" in text.stdout
    one_line_error(keyq("inspect", "--stream", "t-never-used", "--key", "a"), 2)
    one_line_error(keyq("inspect", "--stream", stream.name, "--key", ""), 2)
    one_line_error(keyq("inspect", "--stream", stream.name), 2)

    queue = f"keyq.{stream.name}.k.a"
    aside = f"keyq.{stream.name}.a.test-aside"
    stream.track(aside)
    channel = amqp.channel()
    channel.confirm_delivery()
    channel.queue_declare(queue, durable=True, arguments=keyed_queue_arguments(stream.name))
    channel.queue_declare(aside, durable=True)
    published = now_ms() - 5000
    _publish(channel, queue, "a", [4, 5, 6], published)
    _publish(channel, aside, "a", [3], published)
    QueueRegistry(stream.redis, stream.name).register({queue: "a"}, announce=False)
    control = KeyControl(stream.redis, stream.name)
    control.pause(["a"])
    control.park("a", ParkedKey(at_ms=now_ms(), reason="poison: boom", producer="p1", seq=2))
    stream.redis.hset(stream.keys.aside, "a", orjson.dumps([aside]).decode())
    stream.redis.hset(stream.keys.state, "a", orjson.dumps({"total": 7}).decode())
    stream.redis.hset(stream.keys.marks, "a", orjson.dumps({"p1": 1}).decode())
    StreamPolicies(stream.redis, stream.name).set_rate_limit(10)
    dead_letter(amqp, stream.name, letters_for(stream.name, [("a", 2), ("b", 1)]))

    found = _inspect(stream.name, "a")
    assert found["known"] is True
    assert found["queue"] == {
        "name": queue, "exists": True, "depth": 3, "consumers": 0, "registered": True,
        "idle_ms": found["queue"]["idle_ms"], "retiring": False,  # type: ignore[index]
    }  # fmt: skip
    assert found["holder"] is None
    assert found["paused_since_ms"] is not None
    parked = dict(found["parked"])  # type: ignore[call-overload]
    assert parked.pop("at_ms") and parked == {"reason": "poison: boom", "producer": "p1", "seq": 2}
    assert found["rate_limit"] == 10.0 and found["poison_policy"] == "skip"
    assert found["aside"] == [{"queue": aside, "depth": 1}]
    assert found["state"] == {"total": 7} and found["marks"] == {"p1": 1}
    oldest = found["oldest_waiting"]
    assert 4000 <= oldest["age_ms"] < 60_000  # type: ignore[index]
    assert [row["id"] for row in found["dead_letters"]] == ["p1:2"]  # type: ignore[attr-defined]
    # looking at the head left the queue as it was
    assert ids_in(amqp, queue) == ["p1:4", "p1:5", "p1:6"]

    # held by a worker: its host, pid and its gaps on this key; the head is not taken
    stream.redis.set(stream.keys.lock(queue), "w1|42", px=60_000)
    stream.redis.zadd(stream.keys.members, {"w1": now_ms() + 60_000})
    report = WorkerReport(
        worker="w1",
        stream=stream.name,
        gaps=(GapReport("a", "p1", 3, 3, 1.5), GapReport("b", "p1", 9, 9, 2.0)),
    )
    info = report.to_dict() | {"host": "box", "pid": 123}
    stream.redis.hset(stream.keys.member_info, "w1", orjson.dumps(info).decode())
    found = _inspect(stream.name, "a")
    holder = {"worker": "w1", "token": 42, "alive": True}
    assert found["holder"] == holder | {"host": "box", "pid": 123}
    assert found["gaps"] == [{"key": "a", "producer": "p1", "first": 3, "last": 3, "waited_s": 1.5}]
    assert found["oldest_waiting"]["age_ms"] is None  # type: ignore[index]
    text = keyq("inspect", "--stream", stream.name, "--key", "a")
    assert text.exit_code == 0
    for part in ("held by       w1 token 42 at box:123", "poison: boom", "rate limit 10/s", aside):
        assert part in text.stdout


def test_inspect_in_bucket_mode_finds_the_keys_first_event_alone_or_inside_a_pack(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    """A bucket queue holds several keys' events, a pack several keys' events too: the key's
    first is found among them."""
    config = record_stream(stream, mode="bucket")
    queue = config.queue_for("a")
    other = next(key for key in (f"o{i}" for i in range(1000)) if config.queue_for(key) == queue)
    channel = amqp.channel()
    channel.queue_declare(queue, durable=True, arguments=keyed_queue_arguments(stream.name))
    stream.track(queue)
    _publish(channel, queue, other, [1, 2], now_ms())
    _publish(channel, queue, "a", [1], now_ms() - 3000)
    time.sleep(0.2)
    found = _inspect(stream.name, "a")
    assert found["oldest_waiting"]["looked_at"] == 3  # type: ignore[index]
    assert found["oldest_waiting"]["age_ms"] >= 3000  # type: ignore[index]
    assert queue_depth(amqp, queue) == 3

    channel.queue_purge(queue)
    _publish(channel, queue, other, [1], now_ms())
    records = [
        encode_record(
            f"m{n}",
            CONTENT_JSON,
            {HEADER_KEY: owner, HEADER_PRODUCER: "p1", HEADER_SEQ: seq, HEADER_PUBLISHED_AT: at},
            orjson.dumps({"seq": seq}),
        )
        for n, (owner, seq, at) in enumerate(
            [(other, 2, now_ms()), ("a", 1, now_ms() - 4000), ("a", 2, now_ms())]
        )
    ]
    channel.basic_publish(
        "",
        queue,
        encode_pack(records),
        pika.BasicProperties(
            content_type=PACK_CONTENT_TYPE,
            headers={HEADER_PACK: len(records), HEADER_PUBLISHED_AT: now_ms() - 4000},
            delivery_mode=2,
        ),
    )
    time.sleep(0.2)
    found = _inspect(stream.name, "a")
    assert found["oldest_waiting"]["looked_at"] == 2  # type: ignore[index]
    assert 4000 <= found["oldest_waiting"]["age_ms"] < 60_000  # type: ignore[index]
    absent = next(key for key in (f"z{i}" for i in range(1000)) if config.queue_for(key) == queue)
    missing = _inspect(stream.name, absent)  # same queue, no event in it: every record read
    assert missing["oldest_waiting"]["age_ms"] is None  # type: ignore[index]
    assert missing["oldest_waiting"]["looked_at"] == 2  # type: ignore[index]
    assert queue_depth(amqp, queue) == 2  # looked at, handed back
