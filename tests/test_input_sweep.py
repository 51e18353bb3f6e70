"""The bad-input sweep through a real worker in every mode: odd keys each on its own, payloads
no pipeline can read dead-lettered with their reason while the key goes on in order (and a
bystander key undisturbed), a vhost the user may not enter refused in one clear line."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from contextlib import suppress
from typing import Any
from urllib.parse import quote

import orjson
import pika
import pytest

from keyq import Producer
from keyq.broker.envelope import (
    HEADER_DEAD_QUEUE,
    HEADER_DEAD_REASON,
)
from keyq.broker.errors import AuthenticationFailed, InvalidEvent, KeyqError
from keyq.broker.naming import dead_letter_queue_name
from keyq.broker.registry import QueueRegistry
from keyq.broker.routes import RouteBook
from keyq.broker.settings import load_settings
from keyq.worker.batch.state_store import StateStore
from keyq.worker.daemon import Worker
from keyq.worker.spark.engine import SparkEngine
from tests.conftest import StreamFixture
from tests.helpers import drain, queue_depth
from tests.servers import PrivateRabbit
from tests.test_worker_poison import fast_settings, publish_raw, text
from tests.workers import run_keyq

pytestmark = pytest.mark.slow

ODD_KEYS = [
    "plain",
    "Plain",  # keys differ by case: two keys
    "ключ-λ",
    "账户/7",
    "🚚 truck",
    "tab\tkey",
    "new\nline",
    "nul\x00byte",
    "\x1b[31mred\x7f",
    " ",
    "../../etc/passwd",
    "*",
    "#",
    "%2F",
    "amq.gen-looks-like-a-server-name",
    "keyq.other-stream.k.plain",  # looks like another stream's queue
    "x" * 4096,  # the longest key allowed
    "é" * 2048,  # 4096 bytes of two-byte characters
]


def audit_state(applied: int) -> dict[str, Any]:
    return {"applied": applied, "last": {"p": applied}, "violations": []}


@pytest.fixture(params=["key", "bucket", "auto"])
def mode_producer(request: pytest.FixtureRequest, stream: StreamFixture) -> Iterator[Producer]:
    made = Producer(
        stream.name,
        mode=request.param,
        buckets=None if request.param == "key" else 4,
        settings=stream.settings,
        publish_timeout=10,
    )
    try:
        yield made
    finally:
        with suppress(KeyqError):
            made.close(timeout=5)


def test_odd_keys_each_on_its_own_and_bad_payloads_dead_lettered_while_the_key_goes_on(
    stream: StreamFixture,
    mode_producer: Producer,
    amqp: pika.BlockingConnection,
    spark_engine: SparkEngine,
) -> None:
    """One worker run per mode: keys of every kind, each applied on its own; bad payloads of
    one key dead-lettered with their reasons while it goes on in order beside a bystander."""
    keys = [*ODD_KEYS, f"keyq.{stream.name}.dlq"]  # the name of this stream's own DLQ
    for n in range(1, 4):
        for key in keys:
            mode_producer.publish(key, {"n": n, "producer": "p"})
    key, bystander = "order-1", "order-2"
    config = mode_producer.config
    queue = config.queue_for(key)
    # In auto mode every key is promoted at once: its bad payloads are forwarded to its own
    # queue and dead-lettered there; a keyless one stays in the bucket.
    keyed_queue = config.own_queue_for(key) if config.mode.value == "auto" else queue
    deep = b"[" * 5000 + b"]" * 5000
    bad: list[tuple[bytes, str | None, str]] = [
        (b'\xff\xfe{"n": 1}', key, "not UTF-8"),
        (b"this is not json {", key, "not JSON"),
        (b'{"n": 1, "truncated', key, "not JSON"),
        (deep, key, "not JSON"),  # nested deeper than any parser here will go
    ]
    if config.mode.hashes:  # a bucket (auto mode's too) holds many keys: this one has none
        bad.append((orjson.dumps({"n": 1, "producer": "p"}), None, "missing header"))
    huge = orjson.dumps({"pad": "x" * 900_000})  # well-formed and big: applied, not refused

    channel = amqp.channel()
    channel.confirm_delivery()
    number = 0
    for index, (body, header_key, _) in enumerate(bad):
        number += 1
        mode_producer.publish(key, {"n": number, "producer": "p"})
        mode_producer.publish(bystander, {"n": number, "producer": "p"})
        mode_producer.flush(30)  # the queue exists and the good event is ahead
        publish_raw(channel, queue, body, index + 1, key=header_key, message_id=f"bad-{index}")
    number += 1
    mode_producer.publish(key, {"n": number, "producer": "p", "huge": huge.decode()})
    number += 1
    mode_producer.publish(key, {"n": number, "producer": "p"})
    with pytest.raises(InvalidEvent, match="nested deeper"):
        nested: dict[str, Any] = {}
        inner = nested
        for _ in range(300):
            inner["a"] = {}
            inner = inner["a"]
        mode_producer.publish(key, nested)
    mode_producer.flush(30)

    # In auto mode every key seen is promoted at once: each moves to a queue of its own.
    worker = Worker(
        stream.name,
        "tests.pipelines:audit",
        settings=fast_settings(auto_promote_rate=0.001),
        engine=spark_engine,
    )
    worker.run(until_idle=3)

    store = StateStore(stream.redis, stream.name)
    states = {k: store.get(k) for k in keys}
    assert {k: state for k, state in states.items() if state != audit_state(3)} == {}
    assert store.get(key) == audit_state(number)
    assert store.get(bystander) == audit_state(len(bad))
    # No key merged into another, and the keyless payload landed on no key.
    assert stream.redis.hlen(stream.keys.state) == len(keys) + 2
    stats = worker.stats()
    assert stats["events"] == 3 * len(keys) + number + len(bad), stats
    assert stats["dead_lettered"] == len(bad), stats
    letters = drain(amqp.channel(), dead_letter_queue_name(stream.name))
    if keyed_queue != queue:  # dead-lettered by two holders: each in its own order
        letters.sort(key=lambda letter: str(letter.message_id))
    # Only the bad payloads: no odd key's event.
    assert [letter.message_id for letter in letters] == [f"bad-{i}" for i in range(len(bad))]
    for (body, header_key, words), letter in zip(bad, letters, strict=True):
        reason = text(letter.headers[HEADER_DEAD_REASON])
        assert words in reason, reason
        assert letter.body == body  # kept byte for byte for whoever repairs it
        dead_queue = queue if header_key is None else keyed_queue
        assert text(letter.headers[HEADER_DEAD_QUEUE]) == dead_queue
    assert queue_depth(amqp, queue) == 0
    assert queue_depth(amqp, keyed_queue) == 0
    if config.mode.value != "bucket":
        registry = QueueRegistry(stream.redis, stream.name)
        queues = {config.own_queue_for(k): k for k in keys}
        assert len(queues) == len(keys)  # one queue per key, none shared
        assert registry.original_keys(queues) == queues
    if config.mode.value == "auto":
        routes = RouteBook(stream.redis, stream.name).routes(keys)
        assert {k: route.queue for k, route in routes.items()} == {
            k: config.own_queue_for(k) for k in keys
        }
        # Every event with a key went to that key's own queue.
        keyed = 3 * len(keys) + number + len(bad) + sum(h is not None for _b, h, _w in bad)
        assert stats["forwarded"] == keyed, stats


@pytest.fixture
def locked_vhost(private_rabbit: PrivateRabbit) -> Iterator[str]:
    """A vhost on the tests' own node that exists but the test user has no permission on."""
    vhost = f"keyq-locked-{uuid.uuid4().hex[:8]}"
    private_rabbit.ctl("add_vhost", vhost)
    try:
        yield vhost
    finally:
        with suppress(subprocess.SubprocessError):
            private_rabbit.ctl("delete_vhost", vhost)


