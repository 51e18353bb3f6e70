"""Auto mode's operator surface on a real Redis and RabbitMQ: ``keyq key promote``, a key's route
in ``keyq inspect``, ``keyq status`` and the console, and waking that follows the route."""

from __future__ import annotations

import orjson
import pika
import pytest
from starlette.testclient import TestClient

from keyq.broker.key_control import KeyControl
from keyq.broker.locks import Lease
from keyq.broker.registry import QueueRegistry
from keyq.broker.routes import WHY_OPERATOR, WHY_RATE, RouteBook
from keyq.broker.settings import Settings
from keyq.broker.streams import StreamConfig, ensure_stream_config
from keyq.console.access import Access
from keyq.console.app import create_app
from tests.conftest import StreamFixture
from tests.helpers import queue_depth
from tests.operator_helpers import keyq, one_line_error, record_stream
from tests.operator_helpers import keyq_json as _json

BUCKETS = 4


def _auto(stream: StreamFixture) -> StreamConfig:
    return ensure_stream_config(stream.redis, stream.name, "auto", BUCKETS)


def _close_move(stream: StreamFixture, config: StreamConfig, key: str, epoch: int) -> None:
    """Close the key's move as its bucket's holder does, under that bucket's lease."""
    bucket = config.queue_for(key)
    stream.redis.set(stream.keys.lock(bucket), "w1|7", px=60_000)
    book = RouteBook(stream.redis, stream.name)
    assert book.close(key, epoch, Lease(queue=bucket, owner="w1", token=7)) is True
    stream.redis.delete(stream.keys.lock(bucket))


