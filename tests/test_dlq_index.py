"""The dead-letter index and bulk redrive on a real RabbitMQ and Redis: list/show read the index,
``reindex`` repairs it, ``drop`` asks before locking, bulk redrives apply each key once in order."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import orjson
import pika
import pytest
from click.testing import CliRunner

from keyq import Producer
from keyq.broker.key_control import KeyControl
from keyq.broker.naming import dead_letter_queue_name
from keyq.cli.root import cli
from keyq.worker.batch.state_store import StateStore
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
    with_seams,
)
from tests.workers import run_keyq, wait_until


def settled_ids(amqp: pika.BlockingConnection, queue: str, count: int) -> list[str]:
    """The queue's letter ids once all ``count`` are back (a closed walk hands them back late)."""
    wait_until(lambda: queue_depth(amqp, queue) == count, 30, f"{count} letters in {queue}")
    return ids_in(amqp, queue)


def _index_keys(stream: StreamFixture) -> list[str]:
    return [str(key) for key in stream.redis.scan_iter(f"{stream.keys.dead_letter_index_prefix}*")]


def _fill(stream: StreamFixture, amqp: pika.BlockingConnection, keys: int, each: int) -> str:
    """``keys`` keys with ``each`` letters each, the keys' letters interleaved; the even keys'
    reason is a timeout, the odd keys' a parse error."""
    record_stream(stream)
    for parity, reason in ((0, "timeout talking to the ledger"), (1, "parse error: bad json")):
        plan = [(f"k{n}", seq) for seq in range(1, each + 1) for n in range(parity, keys, 2)]
        dead_letter(amqp, stream.name, letters_for(stream.name, plan), reason=reason)
    return dead_letter_queue_name(stream.name)


