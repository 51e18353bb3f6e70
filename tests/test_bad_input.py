"""Bad input gets a clear error, and nothing is sent or disturbed.

Every refusal must be the right class from ``keyq.broker.errors`` (also a ``ValueError`` where the
class derives from it), with a message a person can act on, raised before anything reaches
RabbitMQ or Redis. After each refusal the same producer keeps publishing, and the queue holds
exactly the good events, with no gap in their per-key sequence numbers.
"""

from __future__ import annotations

import math
import threading
import traceback
import uuid
from collections.abc import Iterator
from contextlib import suppress
from types import MappingProxyType
from typing import Any

import orjson
import pika
import pytest

from keyq import Producer
from keyq.broker.envelope import CONTENT_BYTES, CONTENT_JSON, HEADER_KEY
from keyq.broker.errors import (
    ConfigurationError,
    InvalidEvent,
    InvalidHeaders,
    InvalidInput,
    InvalidKey,
    InvalidStreamName,
    KeyqError,
    MessageTooLarge,
    StreamConfigMismatch,
)
from keyq.broker.naming import MAX_KEY_BYTES, dead_letter_queue_name, key_queue_name
from keyq.broker.settings import load_settings
from keyq.producer.producer import HEADER_ALLOWANCE
from tests.conftest import StreamFixture
from tests.helpers import Landed, drain, queue_depth

GOOD_KEY = "good-key"
SMALL_LIMIT = 2048


# --------------------------------------------------------------------------- helpers
@pytest.fixture
def producer(stream: StreamFixture) -> Iterator[Producer]:
    """A key-mode producer whose waits are short, so a broken one fails fast."""
    made = Producer(stream.name, mode="key", settings=stream.settings, publish_timeout=5)
    try:
        yield made
    finally:
        with suppress(KeyqError):
            made.close(timeout=2)


def _deep(levels: int) -> dict[str, Any]:
    """A dict with ``levels`` dicts nested inside it."""
    event: dict[str, Any] = {"leaf": 1}
    for _ in range(levels):
        event = {"a": event}
    return event


def _producer_threads() -> set[int]:
    return {
        thread.ident or 0
        for thread in threading.enumerate()
        if thread.name.startswith("keyq-producer")
    }


def _check_refusal(exc: BaseException, cls: type[KeyqError], *words: str) -> None:
    """The error is exactly the keyq class asked for, a ValueError when that class is one,
    and its message says what was wrong in words a person can act on."""
    assert isinstance(exc, cls), f"{type(exc).__name__} is not a {cls.__name__}: {exc}"
    assert isinstance(exc, KeyqError)
    if issubclass(cls, ValueError):
        assert isinstance(exc, ValueError)
    text = str(exc)
    assert len(text) > 10, f"message too terse to act on: {text!r}"
    for word in words:
        assert word.lower() in text.lower(), f"{word!r} not in the message {text!r}"


def _settled(producer: Producer) -> None:
    producer.flush(timeout=5)
    assert producer.stats["unconfirmed"] == 0
    assert producer.stats["returned"] == 0


def _landed_only(
    amqp: pika.BlockingConnection, stream: StreamFixture, key: str, bodies: list[bytes]
) -> list[Landed]:
    """The key's queue holds exactly ``bodies``, in order, with seqs 1..n and nothing else
    of the stream was created besides that queue (and the dead-letter queue, left empty)."""
    queue = key_queue_name(stream.name, key)
    landed = drain(amqp.channel(), queue)
    assert [m.body for m in landed] == bodies
    assert [m.seq for m in landed] == list(range(1, len(bodies) + 1))
    assert all(m.key == key for m in landed)
    assert set(stream.redis.zrange(stream.keys.registry, 0, -1)) == {queue}
    assert queue_depth(amqp, dead_letter_queue_name(stream.name)) in (0, None)
    return landed


def _still_works(
    producer: Producer,
    amqp: pika.BlockingConnection,
    stream: StreamFixture,
    refused: list[BaseException],
) -> None:
    """Publish one more good event after the refusal and check only good events landed."""
    assert refused, "the bad call was not refused"
    producer.publish(GOOD_KEY, {"n": 2})
    _settled(producer)
    _landed_only(amqp, stream, GOOD_KEY, [b'{"n":1}', b'{"n":2}'])


