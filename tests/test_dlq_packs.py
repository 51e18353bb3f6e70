"""``keyq dlq`` on packs RabbitMQ dead-lettered whole (rejected, with ``x-death``): each event is a
letter of its own; a drop or redrive takes the pack whole or is refused."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import pika
import pytest

from keyq import Producer
from keyq.broker.clock import now_ms
from keyq.broker.envelope import (
    HEADER_KEY,
    HEADER_PRODUCER,
    HEADER_PUBLISHED_AT,
    HEADER_REDRIVE_ID,
    HEADER_SEQ,
    HEADER_STREAM,
)
from keyq.broker.naming import dead_letter_queue_name, key_queue_name
from keyq.broker.packs import HEADER_PACK, MAGIC, PACK_CONTENT_TYPE, encode_pack, encode_record
from keyq.broker.topology import dead_letter_queue_arguments
from keyq.worker.batch.state_store import StateStore
from tests.conftest import StreamFixture
from tests.helpers import queue_depth
from tests.operator_helpers import keyq, keyq_json, one_line_error, peek_all
from tests.workers import wait_until

KEY = "acct-1"
CONTENT_JSON = "application/json"


class DeadPack:
    """Key ``KEY``'s queue, declared by the SDK's producer (which publishes seq 1), and packs
    of that producer's events put in it and dead-lettered by the broker."""

    def __init__(
        self, stream: StreamFixture, amqp: pika.BlockingConnection, producer: Producer
    ) -> None:
        self.stream = stream.name
        self.amqp = amqp
        self.queue = key_queue_name(stream.name, KEY)
        self.dlq = dead_letter_queue_name(stream.name)
        producer.publish(KEY, {"n": 1, "producer": "pk"})
        producer.flush(timeout=30)
        self.producer_id = producer.producer_id
        self.channel = amqp.channel()
        # the producer declares it too (on connecting); the broker drops what it cannot route
        self.channel.queue_declare(self.dlq, durable=True, arguments=dead_letter_queue_arguments())
        self.channel.confirm_delivery()
        self._number = 100

    def event(self, seq: int) -> bytes:
        """Event ``seq``'s record, with the headers ``Producer._accept`` gives an event."""
        self._number += 1
        headers = {
            "trace": f"t-{seq}",
            HEADER_STREAM: self.stream,
            HEADER_KEY: KEY,
            HEADER_PRODUCER: self.producer_id,
            HEADER_SEQ: seq,
            HEADER_PUBLISHED_AT: now_ms(),
        }
        body = orjson.dumps({"n": seq, "producer": "pk"})
        return encode_record(f"{self.producer_id}:{self._number}", CONTENT_JSON, headers, body)

    def publish_pack(self, body: bytes, count: int) -> str:
        """A message labelled as a pack of ``count`` events, as the producer sends one."""
        message_id = f"pack:{self.producer_id}:{uuid.uuid4().hex[:6]}"
        headers = {
            HEADER_STREAM: self.stream,
            HEADER_PRODUCER: self.producer_id,
            HEADER_PACK: count,
            HEADER_PUBLISHED_AT: now_ms(),
            HEADER_KEY: KEY,
        }
        properties = pika.BasicProperties(
            delivery_mode=pika.DeliveryMode.Persistent,
            content_type=PACK_CONTENT_TYPE,
            message_id=message_id,
            headers=headers,
        )
        self.channel.basic_publish("", self.queue, body, properties, mandatory=True)
        return message_id

    def pack(self, seqs: list[int]) -> str:
        return self.publish_pack(encode_pack([self.event(seq) for seq in seqs]), len(seqs))

    def reject_all(self) -> None:
        """Take every message of the key's queue and reject it: the broker dead-letters it."""
        waiting = queue_depth(self.amqp, self.queue) or 0
        in_dlq = queue_depth(self.amqp, self.dlq) or 0
        channel = self.amqp.channel()
        for _ in range(waiting):
            method, _properties, _body = channel.basic_get(self.queue, auto_ack=False)
            assert method is not None
            channel.basic_reject(method.delivery_tag, requeue=False)
        channel.close()
        wait_until(
            lambda: queue_depth(self.amqp, self.dlq) == in_dlq + waiting, 10, "dead-lettered"
        )
        # RabbitMQ dead-lettered them, past keyq's code: the index learns of them by a walk.
        reindexed = keyq("dlq", "reindex", "--stream", self.stream)
        assert reindexed.exit_code == 0, reindexed.stderr