def test_a_listing_reads_the_index_with_the_queue_held_and_locked(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    queue = _fill(stream, amqp, keys=40, each=5)  # 200 letters
    before = ids_in(amqp, queue)
    # Another command holds the dead-letter lock, and a consumer holds every letter unacked:
    # a walk could neither start nor see a single letter. The index answers at once.
    stream.redis.set(stream.keys.redrive_lock, "someone-else", px=60_000)
    holder = amqp.channel()
    holder.basic_qos(prefetch_count=1000)
    holder.basic_consume(queue, lambda *_args: None, auto_ack=False)
    wait_until(lambda: queue_depth(amqp, queue) == 0, 10, "every letter held by the consumer")
    try:
        started = time.monotonic()
        listing = keyq_json("dlq", "list", "--stream", stream.name, "--limit", "20")
        assert time.monotonic() - started < 1.0
    finally:
        holder.close()
    assert len(listing["letters"]) == 20 and listing["matched"] == 200
    assert listing["indexed"] == {"letters": 200, "messages": 200, "in_step": False}
    assert listing["ready"] == 0  # all held: the listing did not take one
    first = listing["letters"][:3]
    assert [(row["key"], row["seq"]) for row in first] == [("k0", 1), ("k2", 1), ("k4", 1)]
    assert settled_ids(amqp, queue, len(before)) == before  # nothing consumed, nothing moved

    of_key = keyq_json("dlq", "list", "--stream", stream.name, "--key", "k7", "--limit", "3")
    assert [(row["key"], row["seq"]) for row in of_key["letters"]] == [("k7", s) for s in (1, 2, 3)]
    assert of_key["matched"] == 5
    parse = keyq_json("dlq", "list", "--stream", stream.name, "--reason", "parse error")
    assert parse["matched"] == 100 and len(parse["letters"]) == 100
    assert {row["key"] for row in parse["letters"]} == {f"k{n}" for n in range(1, 40, 2)}
    both = keyq_json("dlq", "list", "--stream", stream.name, "--reason", "timeout", "--key", "k7")
    assert both["matched"] == 0 and both["letters"] == []
    shown = keyq_json("dlq", "show", "--stream", stream.name, "--id", "p1:4", "--key", "k8")
    assert shown["key"] == "k8" and shown["seq"] == 4 and shown["reason"].startswith("timeout")
    assert orjson.loads(shown["payload"]) == {"k": "k8", "s": 4}
    ambiguous = keyq("dlq", "show", "--stream", stream.name, "--id", "p1:4")
    assert "names letters of 40 keys" in one_line_error(ambiguous, 2)
    stream.redis.delete(stream.keys.redrive_lock)


def test_reindex_repairs_an_index_emptied_by_hand(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    queue = _fill(stream, amqp, keys=6, each=3)
    # two letters RabbitMQ would have dead-lettered by itself: never indexed
    dead_letter(amqp, stream.name, letters_for(stream.name, [("k9", 1), ("k9", 2)]), indexed=False)
    before = ids_in(amqp, queue)
    stream.redis.delete(*_index_keys(stream))
    emptied = keyq_json("dlq", "list", "--stream", stream.name)
    assert emptied["letters"] == [] and emptied["ready"] == 20
    assert emptied["indexed"]["in_step"] is False
    text = keyq("dlq", "list", "--stream", stream.name)
    assert "the queue holds 20 messages but the index 0" in text.stdout
    assert f"keyq dlq reindex --stream {stream.name}" in text.stdout

    report = keyq_json("dlq", "reindex", "--stream", stream.name)
    assert report["letters_met"] == 20 and report["indexed"] == {"letters": 20, "messages": 20}
    listing = keyq_json("dlq", "list", "--stream", stream.name)
    assert listing["indexed"]["in_step"] is True and listing["matched"] == 20
    assert [f"{row['producer']}:{row['seq']}" for row in listing["letters"]] == before
    assert keyq_json("dlq", "list", "--stream", stream.name, "--key", "k9")["matched"] == 2
    assert settled_ids(amqp, queue, len(before)) == before  # every letter in its place

    # an entry whose letter is gone (moved by hand) goes at the next walk
    channel = amqp.channel()
    method, _properties, _body = channel.basic_get(queue, auto_ack=True)
    assert method is not None
    channel.close()
    assert keyq_json("dlq", "list", "--stream", stream.name)["matched"] == 20
    again = keyq_json("dlq", "reindex", "--stream", stream.name)
    assert again["indexed"] == {"letters": 19, "messages": 19}


def test_drop_asks_before_it_takes_the_lock(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    queue = _fill(stream, amqp, keys=2, each=3)
    before = ids_in(amqp, queue)
    stream.redis.set(stream.keys.redrive_lock, "someone-else", px=60_000)
    try:
        started = time.monotonic()
        drop = ["dlq", "drop", "--stream", stream.name, "--key", "k1", "--wait", "20"]
        declined = CliRunner().invoke(cli, drop, input="n\n", catch_exceptions=False)
        # Asked at once, from the index, though another command holds the queue for 60 s.
        assert time.monotonic() - started < 5
    finally:
        stream.redis.delete(stream.keys.redrive_lock)
    assert declined.exit_code == 1
    assert "3 letters of" in declined.stderr and "drop them?" in declined.stderr
    assert "p1:2  key k1  parse error: bad json" in declined.stderr
    assert declined.stderr.rstrip().endswith("keyq: not confirmed: nothing dropped")
    assert ids_in(amqp, queue) == before

    dropped = CliRunner().invoke(cli, drop[:-2], input="y\n", catch_exceptions=False)
    assert dropped.exit_code == 0, dropped.stderr
    assert settled_ids(amqp, queue, 3) == ["p1:1", "p1:2", "p1:3"]
    listing = keyq_json("dlq", "list", "--stream", stream.name)
    assert {row["key"] for row in listing["letters"]} == {"k0"}
    assert listing["indexed"] == {"letters": 3, "messages": 3, "in_step": True}


EVENTS = 12


def _seen(store: StateStore, key: str, producer: Producer) -> list[int]:
    state = store.get(key) or {"seen": {}}
    return list(state["seen"].get(producer.producer_id, []))


def _bulk(stream: StreamFixture, *args: str) -> dict[str, Any]:
    done = run_keyq(stream.settings, "dlq", "redrive", "--stream", stream.name, *args, "--json")
    assert done.returncode == 0, done.stderr + done.stdout
    return dict(orjson.loads(done.stdout))


@pytest.mark.slow
def test_the_worker_indexes_and_bulk_redrives_apply_each_key_once_in_order(
    stream: StreamFixture, workers: Any, amqp: Any, tmp_path: Path, producer: Producer
) -> None:
    fixed = tmp_path / "pipeline-fixed"
    poison_at = {"a0": 3, "a1": 3, "a2": 3, "b0": 4, "b1": 4, "c0": 5, "c1": 5, "c2": 5}
    worker = workers(
        stream.name,
        pipeline="tests.pipelines:ledger_until_fixed",
        mode="key",
        env={"KEYQ_TEST_FIXED_MARKER": str(fixed), "KEYQ_MAX_ATTEMPTS": "2"},
    )
    worker.wait_ready()
    done = run_keyq(
        stream.settings, "stream", "set", "--stream", stream.name, "--poison-policy", "park"
    )
    assert done.returncode == 0, done.stderr
    store = StateStore(stream.redis, stream.name)
    control = KeyControl(stream.redis, stream.name)
    queue = dead_letter_queue_name(stream.name)
    everything = list(range(1, EVENTS + 1))
    for n in everything:
        for key, poison in poison_at.items():
            event: dict[str, Any] = {"n": n, "producer": producer.producer_id}
            if n == poison:
                event["poison"] = True
            producer.publish(key, event)
    producer.flush(timeout=30)
    wait_until(lambda: len(control.parked()) == 8, 120, "every key parked")
    wait_until(lambda: queue_depth(amqp, queue) == 8, 30, "eight dead letters")

    # The worker indexed each letter as it dead-lettered it.
    listing = keyq_json("dlq", "list", "--stream", stream.name)
    assert listing["indexed"] == {"letters": 8, "messages": 8, "in_step": True}
    by_key = {row["key"]: row for row in listing["letters"]}
    assert set(by_key) == set(poison_at)
    for key, poison in poison_at.items():
        row = by_key[key]
        assert (row["producer"], row["seq"]) == (producer.producer_id, poison)
        assert f"planted poison event {poison}" in row["reason"]
        assert row["dead_queue"] and row["dead_at_ms"]
    fourth = keyq_json("dlq", "list", "--stream", stream.name, "--reason", "poison event 4")
    assert sorted(row["key"] for row in fourth["letters"]) == ["b0", "b1"]

    fixed.touch()
    by_reason = _bulk(stream, "--reason", "poison event 3")
    assert sorted(done["key"] for done in by_reason["redriven"]) == ["a0", "a1", "a2"]
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("b0\n\nb1\nnobody\n")
    by_file = _bulk(stream, "--keys-file", str(keys_file))
    assert sorted(done["key"] for done in by_file["redriven"]) == ["b0", "b1"]
    assert by_file["without_letters"] == ["nobody"]
    for key in ("a0", "a1", "a2", "b0", "b1"):
        wait_until(lambda k=key: _seen(store, k, producer) == everything, 60, key)
    assert set(control.parked()) == {"c0", "c1", "c2"}

    # --all killed -9 half way, one key a chunk: the first key put back and unparked, the
    # second's letter published but not put back, the third not touched; nothing acked.
    # Run again, every key applies each event once, in order.
    seams = ["--pause-after", "2", "--chunk-keys", "1", "--lock-ttl-ms", "3000"]
    killed = with_seams(stream, seams, "dlq", "redrive", "--stream", stream.name, "--all")
    try:
        assert killed.stderr is not None
        line = killed.stderr.readline()
        assert line.startswith("paused after 2"), line + killed.stderr.read()
        [first] = {"c0", "c1", "c2"} - set(control.parked())
    finally:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
    wait_until(lambda: queue_depth(amqp, queue) == 3, 10, "the letters handed back")
    wait_until(lambda: _seen(store, first, producer) == everything, 60, "after the kill")
    again = _bulk(stream, "--all")
    assert sorted(done["key"] for done in again["redriven"]) == ["c0", "c1", "c2"]
    assert len(again["orphans_deleted"]) >= 1
    for key in poison_at:
        wait_until(lambda k=key: _seen(store, k, producer) == everything, 60, key)
    time.sleep(1.0)  # a copy applied twice would show by now
    for key in poison_at:
        assert _seen(store, key, producer) == everything, key
    assert queue_depth(amqp, queue) == 0 and not control.parked()
    final = keyq_json("dlq", "list", "--stream", stream.name)
    assert final["letters"] == [] and final["indexed"]["in_step"] is True
    assert worker.terminate() == 0, worker.log()[-3000:]