# ------------------------------------------------------------------------------ keys
BAD_KEYS = [
    pytest.param("", ("empty",), id="empty"),
    pytest.param(None, ("str", "NoneType"), id="none"),
    pytest.param(42, ("str", "int"), id="int"),
    pytest.param(b"bytes-key", ("str", "bytes"), id="bytes"),
    pytest.param(["k"], ("str", "list"), id="list"),
    pytest.param("k" * (MAX_KEY_BYTES + 1), (str(MAX_KEY_BYTES),), id="ascii-over-4096-bytes"),
    # 2049 characters but 4098 bytes: the limit is on UTF-8 bytes, not characters.
    pytest.param("é" * 2049, (str(MAX_KEY_BYTES), "bytes"), id="utf8-over-4096-bytes"),
    pytest.param("ab\ud800cd", ("surrogate",), id="lone-surrogate"),
]


@pytest.mark.parametrize(("key", "words"), BAD_KEYS)
def test_bad_key_is_refused_and_nothing_is_sent(
    producer: Producer,
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    key: object,
    words: tuple[str, ...],
) -> None:
    producer.publish(GOOD_KEY, {"n": 1})
    refused: list[BaseException] = []
    with pytest.raises(InvalidKey) as info:
        producer.publish(key, {"n": -1})  # type: ignore[arg-type]
    refused.append(info.value)
    _check_refusal(info.value, InvalidKey, "key", *words)
    _still_works(producer, amqp, stream, refused)