def _listing(stream: str) -> dict[str, Any]:
    return keyq_json("dlq", "list", "--stream", stream)


def _ids(stream: str) -> list[str]:
    return [row["id"] for row in _listing(stream)["letters"]]


def _messages(amqp: pika.BlockingConnection, queue: str) -> list[tuple[Any, ...]]:
    """(pack count or None, seq or None) of each message of ``queue``, in order."""
    return [(h.get(HEADER_PACK), h.get(HEADER_SEQ)) for h, _body in peek_all(amqp, queue)]


def test_a_pack_dead_lettered_whole_is_listed_and_shown_as_its_events_and_redriven_apart(
    stream: StreamFixture, amqp: pika.BlockingConnection, producer: Producer
) -> None:
    """A malformed pack beside it stays one foreign letter. No worker: the redrive queue is
    looked at as it is."""
    dead = DeadPack(stream, amqp, producer)
    pack_id = dead.pack([2, 3, 4])
    broken = MAGIC + dead.event(5)[:-3]  # cut short
    dead.publish_pack(broken, 1)
    dead.reject_all()  # the single event 1, the pack, then the malformed one
    p = dead.producer_id
    listing = _listing(stream.name)
    assert listing["ready"] == 3
    *rows, letter = listing["letters"]
    assert [row["id"] for row in rows] == [f"{p}:1", f"{p}:2", f"{p}:3", f"{p}:4"]
    assert [row["pack"] for row in rows] == [None] + [
        {"message_id": pack_id, "events": 3, "part": part} for part in (1, 2, 3)
    ]
    for row, seq in zip(rows, (1, 2, 3, 4), strict=True):
        assert (row["key"], row["seq"], row["producer"]) == (KEY, seq, p)
        assert not row["foreign"] and row["content_type"] == CONTENT_JSON
        assert orjson.loads(row["preview"]) == {"n": seq, "producer": "pk"}
        assert row["reason"] == "rejected" and row["dead_queue"] == dead.queue
        assert row["dead_at_ms"] is not None and row["published_at_ms"] is not None
    assert [row["position"] for row in rows] == [0, 1, 2, 3]
    text = keyq("dlq", "list", "--stream", stream.name)
    assert text.exit_code == 0, text.stderr
    assert "3 messages; the index lists 5 letters" in text.stdout
    assert f"2 pack 2/3\t{p}:3\t{KEY}" in text.stdout

    detail = keyq_json("dlq", "show", "--stream", stream.name, "--id", f"{p}:3")
    assert orjson.loads(detail["payload"]) == {"n": 3, "producer": "pk"}
    assert detail["headers"]["trace"] == "t-3" and HEADER_PACK not in detail["headers"]
    assert detail["pack"]["message_id"] == pack_id and detail["pack"]["events"] == 3
    assert detail["pack"]["headers"][HEADER_PACK] == 3
    assert detail["pack"]["headers"]["x-death"][0]["reason"] == "rejected"
    assert _messages(amqp, dead.dlq) == [(None, 1), (3, None), (1, None)], "looking changed nothing"

    assert letter["foreign"] and letter["id"].startswith("sha256:") and letter["pack"] is None
    assert letter["content_type"] == PACK_CONTENT_TYPE and letter["bytes"] == len(broken)
    assert letter["reason"] == "rejected"
    dropped = keyq("dlq", "drop", "--stream", stream.name, "--id", letter["id"], "--yes")
    assert dropped.exit_code == 0, dropped.stderr
    assert _messages(amqp, dead.dlq) == [(None, 1), (3, None)]

    # each event of a redriven pack is a message of its own
    done = keyq_json("dlq", "redrive", "--stream", stream.name, "--key", KEY)
    copies = peek_all(amqp, done["queue"])
    assert [h[HEADER_REDRIVE_ID] for h, _b in copies] == [f"{p}:{seq}" for seq in (1, 2, 3, 4)]
    assert [orjson.loads(b)["n"] for _h, b in copies] == [1, 2, 3, 4]
    for headers, _body in copies[1:]:
        assert HEADER_PACK not in headers and "x-death" not in headers
        assert headers["trace"] in ("t-2", "t-3", "t-4") and headers[HEADER_KEY] == KEY
    assert queue_depth(amqp, dead.dlq) == 0


