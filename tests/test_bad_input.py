"""Bad input is refused before anything reaches RabbitMQ or Redis, with the right class of
``keyq.broker.errors`` (a ``ValueError`` where it derives from one) and a message to act on;
the producer goes on, and its queue holds exactly the good events, seqs without a gap."""

from __future__ import annotations

import math
import threading
import traceback
import uuid
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


def _producer(stream: StreamFixture, **options: Any) -> Producer:
    """Short waits: a broken producer fails fast."""
    return Producer(stream.name, mode="key", settings=stream.settings, publish_timeout=5, **options)


def _deep(levels: int) -> dict[str, Any]:
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
    """The keyq class asked for (a ValueError when it is one), saying what was wrong."""
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
    """The key's queue holds exactly ``bodies``, seqs 1..n; the stream has no other queue and
    an empty dead-letter queue."""
    queue = key_queue_name(stream.name, key)
    landed = drain(amqp.channel(), queue)
    assert [m.body for m in landed] == bodies
    assert [m.seq for m in landed] == list(range(1, len(bodies) + 1))
    assert all(m.key == key for m in landed)
    assert set(stream.redis.zrange(stream.keys.registry, 0, -1)) == {queue}
    assert queue_depth(amqp, dead_letter_queue_name(stream.name)) in (0, None)
    return landed


def _still_works(producer: Producer, amqp: pika.BlockingConnection, stream: StreamFixture) -> None:
    producer.publish(GOOD_KEY, {"n": 2})
    _settled(producer)
    _landed_only(amqp, stream, GOOD_KEY, [b'{"n":1}', b'{"n":2}'])


def _fitting(key: str) -> int:
    """The largest bytes body that fits ``SMALL_LIMIT`` for ``key`` without headers."""
    return SMALL_LIMIT - HEADER_ALLOWANCE - len(key.encode())


def _refused(cls: type[KeyqError], argument: str, *rows: tuple[Any, ...], **call: Any) -> list[Any]:
    """Rows ``(value, words, id)``: ``value`` is the ``argument`` (key, event or headers) of a
    publish otherwise good, or as ``call`` sets it."""
    defaults = {"key": GOOD_KEY, "event": {"n": -1}, "headers": None, "max_message_bytes": None}
    return [
        pytest.param({**defaults, **call, argument: value}, cls, words, id=f"{argument}-{id_}")
        for value, words, id_ in rows
    ]