def test_a_vhost_without_permission_is_refused_in_one_clear_line(
    settings: Any, private_rabbit: PrivateRabbit, locked_vhost: str, stream: StreamFixture
) -> None:
    node = load_settings(amqp_url=private_rabbit.url, redis_url=settings.redis_url)
    base = node.amqp_url.rsplit("/", 1)[0]
    url = f"{base}/{quote(locked_vhost, safe='')}"
    password = pika.URLParameters(node.amqp_url).credentials.password
    with pytest.raises(AuthenticationFailed) as refused:
        Producer(stream.name, mode="key", amqp_url=url, settings=node)
    message = str(refused.value)
    assert "virtual host" in message or "access" in message, message
    assert f":{password}@" not in message

    locked = load_settings(amqp_url=url, redis_url=settings.redis_url)
    for command in (
        ("worker", "--stream", stream.name, "--pipeline", "tests.pipelines:audit"),
        ("janitor", "--stream", stream.name, "--once"),
    ):
        done = run_keyq(locked, *command, timeout=120)
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert any("access" in line or "virtual host" in line for line in lines), done.stderr
        assert f":{password}@" not in done.stdout + done.stderr

    # The refused clients disturbed nothing: the same stream works on the right vhost.
    with Producer(stream.name, mode="key", settings=node) as producer:
        producer.publish("after", {"n": 1, "producer": "p"})
        producer.flush(30)