ODD_KEYS = [
    "tab\there",
    "new\nline\r",
    "bell\x07esc\x1b\x7f",
    "nul\x00inside",
    "\x00",
    "ключ",
    "鍵",
    "🔑 key",
    "dlq",
    "amq.gen-x",
    "amq.direct",
    "../x",
    "..",
    "a/b\\c",
    "*",
    "#.#",
    " spaced ",
    "k" * MAX_KEY_BYTES,
    "é" * (MAX_KEY_BYTES // 2),
    "dup",
    "DUP",
]


def test_odd_keys_land_in_their_own_queue_with_the_original_key(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    other_stream = f"t-{uuid.uuid4().hex[:12]}"
    lookalike = f"keyq.{other_stream}.k.x"  # exactly the name of another stream's queue
    own_dlq = dead_letter_queue_name(stream.name)
    keys = [*ODD_KEYS, lookalike, own_dlq, key_queue_name(stream.name, "dlq")]
    with Producer(stream.name, mode="key", settings=stream.settings, publish_timeout=5) as p:
        for round_ in range(2):
            for i, key in enumerate(keys):
                receipt = p.publish(key, {"i": i, "round": round_})
                assert receipt.key == key
                assert receipt.seq == round_ + 1
        _settled(p)
    queues = {key: key_queue_name(stream.name, key) for key in keys}
    assert len(set(queues.values())) == len(keys), "two keys share a queue"
    prefix = f"keyq.{stream.name}."
    for queue in queues.values():
        assert queue.startswith(prefix), queue
        assert queue != own_dlq
        assert len(queue.encode()) <= 255
    channel = amqp.channel()
    for i, key in enumerate(keys):
        landed = drain(channel, queues[key])
        assert [m.json() for m in landed] == [{"i": i, "round": 0}, {"i": i, "round": 1}], key
        assert [m.seq for m in landed] == [1, 2]
        assert all(m.key == key and m.headers[HEADER_KEY] == key for m in landed), repr(key)
    # Nothing went to queues named after the raw keys, nor to the other stream's queue.
    for raw in ("dlq", lookalike, key_queue_name(other_stream, "x")):
        assert queue_depth(amqp, raw) is None, raw
    assert queue_depth(amqp, own_dlq) in (0, None)
    # The registry keeps the original key of every queue, control characters included.
    assert stream.redis.hgetall(stream.keys.queue_keys) == {queues[k]: k for k in keys}


# ---------------------------------------------------------------------------- events
BAD_EVENT_TYPES = [
    pytest.param([], "list", id="empty-list"),
    pytest.param([{"a": 1}], "list", id="list"),
    pytest.param("text", "str", id="str"),
    pytest.param('{"a": 1}', "str", id="json-str"),
    pytest.param(7, "int", id="int"),
    pytest.param(1.5, "float", id="float"),
    pytest.param(True, "bool", id="bool"),
    pytest.param(None, "NoneType", id="none"),
    pytest.param(object(), "object", id="object"),
    pytest.param({1, 2}, "set", id="set"),
]


@pytest.mark.parametrize(("event", "type_name"), BAD_EVENT_TYPES)
def test_event_of_wrong_type_is_refused(
    producer: Producer,
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    event: object,
    type_name: str,
) -> None:
    producer.publish(GOOD_KEY, {"n": 1})
    refused: list[BaseException] = []
    with pytest.raises(InvalidEvent) as info:
        producer.publish(GOOD_KEY, event)  # type: ignore[arg-type]
    refused.append(info.value)
    _check_refusal(info.value, InvalidEvent, "event", "dict", "bytes", type_name)
    _still_works(producer, amqp, stream, refused)


BAD_EVENT_CONTENTS = [
    pytest.param({"tags": {"a", "b"}}, ("JSON", "set"), id="set"),
    pytest.param({"x": math.nan}, ("nan",), id="nan"),
    pytest.param({"x": math.inf}, ("inf",), id="inf"),
    pytest.param({"x": -math.inf}, ("inf",), id="minus-inf"),
    pytest.param({"deep": [[{"x": [1.0, math.nan]}]]}, ("nan",), id="nested-nan"),
    pytest.param({"big": 2**64}, ("64",), id="int-over-64-bits"),
    pytest.param({"small": -(2**63) - 1}, ("64",), id="negative-int-over-64-bits"),
    pytest.param({"list": [1, 2**70]}, ("64",), id="nested-big-int"),
    pytest.param(_deep(250), ("200",), id="250-levels"),
    pytest.param({"x": [[[[_deep(210)]]]]}, ("200",), id="deep-through-lists"),
    pytest.param({1: "one"}, ("key",), id="int-dict-key"),
    pytest.param({"ok": {None: 1}}, ("key",), id="nested-none-dict-key"),
    pytest.param({(1, 2): "pair"}, ("key",), id="tuple-dict-key"),
    pytest.param({"raw": b"bytes inside"}, ("JSON", "bytes"), id="bytes-value"),
    pytest.param({"when": object()}, ("JSON", "object"), id="object-value"),
    pytest.param({"s": "lone \ud800 surrogate"}, ("surrogate",), id="lone-surrogate"),
]


@pytest.mark.parametrize(("event", "words"), BAD_EVENT_CONTENTS)
def test_event_that_is_not_valid_json_is_refused(
    producer: Producer,
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    event: dict[Any, Any],
    words: tuple[str, ...],
) -> None:
    producer.publish(GOOD_KEY, {"n": 1})
    refused: list[BaseException] = []
    with pytest.raises(InvalidEvent) as info:
        producer.publish(GOOD_KEY, event)
    refused.append(info.value)
    _check_refusal(info.value, InvalidEvent, "event", *words)
    _still_works(producer, amqp, stream, refused)


def test_json_edge_values_that_fit_are_accepted(
    producer: Producer, stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    events: list[Any] = [
        {"max": 2**63 - 1, "min": -(2**63), "float": 1e308, "tiny": -5e-324},
        {"deep": _deep(150)},
        {"nul": "a\x00b", "uni": "ключ 🔑", "empty": {}, "list": [], "none": None},
        MappingProxyType({"read": "only"}),
    ]
    for event in events:
        producer.publish(GOOD_KEY, event)
    _settled(producer)
    landed = _landed_only(amqp, stream, GOOD_KEY, [orjson.dumps(dict(e)) for e in events])
    assert [m.json() for m in landed] == [dict(e) for e in events]
    assert {m.content_type for m in landed} == {CONTENT_JSON}


def test_bytes_like_events_are_sent_as_is(
    producer: Producer, stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    raw = bytes(range(256))
    events: list[Any] = [
        b"",
        raw,
        bytearray(b"\x00not json\xff"),
        memoryview(b"view of bytes"),
        memoryview(b"abcdef")[::2],  # not contiguous
        b"[1, 2, 3]",
    ]
    for event in events:
        producer.publish(GOOD_KEY, event)
    _settled(producer)
    landed = _landed_only(amqp, stream, GOOD_KEY, [bytes(e) for e in events])
    assert {m.content_type for m in landed} == {CONTENT_BYTES}


# -------------------------------------------------------------------------- oversized
@pytest.fixture
def small_producer(stream: StreamFixture) -> Iterator[Producer]:
    made = Producer(
        stream.name,
        mode="key",
        settings=stream.settings,
        publish_timeout=5,
        max_message_bytes=SMALL_LIMIT,
    )
    try:
        yield made
    finally:
        with suppress(KeyqError):
            made.close(timeout=2)


def _fitting(key: str) -> int:
    """The largest bytes body that fits ``SMALL_LIMIT`` for ``key`` without headers."""
    return SMALL_LIMIT - HEADER_ALLOWANCE - len(key.encode())


@pytest.mark.parametrize(
    "event",
    [
        pytest.param(b"x" * (_fitting(GOOD_KEY) + 1), id="one-byte-over"),
        pytest.param(b"x" * 10 * SMALL_LIMIT, id="far-over"),
        pytest.param({"text": "y" * SMALL_LIMIT}, id="json-over"),
        pytest.param({"text": "€" * (SMALL_LIMIT // 2)}, id="json-over-in-utf8-bytes"),
    ],
)
def test_oversized_event_is_refused(
    small_producer: Producer, stream: StreamFixture, amqp: pika.BlockingConnection, event: Any
) -> None:
    small_producer.publish(GOOD_KEY, {"n": 1})
    refused: list[BaseException] = []
    with pytest.raises(MessageTooLarge) as info:
        small_producer.publish(GOOD_KEY, event)
    refused.append(info.value)
    _check_refusal(info.value, MessageTooLarge, "max_message_bytes", str(SMALL_LIMIT))
    _still_works(small_producer, amqp, stream, refused)


def test_event_that_exactly_fits_is_sent(
    small_producer: Producer, stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    fits = b"f" * _fitting(GOOD_KEY)
    small_producer.publish(GOOD_KEY, fits)
    with pytest.raises(MessageTooLarge):
        small_producer.publish(GOOD_KEY, fits + b"f")
    small_producer.publish(GOOD_KEY, b"small")
    _settled(small_producer)
    _landed_only(amqp, stream, GOOD_KEY, [fits, b"small"])


def test_long_key_counts_toward_the_size_limit(
    small_producer: Producer, stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    small_producer.publish(GOOD_KEY, {"n": 1})
    long_key = "k" * (SMALL_LIMIT - HEADER_ALLOWANCE)
    refused: list[BaseException] = []
    with pytest.raises(MessageTooLarge) as info:
        small_producer.publish(long_key, b"x")
    refused.append(info.value)
    _check_refusal(info.value, MessageTooLarge, "max_message_bytes")
    _still_works(small_producer, amqp, stream, refused)


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({"note": "n" * SMALL_LIMIT}, id="ascii"),
        # 1,000 characters, 3,000 bytes in UTF-8: bigger than the whole limit on their own.
        pytest.param({"note": "€" * 1000}, id="utf8-value"),
        pytest.param({"€" * 80: "€" * 700}, id="utf8-name-and-value"),
    ],
)
def test_headers_count_toward_the_size_limit_in_utf8_bytes(
    small_producer: Producer,
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    headers: dict[str, Any],
) -> None:
    small_producer.publish(GOOD_KEY, {"n": 1})
    refused: list[BaseException] = []
    with pytest.raises(MessageTooLarge) as info:
        small_producer.publish(GOOD_KEY, b"x", headers=headers)
    refused.append(info.value)
    _check_refusal(info.value, MessageTooLarge, "max_message_bytes")
    _still_works(small_producer, amqp, stream, refused)


# ---------------------------------------------------------------------------- headers
BAD_HEADERS = [
    pytest.param({"x-keyq-seq": 99}, ("reserved", "x-keyq-"), id="reserved-seq"),
    pytest.param({"X-KeyQ-Key": "spoof"}, ("reserved",), id="reserved-any-case"),
    pytest.param({"x-keyq-custom": "v"}, ("reserved",), id="reserved-unknown"),
    pytest.param({1: "v"}, ("name",), id="int-name"),
    pytest.param({b"name": "v"}, ("name",), id="bytes-name"),
    pytest.param({None: "v"}, ("name",), id="none-name"),
    pytest.param({"": "v"}, ("name",), id="empty-name"),
    pytest.param({"n" * 256: "v"}, ("255",), id="name-over-255-bytes"),
    pytest.param({"list": [1, 2]}, ("list",), id="list-value"),
    pytest.param({"dict": {"a": 1}}, ("dict",), id="dict-value"),
    pytest.param({"obj": object()}, ("object",), id="object-value"),
    pytest.param({"set": {1}}, ("set",), id="set-value"),
    pytest.param({"big": 2**64}, ("64",), id="int-over-64-bits"),
    pytest.param({"big": 2**63}, ("64",), id="int-just-over-signed-64-bits"),
    pytest.param({"small": -(2**63) - 1}, ("64",), id="negative-int-over-64-bits"),
    pytest.param({"s": "bad \udcff text"}, ("unicode",), id="lone-surrogate-value"),
    pytest.param([("trace", "t")], ("mapping",), id="list-of-pairs"),
    pytest.param("trace=t", ("mapping",), id="str"),
]


@pytest.mark.parametrize(("headers", "words"), BAD_HEADERS)
def test_bad_headers_are_refused(
    producer: Producer,
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    headers: Any,
    words: tuple[str, ...],
) -> None:
    producer.publish(GOOD_KEY, {"n": 1})
    refused: list[BaseException] = []
    with pytest.raises(InvalidHeaders) as info:
        producer.publish(GOOD_KEY, {"n": -1}, headers=headers)
    refused.append(info.value)
    _check_refusal(info.value, InvalidHeaders, "header", *words)
    _still_works(producer, amqp, stream, refused)


def test_header_name_with_lone_surrogate_is_refused(
    producer: Producer, stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    """AMQP header names are UTF-8 short strings; one that cannot be encoded must be refused
    at ``publish``, not blow up later on the producer's I/O thread."""
    producer.publish(GOOD_KEY, {"n": 1})
    refused: list[BaseException] = []
    with pytest.raises(InvalidHeaders) as info:
        producer.publish(GOOD_KEY, {"n": -1}, headers={"bad\ud800name": "v"})
    refused.append(info.value)
    _check_refusal(info.value, InvalidHeaders, "header")
    _still_works(producer, amqp, stream, refused)


def test_good_headers_travel_intact(
    producer: Producer, stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    headers = {
        "trace": "t-1",
        "max": 2**63 - 1,
        "min": -(2**63),
        "flag": True,
        "nothing": None,
        "raw": b"\x00\xff",
        "x-keyq": "no dash after keyq, so not reserved",
        "ключ": "значение",
    }
    producer.publish(GOOD_KEY, {"n": 1}, headers=headers)
    _settled(producer)
    (landed,) = _landed_only(amqp, stream, GOOD_KEY, [b'{"n":1}'])
    for name, value in headers.items():
        assert landed.headers[name] == value, name


def test_float_header_value_is_sent_or_refused_up_front(
    producer: Producer, stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    """``check_user_headers`` lets floats through; they must then really travel (or be
    refused at ``publish``), never leave an accepted event that can't be sent."""
    producer.publish(GOOD_KEY, {"n": 1})
    try:
        producer.publish(GOOD_KEY, {"n": 2}, headers={"ratio": 0.25})
    except InvalidHeaders as exc:
        _check_refusal(exc, InvalidHeaders, "header", "float")
        _still_works(producer, amqp, stream, [exc])
        return
    _settled(producer)
    landed = _landed_only(amqp, stream, GOOD_KEY, [b'{"n":1}', b'{"n":2}'])
    assert landed[1].headers["ratio"] == 0.25


# ---------------------------------------------------------------- streams and config
BAD_STREAM_NAMES = [
    pytest.param("", id="empty"),
    pytest.param("s" * 65, id="65-chars"),
    pytest.param("-dash-first", id="dash-first"),
    pytest.param("_underscore-first", id="underscore-first"),
    pytest.param("has space", id="space"),
    pytest.param("dot.ted", id="dot"),
    pytest.param("brace{x}", id="brace"),
    pytest.param("slash/x", id="slash"),
    pytest.param("colon:x", id="colon"),
    pytest.param("ünïcode", id="unicode"),
    pytest.param("trailing\n", id="trailing-newline"),
    pytest.param(None, id="none"),
    pytest.param(42, id="int"),
    pytest.param(b"bytes", id="bytes"),
]


@pytest.mark.parametrize("name", BAD_STREAM_NAMES)
def test_invalid_stream_name_is_refused(settings: Any, name: object) -> None:
    before = _producer_threads()
    with pytest.raises(InvalidStreamName) as info:
        Producer(name, settings=settings)  # type: ignore[arg-type]
    _check_refusal(info.value, InvalidStreamName, "stream name", "64", "A-Z")
    assert isinstance(info.value, InvalidInput)
    assert _producer_threads() == before


BAD_CONFIGS = [
    pytest.param({"mode": "fifo"}, ("mode", "key", "bucket"), id="unknown-mode"),
    pytest.param({"mode": "KEY"}, ("mode",), id="mode-wrong-case"),
    pytest.param({"mode": 1}, ("mode",), id="mode-int"),
    pytest.param({"mode": "bucket", "buckets": 0}, ("bucket",), id="zero-buckets"),
    pytest.param({"mode": "bucket", "buckets": -4}, ("bucket",), id="negative-buckets"),
    pytest.param({"mode": "bucket", "buckets": 65_537}, ("65536",), id="too-many-buckets"),
    pytest.param({"mode": "bucket", "buckets": 2.5}, ("integer",), id="float-buckets"),
    pytest.param({"mode": "bucket", "buckets": "8"}, ("integer",), id="str-buckets"),
    pytest.param({"mode": "bucket", "buckets": True}, ("integer",), id="bool-buckets"),
    pytest.param({"buckets": 0}, ("bucket",), id="zero-buckets-no-mode"),
    pytest.param({"mode": "key", "buckets": 8}, ("key mode", "bucket"), id="key-with-buckets"),
    pytest.param({"confirm_window": 0}, ("confirm_window",), id="zero-window"),
    pytest.param({"publish_timeout": 0}, ("publish_timeout",), id="zero-timeout"),
    pytest.param({"publish_timeout": -1.0}, ("publish_timeout",), id="negative-timeout"),
    pytest.param({"max_message_bytes": 100}, ("max_message_bytes",), id="tiny-limit"),
    pytest.param({"max_message_bytes": 2**40}, ("max_message_bytes",), id="huge-limit"),
]


@pytest.mark.parametrize(("options", "words"), BAD_CONFIGS)
def test_bad_mode_buckets_or_options_raise_configuration_error(
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    options: dict[str, Any],
    words: tuple[str, ...],
) -> None:
    before = _producer_threads()
    with pytest.raises(ConfigurationError) as info:
        Producer(stream.name, settings=stream.settings, **options)
    _check_refusal(info.value, ConfigurationError, *words)
    assert _producer_threads() == before
    # Nothing was recorded for the stream, so a correct producer can still choose.
    assert not stream.redis.exists(stream.keys.config)
    with Producer(stream.name, mode="key", settings=stream.settings, publish_timeout=5) as p:
        p.publish(GOOD_KEY, {"n": 1})
        p.publish(GOOD_KEY, {"n": 2})
        _settled(p)
    _landed_only(amqp, stream, GOOD_KEY, [b'{"n":1}', b'{"n":2}'])


def test_mode_other_than_the_streams_is_refused(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    with Producer(stream.name, mode="key", settings=stream.settings, publish_timeout=5) as p:
        p.publish(GOOD_KEY, {"n": 1})
        for options in ({"mode": "bucket"}, {"mode": "bucket", "buckets": 8}, {"buckets": 4}):
            with pytest.raises(StreamConfigMismatch) as info:
                Producer(stream.name, settings=stream.settings, **options)  # type: ignore[arg-type]
            _check_refusal(info.value, ConfigurationError, stream.name, "mode=key", "bucket")
        # The first producer is undisturbed.
        p.publish(GOOD_KEY, {"n": 2})
        _settled(p)
    _landed_only(amqp, stream, GOOD_KEY, [b'{"n":1}', b'{"n":2}'])


@pytest.mark.parametrize("producer_id", ["has:colon", ":"])
def test_bad_producer_id_raises_configuration_error(settings: Any, producer_id: str) -> None:
    """A caller catching ``KeyqError`` must see a bad option as a keyq error too."""
    with pytest.raises(ConfigurationError) as info:
        Producer("t-id-check", settings=settings, producer_id=producer_id)
    _check_refusal(info.value, ConfigurationError, "producer_id")


# ---------------------------------------------------------------------------- settings
BAD_URLS = [
    pytest.param("amqp_url", "http://u:secret@h/", ("KEYQ_AMQP_URL", "amqp://"), id="http"),
    pytest.param("amqp_url", "amqp://u:secret@h:notaport/", ("KEYQ_AMQP_URL",), id="bad-port"),
    pytest.param("amqp_url", "amqp://u:secret@h:99999/", ("KEYQ_AMQP_URL",), id="port-range"),
    pytest.param("amqp_url", "amqp://u:secret@/vhost", ("KEYQ_AMQP_URL", "host"), id="no-host"),
    pytest.param("amqp_url", "amqp://u:secret@[::1/", ("KEYQ_AMQP_URL",), id="bad-ipv6"),
    pytest.param("amqp_url", "u:secret@h:5672", ("KEYQ_AMQP_URL",), id="no-scheme"),
    pytest.param("amqp_url", "amqp:/u:secret@h/", ("KEYQ_AMQP_URL",), id="one-slash"),
    pytest.param("redis_url", "redis:u:secret@h", ("KEYQ_REDIS_URL",), id="redis-no-slashes"),
    pytest.param("redis_url", "ftp://u:secret@h/", ("KEYQ_REDIS_URL", "redis://"), id="ftp"),
    pytest.param("redis_url", "redis://u:secret@h:port/0", ("KEYQ_REDIS_URL",), id="redis-port"),
    pytest.param("redis_url", "amqp://u:secret@h/", ("KEYQ_REDIS_URL",), id="amqp-for-redis"),
]


def _assert_no_secret(exc: BaseException, secret: str) -> None:
    texts = [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
    cause = exc.__cause__
    while cause is not None:
        texts += [str(cause), repr(cause)]
        cause = cause.__cause__
    for text in texts:
        assert secret not in text, text


@pytest.mark.parametrize(("field", "url", "words"), BAD_URLS)
def test_bad_url_setting_is_a_configuration_error_without_the_password(
    field: str, url: str, words: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigurationError) as info:
        load_settings(**{field: url})
    _check_refusal(info.value, ConfigurationError, *words)
    _assert_no_secret(info.value, "secret")


@pytest.mark.parametrize(("field", "url", "words"), BAD_URLS)
def test_bad_url_given_to_producer_or_env_is_refused_without_the_password(
    monkeypatch: pytest.MonkeyPatch, field: str, url: str, words: tuple[str, ...]
) -> None:
    before = _producer_threads()
    with pytest.raises(ConfigurationError) as info:
        Producer("t-url-check", **{field: url})
    _check_refusal(info.value, ConfigurationError, *words)
    _assert_no_secret(info.value, "secret")
    monkeypatch.setenv(f"KEYQ_{field.upper()}", url)
    with pytest.raises(ConfigurationError) as info:
        load_settings()
    _assert_no_secret(info.value, "secret")
    assert _producer_threads() == before


def test_settings_never_show_the_password() -> None:
    settings = load_settings(
        amqp_url="amqp://u:secret-a@h:5672/%2F", redis_url="redis://u:secret-r@h:6379/0"
    )
    for text in (repr(settings), str(settings), str(settings.describe())):
        assert "secret-a" not in text
        assert "secret-r" not in text
    assert settings.describe()["amqp_url"] == "amqp://u:***@h:5672/%2F"