LIMITED = {"max_message_bytes": SMALL_LIMIT}
TOO_LARGE = ("max_message_bytes",)
REFUSALS = [
    *_refused(
        InvalidKey,
        "key",
        ("", ("key", "empty"), "empty"),
        (None, ("key", "str", "NoneType"), "none"),
        (42, ("key", "str", "int"), "int"),
        (b"bytes-key", ("key", "str", "bytes"), "bytes"),
        (["k"], ("key", "str", "list"), "list"),
        ("k" * (MAX_KEY_BYTES + 1), ("key", str(MAX_KEY_BYTES)), "ascii-over-4096-bytes"),
        # 2049 characters but 4098 bytes: the limit is on UTF-8 bytes, not characters.
        ("é" * 2049, ("key", str(MAX_KEY_BYTES), "bytes"), "utf8-over-4096-bytes"),
        ("ab\ud800cd", ("key", "surrogate"), "lone-surrogate"),
    ),
    *_refused(
        InvalidEvent,
        "event",
        *(
            (event, ("event", "dict", "bytes", type(event).__name__), id_)
            for event, id_ in zip(
                ([], [{"a": 1}], "text", '{"a": 1}', 7, 1.5, True, None, object(), {1, 2}),
                "empty-list list str json-str int float bool none object set".split(),  # noqa: SIM905
                strict=True,
            )
        ),
        ({"tags": {"a", "b"}}, ("event", "JSON", "set"), "set-inside"),
        ({"x": math.nan}, ("event", "nan"), "nan"),
        ({"x": math.inf}, ("event", "inf"), "inf"),
        ({"x": -math.inf}, ("event", "inf"), "minus-inf"),
        ({"deep": [[{"x": [1.0, math.nan]}]]}, ("event", "nan"), "nested-nan"),
        ({"big": 2**64}, ("event", "64"), "int-over-64-bits"),
        ({"small": -(2**63) - 1}, ("event", "64"), "negative-int-over-64-bits"),
        ({"list": [1, 2**70]}, ("event", "64"), "nested-big-int"),
        (_deep(250), ("event", "200"), "250-levels"),
        ({"x": [[[[_deep(210)]]]]}, ("event", "200"), "deep-through-lists"),
        ({1: "one"}, ("event", "key"), "int-dict-key"),
        ({"ok": {None: 1}}, ("event", "key"), "nested-none-dict-key"),
        ({(1, 2): "pair"}, ("event", "key"), "tuple-dict-key"),
        ({"raw": b"bytes inside"}, ("event", "JSON", "bytes"), "bytes-value"),
        ({"when": object()}, ("event", "JSON", "object"), "object-value"),
        ({"s": "lone \ud800 surrogate"}, ("event", "surrogate"), "lone-surrogate"),
    ),
    *_refused(
        MessageTooLarge,
        "event",
        (b"x" * (_fitting(GOOD_KEY) + 1), (*TOO_LARGE, str(SMALL_LIMIT)), "one-byte-over"),
        (b"x" * 10 * SMALL_LIMIT, (*TOO_LARGE, str(SMALL_LIMIT)), "far-over"),
        ({"text": "y" * SMALL_LIMIT}, (*TOO_LARGE, str(SMALL_LIMIT)), "json-over"),
        ({"text": "€" * (SMALL_LIMIT // 2)}, (*TOO_LARGE, str(SMALL_LIMIT)), "json-utf8-over"),
        **LIMITED,
    ),
    # The key counts toward the limit too.
    *_refused(
        MessageTooLarge,
        "key",
        ("k" * (SMALL_LIMIT - HEADER_ALLOWANCE), TOO_LARGE, "long"),
        event=b"x",
        **LIMITED,
    ),
    # Headers count toward the limit in UTF-8 bytes: 1,000 "€" are 3,000 bytes.
    *_refused(
        MessageTooLarge,
        "headers",
        ({"note": "n" * SMALL_LIMIT}, TOO_LARGE, "too-large-ascii"),
        ({"note": "€" * 1000}, TOO_LARGE, "too-large-utf8-value"),
        ({"€" * 80: "€" * 700}, TOO_LARGE, "too-large-utf8-name-and-value"),
        event=b"x",
        **LIMITED,
    ),
    *_refused(
        InvalidHeaders,
        "headers",
        ({"x-keyq-seq": 99}, ("header", "reserved", "x-keyq-"), "reserved-seq"),
        ({"X-KeyQ-Key": "spoof"}, ("header", "reserved"), "reserved-any-case"),
        ({"x-keyq-custom": "v"}, ("header", "reserved"), "reserved-unknown"),
        ({1: "v"}, ("header", "name"), "int-name"),
        ({b"name": "v"}, ("header", "name"), "bytes-name"),
        ({None: "v"}, ("header", "name"), "none-name"),
        ({"": "v"}, ("header", "name"), "empty-name"),
        ({"n" * 256: "v"}, ("header", "255"), "name-over-255-bytes"),
        # AMQP header names are UTF-8 short strings: refused at ``publish``, not later on
        # the producer's I/O thread.
        ({"bad\ud800name": "v"}, ("header",), "lone-surrogate-name"),
        ({"list": [1, 2]}, ("header", "list"), "list-value"),
        ({"dict": {"a": 1}}, ("header", "dict"), "dict-value"),
        ({"obj": object()}, ("header", "object"), "object-value"),
        ({"set": {1}}, ("header", "set"), "set-value"),
        ({"big": 2**64}, ("header", "64"), "int-over-64-bits"),
        ({"big": 2**63}, ("header", "64"), "int-just-over-signed-64-bits"),
        ({"small": -(2**63) - 1}, ("header", "64"), "negative-int-over-64-bits"),
        ({"s": "bad \udcff text"}, ("header", "unicode"), "lone-surrogate-value"),
        ([("trace", "t")], ("header", "mapping"), "list-of-pairs"),
        ("trace=t", ("header", "mapping"), "str"),
    ),
]


@pytest.mark.parametrize(("call", "cls", "words"), REFUSALS)
def test_a_bad_publish_is_refused_and_the_producer_goes_on(
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    call: dict[str, Any],
    cls: type[KeyqError],
    words: tuple[str, ...],
) -> None:
    """A bad key, event or headers, or an event over ``max_message_bytes`` with its key and
    headers: refused with the right class and words, and nothing of it is sent."""
    with _producer(stream, max_message_bytes=call["max_message_bytes"]) as producer:
        producer.publish(GOOD_KEY, {"n": 1})
        with pytest.raises(cls) as info:
            producer.publish(call["key"], call["event"], headers=call["headers"])
        _check_refusal(info.value, cls, *words)
        _still_works(producer, amqp, stream)


ODD_KEYS = [
    *("tab\there", "new\nline\r", "bell\x07esc\x1b\x7f", "nul\x00inside", "\x00"),
    *("ключ", "鍵", "🔑 key", "dlq", "amq.gen-x", "amq.direct", "../x", "..", "a/b\\c"),
    *("*", "#.#", " spaced ", "k" * MAX_KEY_BYTES, "é" * (MAX_KEY_BYTES // 2), "dup", "DUP"),
]


def test_odd_keys_land_in_their_own_queue_with_the_original_key(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    other_stream = f"t-{uuid.uuid4().hex[:12]}"
    lookalike = f"keyq.{other_stream}.k.x"  # exactly the name of another stream's queue
    own_dlq = dead_letter_queue_name(stream.name)
    keys = [*ODD_KEYS, lookalike, own_dlq, key_queue_name(stream.name, "dlq")]
    with _producer(stream) as p:
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


def test_edge_events_and_headers_that_fit_travel_intact(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    """JSON at its limits goes as JSON; bytes-like events go as they are, as bytes."""
    as_json: list[Any] = [
        {"max": 2**63 - 1, "min": -(2**63), "float": 1e308, "tiny": -5e-324},
        {"deep": _deep(150)},
        {"nul": "a\x00b", "uni": "ключ 🔑", "empty": {}, "list": [], "none": None},
        MappingProxyType({"read": "only"}),
    ]
    # The second memoryview is not contiguous.
    as_bytes: list[Any] = [
        *(b"", bytes(range(256)), bytearray(b"\x00not json\xff"), memoryview(b"view of bytes")),
        *(memoryview(b"abcdef")[::2], b"[1, 2, 3]"),
    ]
    headers: dict[str, Any] = {"trace": "t-1", "max": 2**63 - 1, "min": -(2**63), "flag": True}
    headers |= {"nothing": None, "raw": b"\x00\xff", "ключ": "значение"}
    headers["x-keyq"] = "no dash after keyq, so not reserved"
    with _producer(stream) as producer:
        for event in as_json:
            producer.publish(GOOD_KEY, event)
        for event in as_bytes:
            producer.publish(GOOD_KEY, event, headers=headers)
        _settled(producer)
    bodies = [orjson.dumps(dict(e)) for e in as_json] + [bytes(e) for e in as_bytes]
    landed = _landed_only(amqp, stream, GOOD_KEY, bodies)
    assert [m.json() for m in landed[: len(as_json)]] == [dict(e) for e in as_json]
    assert {m.content_type for m in landed[: len(as_json)]} == {CONTENT_JSON}
    assert {m.content_type for m in landed[len(as_json) :]} == {CONTENT_BYTES}
    for name, value in headers.items():
        assert all(m.headers[name] == value for m in landed[len(as_json) :]), name


def test_event_that_exactly_fits_is_sent(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    fits = b"f" * _fitting(GOOD_KEY)
    with _producer(stream, max_message_bytes=SMALL_LIMIT) as producer:
        producer.publish(GOOD_KEY, fits)
        with pytest.raises(MessageTooLarge):
            producer.publish(GOOD_KEY, fits + b"f")
        producer.publish(GOOD_KEY, b"small")
        _settled(producer)
    _landed_only(amqp, stream, GOOD_KEY, [fits, b"small"])


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
        _still_works(producer, amqp, stream)
        return
    _settled(producer)
    landed = _landed_only(amqp, stream, GOOD_KEY, [b'{"n":1}', b'{"n":2}'])
    assert landed[1].headers["ratio"] == 0.25


# ---------------------------------------------------------------- streams and config
BAD_STREAM_NAMES = [
    *("", "s" * 65, "-dash-first", "_underscore-first", "has space", "dot.ted", "brace{x}"),
    *("slash/x", "colon:x", "ünïcode", "trailing\n", None, 42, b"bytes"),
]


@pytest.mark.parametrize("name", BAD_STREAM_NAMES, ids=repr)
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
    # A caller catching ``KeyqError`` must see a bad option as a keyq error too.
    pytest.param({"producer_id": "has:colon"}, ("producer_id",), id="producer-id-colon"),
    pytest.param({"producer_id": ":"}, ("producer_id",), id="producer-id-only-colon"),
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
    with _producer(stream) as p:
        p.publish(GOOD_KEY, {"n": 1})
        p.publish(GOOD_KEY, {"n": 2})
        _settled(p)
    _landed_only(amqp, stream, GOOD_KEY, [b'{"n":1}', b'{"n":2}'])


def test_mode_other_than_the_streams_is_refused(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    with _producer(stream) as p:
        p.publish(GOOD_KEY, {"n": 1})
        for options in ({"mode": "bucket"}, {"mode": "bucket", "buckets": 8}, {"buckets": 4}):
            with pytest.raises(StreamConfigMismatch) as info:
                Producer(stream.name, settings=stream.settings, **options)  # type: ignore[arg-type]
            _check_refusal(info.value, ConfigurationError, stream.name, "mode=key", "bucket")
        # The first producer is undisturbed.
        p.publish(GOOD_KEY, {"n": 2})
        _settled(p)
    _landed_only(amqp, stream, GOOD_KEY, [b'{"n":1}', b'{"n":2}'])


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
def test_bad_url_in_settings_producer_or_env_is_refused_without_the_password(
    monkeypatch: pytest.MonkeyPatch, field: str, url: str, words: tuple[str, ...]
) -> None:
    before = _producer_threads()
    for make in (
        lambda: load_settings(**{field: url}),
        lambda: Producer("t-url-check", **{field: url}),
    ):
        with pytest.raises(ConfigurationError) as info:
            make()
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