def test_promote_declares_registers_and_announces_the_own_queue(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    config = _auto(stream)
    odd = "a key/with spaces"  # its own queue is named by its digest
    result = keyq("key", "promote", "a", odd, "--stream", stream.name)
    assert result.exit_code == 0, result.stderr
    book = RouteBook(stream.redis, stream.name)
    for epoch, key in enumerate(("a", odd), start=1):
        own = config.own_queue_for(key)
        assert f"{key}: promoted to {own} at epoch {epoch}" in result.stdout
        route = book.route(key)
        assert route is not None
        assert (route.queue, route.bucket) == (own, config.queue_for(key))
        assert (route.open, route.why, route.epoch) == (True, WHY_OPERATOR, epoch)
        assert queue_depth(amqp, own) == 0  # declared
        assert stream.redis.zscore(stream.keys.registry, own) is not None
        assert stream.redis.hget(stream.keys.queue_keys, own) == key
        assert stream.redis.zscore(stream.keys.woken, own) is not None
        assert queue_depth(amqp, config.queue_for(key)) is None  # no bucket declared for it
    assert f".{stream.name}.h." in config.own_queue_for(odd)

    again = keyq("key", "promote", "a", "--stream", stream.name)
    assert again.exit_code == 0, again.stderr
    assert "a: already promoted to" in again.stdout and "epoch 1" in again.stdout
    shown = _json("key", "promote", "a", "--stream", stream.name)
    [row] = shown["promoted"]
    assert row["already"] is True and row["epoch"] == 1 and row["why"] == WHY_OPERATOR
    assert shown["refused"] == [] and shown["woken"] == [config.own_queue_for("a")]
    assert book.count() == 2
    assert book.counts() == {f"promoted:{WHY_OPERATOR}": 2}


@pytest.mark.parametrize("mode", ["key", "bucket"])
def test_promote_is_refused_outside_auto_mode(stream: StreamFixture, mode: str) -> None:
    record_stream(stream, mode=mode)
    line = one_line_error(keyq("key", "promote", "a", "--stream", stream.name), 2)
    assert f"in {mode} mode" in line and "auto-mode" in line
    assert stream.redis.hlen(stream.keys.routes) == 0
    assert stream.redis.zcard(stream.keys.registry) == 0


def test_promote_refuses_bad_input_and_a_key_whose_events_wait_aside(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    config = _auto(stream)
    unknown = ["a", "--stream", "t-never-used"]
    for bad in (["--stream", stream.name], ["", "--stream", stream.name], unknown, ["a"]):
        one_line_error(keyq("key", "promote", *bad), 2)
    assert stream.redis.hlen(stream.keys.routes) == 0, "bad input promoted a key"
    aside = f"keyq.{stream.name}.a.test-aside"
    stream.redis.hset(stream.keys.aside, "a", orjson.dumps([aside]).decode())
    result = keyq("key", "promote", "a", "b", "--stream", stream.name)
    line = one_line_error(result, 1)
    assert "'a'" in line and "aside" in line and "resume" in line
    assert "b: promoted to" in result.stdout and "a:" not in result.stdout
    book = RouteBook(stream.redis, stream.name)
    assert book.route("a") is None and book.route("b") is not None
    assert queue_depth(amqp, config.own_queue_for("a")) is None
    assert stream.redis.zscore(stream.keys.registry, config.own_queue_for("a")) is None
    # once its aside list is drained, it is promoted
    stream.redis.hdel(stream.keys.aside, "a")
    assert keyq("key", "promote", "a", "--stream", stream.name).exit_code == 0
    assert book.route("a") is not None


def test_inspect_shows_the_route(stream: StreamFixture, amqp: pika.BlockingConnection) -> None:
    config = _auto(stream)
    bucket, own = config.queue_for("a"), config.own_queue_for("a")
    before = _json("inspect", "--stream", stream.name, "--key", "a")
    assert before["route"] == {
        "to": "bucket", "bucket": bucket, "queue": None, "epoch": None, "move": None,
        "since_ms": None, "why": None, "bucket_queue": None, "changes": [],
    }  # fmt: skip
    assert before["queue"]["name"] == bucket
    text = keyq("inspect", "--stream", stream.name, "--key", "a").stdout
    assert f"route         bucket {bucket} (not promoted)" in text

    assert keyq("key", "promote", "a", "--stream", stream.name).exit_code == 0
    stream.redis.set(stream.keys.lock(own), "w2|3", px=60_000)  # its own queue's holder
    found = _json("inspect", "--stream", stream.name, "--key", "a")
    route = found["route"]
    assert route["to"] == "own" and route["queue"] == own and route["bucket"] == bucket
    assert (route["epoch"], route["move"], route["why"]) == (1, "open", WHY_OPERATOR)
    assert route["bucket_queue"] == {
        "name": bucket, "exists": False, "depth": None, "consumers": None, "holder": None,
    }  # fmt: skip
    assert [change["what"] for change in route["changes"]] == ["promoted"]
    assert found["known"] is True
    assert found["queue"]["name"] == own and found["queue"]["exists"] is True
    assert found["holder"]["worker"] == "w2"

    _close_move(stream, config, "a", 1)
    found = _json("inspect", "--stream", stream.name, "--key", "a")
    route = found["route"]
    assert route["move"] == "closed"
    assert [change["what"] for change in route["changes"]] == ["closed", "promoted"]
    text = keyq("inspect", "--stream", stream.name, "--key", "a").stdout
    assert f"route         own queue {own} since " in text
    assert "epoch 1, move closed, why operator" in text
    assert f"own queue     {own}  (0 ready)" in text
    assert "held by       w2 " in text
    assert f"bucket        {bucket}  (missing), forwards the key's events" in text
    assert "closed epoch 1" in text and "promoted epoch 1 (operator)" in text


def test_status_counts_promotions_and_demotions(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    config = _auto(stream)
    none = {"promoted_keys": 0, "open_moves": 0, "promotions": {}, "demotions": 0}
    assert _json("status", "--stream", stream.name)["routes"] == none
    assert keyq("key", "promote", "a", "b", "--stream", stream.name).exit_code == 0
    book = RouteBook(stream.redis, stream.name)
    assert book.promote("c", config.own_queue_for("c"), config.queue_for("c"), WHY_RATE)
    _close_move(stream, config, "a", 1)
    assert book.demote("a", config.own_queue_for("a"))
    # a producer registers a bucket with the first key it published to it: not the bucket's
    QueueRegistry(stream.redis, stream.name).register({config.queue_for("x"): "x"})
    stream.track(config.queue_for("x"))
    status = _json("status", "--stream", stream.name)
    assert status["routes"] == {
        "promoted_keys": 2,
        "open_moves": 2,
        "promotions": {WHY_OPERATOR: 2, WHY_RATE: 1},
        "demotions": 1,
    }
    keyed = {row["name"]: row["key"] for row in status["queues"]}
    assert keyed[config.own_queue_for("b")] == "b"
    assert keyed[config.queue_for("x")] is None
    text = keyq("status", "--stream", stream.name).stdout
    routes = "promoted keys 2   open moves 2   promotions 3 (operator 2, rate 1)   demotions 1"
    assert routes in text
    other = StreamFixture(f"{stream.name}k", stream.settings, stream.redis).own()
    try:  # a key mode stream has no routes, in its status or a key's picture
        record_stream(other)
        assert _json("status", "--stream", other.name)["routes"] is None
        assert _json("inspect", "--stream", other.name, "--key", "a")["route"] is None
        assert "promoted keys" not in keyq("status", "--stream", other.name).stdout
    finally:
        other.cleanup()


def test_resume_wakes_the_queue_the_route_names(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    """A promoted key's own queue is woken with its key; an unpromoted key's bucket with none."""
    config = _auto(stream)
    book = RouteBook(stream.redis, stream.name)
    assert book.promote("a", config.own_queue_for("a"), config.queue_for("a"), WHY_RATE)
    KeyControl(stream.redis, stream.name).pause(["a", "b"])
    done = _json("resume", "--stream", stream.name, "--key", "a", "--key", "b")
    own, bucket = config.own_queue_for("a"), config.queue_for("b")
    assert sorted(done["woken"]) == sorted([own, bucket])
    stream.track(own, bucket)
    assert queue_depth(amqp, own) == 0 and queue_depth(amqp, bucket) == 0
    assert stream.redis.hget(stream.keys.queue_keys, own) == "a"
    assert stream.redis.hget(stream.keys.queue_keys, bucket) is None
    assert stream.redis.zscore(stream.keys.registry, bucket) is not None


def test_auto_mode_is_a_mode_of_the_cli(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    result = keyq(
        "publish", "--stream", stream.name, "--key", "a", "--event", "{}", "--mode", "auto",
        "--buckets", str(BUCKETS),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    config = _auto(stream)  # as recorded by the publish
    assert f"a\t{config.queue_for('a')}\t" in result.stdout
    assert queue_depth(amqp, config.queue_for("a")) == 1
    shown = _json("stream", "show", "--stream", stream.name)
    assert shown["mode"] == "auto" and shown["buckets"] == BUCKETS


def test_the_consoles_key_page_shows_the_route(
    stream: StreamFixture, settings: Settings, amqp: pika.BlockingConnection
) -> None:
    config = _auto(stream)
    assert keyq("key", "promote", "pro-a", "--stream", stream.name).exit_code == 0
    app = create_app(settings, Access(), [stream.name])
    with TestClient(app, base_url="http://127.0.0.1") as client:
        base = f"/streams/{stream.name}/key"
        page = client.get(base, params={"key": "pro-a"})
        assert page.status_code == 200
        assert 'data-field="route"' in page.text and "<h2>Own queue</h2>" in page.text
        assert f"its own queue <code>{config.own_queue_for('pro-a')}</code>" in page.text
        assert "(epoch 1, why operator)" in page.text and "promoted epoch 1" in page.text
        other = client.get(base, params={"key": "pro-b"}).text
        assert f"its bucket <code>{config.queue_for('pro-b')}</code> (not promoted)" in other
        found = client.get(base, params={"key": "pro", "prefix": "1"}).text
        assert ">pro-a</a>" in found  # known by its route and its own queue only