def test_a_partial_drop_is_refused_and_a_whole_one_removes_the_pack(
    stream: StreamFixture, amqp: pika.BlockingConnection, producer: Producer
) -> None:
    dead = DeadPack(stream, amqp, producer)
    pack_id = dead.pack([2, 3, 4])
    dead.pack([5, 6])
    dead.reject_all()
    p = dead.producer_id
    before = _ids(stream.name)
    assert before == [f"{p}:{seq}" for seq in range(1, 7)]
    name = stream.name
    refused = keyq("dlq", "drop", "--stream", name, "--id", f"{p}:3", "--id", f"{p}:1", "--yes")
    assert one_line_error(refused, 2) == (
        f"keyq: pack {pack_id} in {dead.dlq} holds 3 letters and is removed only whole, "
        f"but {p}:2, {p}:4 of it are not selected: select them all (--key {KEY} selects all "
        "of them)"
    )
    assert _ids(name) == before
    assert _messages(amqp, dead.dlq) == [(None, 1), (3, None), (2, None)]
    # a redrive of part of it is refused alike, before anything is put back
    partial = keyq("dlq", "redrive", "--stream", name, "--id", f"{p}:4", "--key", KEY)
    assert f"but {p}:2, {p}:3 of it are not selected" in one_line_error(partial, 2)
    assert stream.redis.hlen(stream.keys.redrives) == 0
    assert _ids(name) == before

    ids = ("--id", f"{p}:2", "--id", f"{p}:3", "--id", f"{p}:4")
    assert keyq_json("dlq", "drop", "--stream", name, *ids, "--yes")["dropped"] == 3
    assert _messages(amqp, dead.dlq) == [(None, 1), (2, None)]
    assert _ids(name) == [f"{p}:1", f"{p}:5", f"{p}:6"]
    by_key = keyq("dlq", "drop", "--stream", name, "--key", KEY, "--yes")
    assert by_key.exit_code == 0, by_key.stderr
    assert queue_depth(amqp, dead.dlq) == 0


@pytest.mark.slow
def test_redriving_a_whole_pack_applies_each_event_once_in_order(
    stream: StreamFixture, amqp: pika.BlockingConnection, workers: Any, producer: Producer
) -> None:
    dead = DeadPack(stream, amqp, producer)
    dead.pack([2, 3, 4])
    dead.pack([5, 6, 7, 8])
    dead.reject_all()  # nothing applied: event 1 and both packs are dead letters
    worker = workers(stream.name, pipeline="tests.pipelines:ledger", mode="key")
    worker.wait_ready()
    store = StateStore(stream.redis, stream.name)
    assert store.get(KEY) is None

    done = keyq_json("dlq", "redrive", "--stream", stream.name, "--key", KEY)
    p = dead.producer_id
    assert done["letters"] == 8 and done["ids"] == [f"{p}:{seq}" for seq in range(1, 9)]
    assert queue_depth(amqp, dead.dlq) == 0
    wait_until(
        lambda: (store.get(KEY) or {}).get("seen") == {"pk": list(range(1, 9))},
        60,
        "every event applied once, in order",
    )
    wait_until(
        lambda: queue_depth(amqp, done["queue"]) in (0, None), 30, "the redrive queue drained"
    )
    marks = store.get_marks(KEY)
    assert sorted(marks.redriven) == sorted(done["ids"]), marks
    assert store.get(KEY) == {"seen": {"pk": list(range(1, 9))}}  # nothing applied twice
    assert queue_depth(amqp, dead.dlq) == 0
    assert worker.terminate() == 0, worker.log()[-3000:]
