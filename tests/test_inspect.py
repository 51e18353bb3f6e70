"""``keyq inspect``: one key's picture, read from a real RabbitMQ and Redis set up by hand."""

from __future__ import annotations

import time

import orjson
import pika

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
from keyq.broker.stream_policy import StreamPolicies
from keyq.broker.topology import keyed_queue_arguments
from keyq.broker.worker_report import GapReport, WorkerReport
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
