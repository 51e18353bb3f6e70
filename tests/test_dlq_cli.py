"""``keyq dlq``: list, show, drop and redrive on a real RabbitMQ and Redis. Letters are put in the
dead-letter queue exactly as a worker puts them (``dead_letter_properties``)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

import orjson
import pika
import pytest

from keyq.broker.envelope import (
    HEADER_ATTEMPTS,
    HEADER_DEAD_QUEUE,
    HEADER_DEAD_REASON,
    HEADER_KEY,
    HEADER_PRODUCER,
    HEADER_REDRIVE_ID,
)
from keyq.broker.key_control import KeyControl, ParkedKey
from keyq.broker.naming import dead_letter_queue_name
from tests.conftest import StreamFixture
from tests.helpers import queue_depth
from tests.operator_helpers import (
    dead_letter,
    foreign_delivery,
    ids_in,
    keyq,
    keyq_json,
    letters_for,
    one_line_error,
    peek_all,
    record_stream,
    with_seams,
)
from tests.workers import wait_until

PLAN = [("a", 1), ("b", 1), ("a", 2), ("c", 1), ("b", 2), ("a", 3)]


def _listing(stream: str, *args: str) -> dict[str, Any]:
    return keyq_json("dlq", "list", "--stream", stream, *args)


def _ids(listing: dict[str, Any]) -> list[str]:
    return [row["id"] for row in listing["letters"]]


def _fill(stream: StreamFixture, amqp: pika.BlockingConnection, queue_type: str = "classic") -> str:
    record_stream(stream, queue_type=queue_type)
    deliveries = letters_for(stream.name, PLAN)
    deliveries.insert(3, foreign_delivery("keyq.x.k.a", b"not from keyq", {"app": "legacy"}))
    dead_letter(amqp, stream.name, deliveries, queue_type=queue_type)
    return dead_letter_queue_name(stream.name)


def test_list_show_and_bad_input_neither_consume_nor_reorder_and_drop_leaves_the_rest(
    stream: StreamFixture, amqp: pika.BlockingConnection, tmp_path: Any
) -> None:
    queue = _fill(stream, amqp)
    before = ids_in(amqp, queue)
    first = _listing(stream.name)
    assert _ids(first) == _ids(_listing(stream.name)), "two listings differ"
    assert [i for i in _ids(first) if not i.startswith("sha256:")] == [
        f"p1:{seq}" for _key, seq in PLAN
    ]
    row = first["letters"][0]
    assert row["key"] == "a" and row["producer"] == "p1" and row["seq"] == 1
    assert row["reason"] == "poison: bad payload" and row["attempts"] == 3
    assert row["dead_queue"] == f"keyq.{stream.name}.k.a"
    assert row["content_type"] == "application/json"
    assert row["preview"] == '{"k":"a","s":1}'
    foreign = first["letters"][3]
    assert foreign["foreign"] and foreign["key"] is None
    assert foreign["id"].startswith("sha256:") and len(foreign["id"]) == len("sha256:") + 16
    text = keyq("dlq", "list", "--stream", stream.name)
    assert text.exit_code == 0 and "7 letters" in text.stdout and "(foreign)" in text.stdout
    # by key and limit
    of_a = _listing(stream.name, "--key", "a")
    assert [(row["key"], row["seq"]) for row in of_a["letters"]] == [("a", 1), ("a", 2), ("a", 3)]
    limited = _listing(stream.name, "--limit", "2")
    assert [row["key"] for row in limited["letters"]] == ["a", "b"]
    assert _listing(stream.name, "--key", "a", "--limit", "1")["letters"][0]["seq"] == 1
    # show a keyq letter and a foreign one
    shown = keyq_json("dlq", "show", "--stream", stream.name, "--id", "p1:3")
    assert shown["key"] == "a" and orjson.loads(shown["payload"]) == {"k": "a", "s": 3}
    assert shown["headers"][HEADER_DEAD_REASON] == "poison: bad payload"
    shown = keyq_json("dlq", "show", "--stream", stream.name, "--id", first["letters"][3]["id"])
    assert shown["foreign"] and shown["payload"] == "not from keyq"
    assert shown["headers"]["app"] == "legacy"
    # p1:1 names letters of keys a, b and c: a key must choose
    ambiguous = keyq("dlq", "show", "--stream", stream.name, "--id", "p1:1")
    assert "--key" in one_line_error(ambiguous, 2)
    chosen = keyq("dlq", "show", "--stream", stream.name, "--id", "p1:1", "--key", "c")
    assert chosen.exit_code == 0 and '{"k":"c","s":1}' in chosen.stdout
    assert ids_in(amqp, queue) == before, "looking changed the queue"
    # bad input is one line and changes nothing
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    name = stream.name
    usage_cases = [
        ("dlq", "list", "--stream", "t-nothing-here"),
        ("dlq", "list", "--stream", "bad.name"),
        ("dlq", "list", "--stream", name, "--key", ""),
        ("dlq", "list", "--stream", name, "--limit", "0"),
        ("dlq", "list", "--stream", name, "--limit", "x"),
        ("dlq", "list"),
        ("dlq", "show", "--stream", name, "--id", "p9:9"),
        ("dlq", "drop", "--stream", name),
        ("dlq", "drop", "--stream", name, "--id", "p9:9", "--yes"),
        ("dlq", "redrive", "--stream", name),
        ("dlq", "redrive", "--stream", name, "--key", "a", "--to-key", "b"),
        ("dlq", "redrive", "--stream", name, "--key", "a", "--skip", "--id", "p1:2"),
        ("dlq", "redrive", "--stream", name, "--id", "p1:2", "--payload-file", str(bad_json)),
        ("dlq", "redrive", "--stream", name, "--id", "p1:2", "--payload-file", "/nonexistent"),
        ("dlq", "redrive", "--stream", name, "--id", "p1:2", "--to-key", "x" * 5000),
        ("dlq", "nonsense"),
    ]
    for args in usage_cases:
        one_line_error(keyq(*args), 2)
    one_line_error(keyq("dlq", "redrive", "--stream", name, "--key", "nobody"), 1)
    one_line_error(keyq("dlq", "drop", "--stream", name, "--key", "nobody", "--yes"), 1)
    assert ids_in(amqp, queue) == before
    assert stream.redis.hlen(stream.keys.redrives) == 0
    assert not stream.redis.exists(stream.keys.aside, stream.keys.redrive_lock)
    # drop by key, then by id: the rest stays in order
    result = keyq("dlq", "drop", "--stream", stream.name, "--key", "b", "--yes")
    assert result.exit_code == 0, result.stderr
    left = [(r["key"], r["seq"]) for r in _listing(stream.name)["letters"]]
    assert left == [("a", 1), ("a", 2), (None, None), ("c", 1), ("a", 3)]
    result = keyq(
        "dlq", "drop", "--stream", stream.name, "--id", foreign["id"], "--id", "p1:2", "--yes"
    )
    assert result.exit_code == 0, result.stderr
    assert ids_in(amqp, queue) == ["p1:1", "p1:1", "p1:3"]
    declined = keyq("dlq", "drop", "--stream", stream.name, "--key", "a")  # no --yes, no stdin
    assert declined.exit_code == 1
    assert ids_in(amqp, queue) == ["p1:1", "p1:1", "p1:3"]


@pytest.mark.broker_versions
def test_listing_a_quorum_dead_letter_queue_keeps_its_order(
    stream: StreamFixture, private_rabbit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quorum queues hand returned messages back by their own rules (on a private node)."""
    monkeypatch.setenv("KEYQ_AMQP_URL", private_rabbit.url)
    connection = pika.BlockingConnection(pika.URLParameters(private_rabbit.url))
    try:
        queue = _fill(stream, connection, queue_type="quorum")
        before = ids_in(connection, queue)
        listings = [_ids(_listing(stream.name)) for _ in range(3)]
        assert listings[0] == listings[1] == listings[2]
        assert ids_in(connection, queue) == before
        result = keyq("dlq", "drop", "--stream", stream.name, "--key", "b", "--yes")
        assert result.exit_code == 0, result.stderr
        assert ids_in(connection, queue) == ["p1:1", "p1:2", before[3], "p1:1", "p1:3"]
        redriven = keyq_json("dlq", "redrive", "--stream", stream.name, "--key", "a")["queue"]
        copies = peek_all(connection, redriven)
        assert [h[HEADER_REDRIVE_ID] for h, _b in copies] == ["p1:1", "p1:2", "p1:3"]
        assert ids_in(connection, queue) == [before[3], "p1:1"]
        channel = connection.channel()
        for name in (queue, redriven, f"keyq.{stream.name}.k.a"):
            channel.queue_delete(name)
    finally:
        connection.close()
    stream.redis.delete(stream.keys.redrives, stream.keys.aside)


