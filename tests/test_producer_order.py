"""What a producer publishes lands, durably and in per-key order, in the key's queue (bucket
mode: tests/test_packed_publishing.py)."""

from __future__ import annotations

import random
import threading
from collections import defaultdict

import pika

from keyq import Producer
from keyq.broker.envelope import HEADER_PUBLISHED_AT, HEADER_STREAM
from keyq.broker.naming import key_queue_name
from tests.conftest import StreamFixture
from tests.helpers import Landed, as_applied, drain, sent_again


def _check_order(landed: list[Landed], published: dict[str, list[int]]) -> None:
    by_key: dict[str, list[int]] = defaultdict(list)
    for message in landed:
        by_key[message.key].append(message.json()["n"])
    assert by_key == published


def _seq(message: Landed) -> int:
    return message.seq


def test_key_mode_order_envelope_and_bytes_events(
    stream: StreamFixture, producer: Producer, amqp: pika.BlockingConnection
) -> None:
    keys = [f"order-{i}" for i in range(20)] + ["ünïcode key", "x" * 300]
    rng = random.Random(7)
    published: dict[str, list[int]] = defaultdict(list)
    for n in range(3000):
        key = rng.choice(keys)
        receipt = producer.publish(key, {"n": n}, headers={"trace": f"t{n}"})
        assert receipt.queue == key_queue_name(stream.name, key)
        assert receipt.seq == len(published[key]) + 1
        published[key].append(n)
    producer.publish("bytes", b"\x00\xffraw")
    producer.publish("bytes", bytearray(b'{"a": 1}'))
    producer.flush(30)
    assert producer.unconfirmed == 0
    producer_id = producer.producer_id
    channel = amqp.channel()
    landed: list[Landed] = []
    copies = 0
    for key in keys:
        messages, again = as_applied(drain(channel, key_queue_name(stream.name, key)), _seq)
        assert [m.seq for m in messages] == list(range(1, len(published[key]) + 1))
        assert all(m.key == key and m.producer == producer_id for m in messages)
        landed.extend(messages)
        copies += again
    _check_order(landed, published)
    assert copies <= sent_again(producer.stats), f"{copies} copies, {producer.stats}"
    sample = landed[0]
    assert sample.content_type == "application/json"
    assert sample.headers[HEADER_STREAM] == stream.name
    assert sample.headers["trace"] == f"t{sample.json()['n']}"
    assert isinstance(sample.headers[HEADER_PUBLISHED_AT], int)
    assert sample.message_id and sample.message_id.startswith(producer_id + ":")
    # Every queue is registered with its original key, for workers and the janitor.
    registered = stream.redis.hgetall(stream.keys.queue_keys)
    assert {registered[key_queue_name(stream.name, key)] for key in keys} == set(keys)
    raw = drain(channel, key_queue_name(stream.name, "bytes"))  # bytes events travel as is
    assert [m.body for m in raw] == [b"\x00\xffraw", b'{"a": 1}']
    assert raw[0].content_type == "application/octet-stream"


def test_many_threads_keep_each_keys_order(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    published: dict[str, list[int]] = defaultdict(list)
    lock = threading.Lock()
    with Producer(stream.name, settings=stream.settings, confirm_window=64) as producer:

        def run(thread: int) -> None:
            for n in range(800):
                key = f"shared-{n % 5}"
                with lock:  # defines the order the test expects for the shared keys
                    producer.publish(key, {"n": n, "t": thread})
                    published[key].append(n * 10 + thread)

        threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = dict(producer.stats)
    channel = amqp.channel()
    copies = 0
    for key, expected in published.items():
        messages, again = as_applied(drain(channel, key_queue_name(stream.name, key)), _seq)
        assert [m.json()["n"] * 10 + m.json()["t"] for m in messages] == expected
        assert [m.seq for m in messages] == list(range(1, len(expected) + 1))
        copies += again
    assert copies <= sent_again(stats), f"{copies} copies, {stats}"