def test_redrive_puts_a_keys_letters_ahead_and_unparks_it(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    queue = _fill(stream, amqp)
    control = KeyControl(stream.redis, stream.name)
    control.park("a", ParkedKey(at_ms=1, reason="poison", producer="p1", seq=1))
    stream.redis.hset(stream.keys.aside, "a", orjson.dumps(["waiting-aside"]).decode())
    done = keyq_json("dlq", "redrive", "--stream", stream.name, "--key", "a")
    redriven = done["queue"]
    assert done["letters"] == 3 and done["unparked"] and done["key"] == "a"
    copies = peek_all(amqp, redriven)
    assert [h[HEADER_REDRIVE_ID] for h, _b in copies] == ["p1:1", "p1:2", "p1:3"]
    assert [orjson.loads(b) for _h, b in copies] == [{"k": "a", "s": s} for s in (1, 2, 3)]
    for headers, _body in copies:
        assert headers[HEADER_KEY] == "a" and headers[HEADER_PRODUCER] == "p1"
        assert not {HEADER_DEAD_REASON, HEADER_DEAD_QUEUE, HEADER_ATTEMPTS} & set(headers)
    assert control.keys_aside() == {"a": [redriven, "waiting-aside"]}
    assert control.parked() == {}
    assert stream.redis.hget(stream.keys.redrives, redriven) == "a"
    # the rest stays, in order
    assert [row["key"] for row in _listing(stream.name)["letters"]] == ["b", None, "c", "b"]
    assert queue_depth(amqp, queue) == 4
    # the key's own queue exists, is registered and announced as woken
    own = f"keyq.{stream.name}.k.a"
    assert queue_depth(amqp, own) == 0 and done["woken"] == [own]
    assert stream.redis.zscore(stream.keys.registry, own) is not None
    assert stream.redis.zscore(stream.keys.woken, own) is not None
    again = keyq("dlq", "redrive", "--stream", stream.name, "--key", "a")
    assert "no dead letters of key a" in one_line_error(again, 1)
    # --skip unparks a key without touching its dead letters
    before = ids_in(amqp, queue)
    control.park("b", ParkedKey(at_ms=1, reason="poison", producer="p1", seq=1))
    result = keyq("dlq", "redrive", "--stream", stream.name, "--key", "b", "--skip")
    assert result.exit_code == 0, result.stderr
    assert "unparked" in result.stdout and control.parked() == {}
    assert ids_in(amqp, queue) == before, "--skip touched the dead letters"
    assert stream.redis.zscore(stream.keys.woken, f"keyq.{stream.name}.k.b") is not None


def test_redrive_one_letter_to_another_key_with_a_corrected_payload(
    stream: StreamFixture, amqp: pika.BlockingConnection, tmp_path: Any
) -> None:
    queue = _fill(stream, amqp)
    foreign_id = _listing(stream.name)["letters"][3]["id"]
    refused = keyq("dlq", "redrive", "--stream", stream.name, "--id", foreign_id)
    assert one_line_error(refused, 2) == f"keyq: letter {foreign_id} has no key: pass --to-key"
    done = keyq_json("dlq", "redrive", "--stream", stream.name, "--id", foreign_id, "--to-key", "z")
    [(headers, body)] = peek_all(amqp, done["queue"])
    assert headers[HEADER_KEY] == "z" and headers[HEADER_REDRIVE_ID] == foreign_id
    assert HEADER_PRODUCER not in headers and body == b"not from keyq"
    fixed = tmp_path / "fixed.json"
    fixed.write_text('{"k": "c", "s": 1, "fixed": true}')
    result = keyq(
        "dlq", "redrive", "--stream", stream.name, "--id", "p1:1", "--key", "c",
        "--payload-file", str(fixed), "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    [(headers, body)] = peek_all(amqp, orjson.loads(result.stdout)["queue"])
    assert orjson.loads(body)["fixed"] and headers[HEADER_KEY] == "c"
    assert [row["key"] for row in _listing(stream.name)["letters"]] == ["a", "b", "a", "b", "a"]
    assert queue_depth(amqp, queue) == 5


def _wait_paused(process: subprocess.Popen[str]) -> None:
    assert process.stderr is not None
    line = process.stderr.readline()
    assert line.startswith("paused after"), line


def test_a_redrive_killed_half_way_is_safe_to_run_again(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    queue = _fill(stream, amqp)
    seams = ["--pause-after", "2", "--lock-ttl-ms", "3000"]
    killed = with_seams(stream, seams, "dlq", "redrive", "--stream", stream.name, "--key", "a")
    try:
        _wait_paused(killed)
        [orphan] = [str(queue) for queue in stream.redis.hkeys(stream.keys.redrives)]
        wait_until(lambda: queue_depth(amqp, orphan) == 2, 10, "two letters in the redrive queue")
    finally:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
    # the killed run's connection is gone: every letter is back in place
    wait_until(lambda: queue_depth(amqp, queue) == 7, 10, "the letters handed back")
    keys = [row["key"] for row in _listing(stream.name, "--wait", "10")["letters"]]
    assert keys == ["a", "b", "a", None, "c", "b", "a"]
    done = keyq_json("dlq", "redrive", "--stream", stream.name, "--key", "a")
    assert done["orphans_deleted"] == [orphan] and queue_depth(amqp, orphan) is None
    copies = peek_all(amqp, done["queue"])
    assert [h[HEADER_REDRIVE_ID] for h, _b in copies] == ["p1:1", "p1:2", "p1:3"]
    assert [row["key"] for row in _listing(stream.name)["letters"]] == ["b", None, "c", "b"]
    assert list(stream.redis.hkeys(stream.keys.redrives)) == [done["queue"]]


def test_two_redrives_at_once_take_turns(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    _fill(stream, amqp)
    seams = ["--pause-after", "1", "--pause-s", "3"]
    first = with_seams(stream, seams, "dlq", "redrive", "--stream", stream.name, "--key", "a")
    try:
        _wait_paused(first)
        impatient = keyq("dlq", "redrive", "--stream", stream.name, "--key", "a", "--wait", "0.5")
        assert "in use by another keyq command" in one_line_error(impatient, 1)
        started = time.monotonic()
        second = keyq("dlq", "redrive", "--stream", stream.name, "--key", "a", "--wait", "30")
        waited = time.monotonic() - started
    finally:
        first.wait(timeout=60)
    assert first.returncode == 0, first.stderr.read() if first.stderr else ""
    assert waited > 1.0
    assert "no dead letters of key a" in one_line_error(second, 1)
    others = keyq("dlq", "redrive", "--stream", stream.name, "--key", "b", "--json")
    assert others.exit_code == 0 and orjson.loads(others.stdout)["letters"] == 2


def test_redrive_in_bucket_mode_wakes_the_bucket_queue(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    config = record_stream(stream, mode="bucket")
    dead_letter(amqp, stream.name, letters_for(stream.name, PLAN))
    done = keyq_json("dlq", "redrive", "--stream", stream.name, "--key", "b")
    assert done["woken"] == [config.queue_for("b")] and done["letters"] == 2
    assert queue_depth(amqp, config.queue_for("b")) == 0
    stream.track(config.queue_for("b"))
