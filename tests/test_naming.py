"""Queue names: valid for AMQP for any key, and never shared by two keys."""

from __future__ import annotations

import pika
import pika.exceptions
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyq.broker.errors import InvalidKey, InvalidStreamName
from keyq.broker.naming import (
    INCARNATION_MARK,
    MAX_KEY_BYTES,
    MAX_QUEUE_NAME_BYTES,
    base_queue_name,
    bucket_queue_name,
    check_stream_name,
    dead_letter_queue_name,
    encode_key,
    incarnation_name,
    incarnation_of,
    is_stream_queue,
    key_queue_name,
)
from tests.conftest import StreamFixture

keys = st.text(min_size=1, max_size=300).filter(lambda k: len(k.encode("utf-8")) <= MAX_KEY_BYTES)
streams = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", fullmatch=True)


@given(streams, keys)
def test_any_key_gives_a_short_valid_name(stream: str, key: str) -> None:
    name = key_queue_name(stream, key)
    encoded = name.encode("utf-8")
    assert len(encoded) <= MAX_QUEUE_NAME_BYTES
    assert name.isascii() and name.isprintable()
    assert not name.startswith("amq.")
    assert is_stream_queue(stream, name)
    assert name != dead_letter_queue_name(stream)
    assert key_queue_name(stream, key) == name  # deterministic


@given(
    streams,
    st.lists(keys, min_size=2, max_size=30, unique=True),
    st.lists(st.tuples(streams, keys), min_size=2, max_size=20, unique=True),
)
def test_distinct_keys_or_stream_key_pairs_never_share_a_queue(
    stream: str, many: list[str], pairs: list[tuple[str, str]]
) -> None:
    assert len({key_queue_name(stream, key) for key in many}) == len(many)
    assert len({key_queue_name(stream, key) for stream, key in pairs}) == len(pairs)


def test_plain_keys_stay_readable_and_others_are_digested() -> None:
    assert key_queue_name("orders", "order-42") == "keyq.orders.k.order-42"
    assert key_queue_name("orders", "a:b.c_d") == "keyq.orders.k.a:b.c_d"
    for odd in ("with space", "ünï", "a/b", "x" * 300, "amq.gen-1", "\x00", "k.dlq"):
        name = key_queue_name("orders", odd)
        if odd in ("amq.gen-1", "k.dlq"):
            assert name == f"keyq.orders.k.{odd}"
        else:
            assert name.startswith("keyq.orders.h.") and len(name) == len("keyq.orders.h.") + 64
    # A plain key that looks like a digest or another queue's suffix stays in its namespace.
    assert key_queue_name("s", "h.abc") == "keyq.s.k.h.abc"
    assert key_queue_name("s", "dlq") != dead_letter_queue_name("s")


def test_bucket_and_dead_letter_names() -> None:
    assert bucket_queue_name("orders", 7) == "keyq.orders.b.00007"
    assert dead_letter_queue_name("orders") == "keyq.orders.dlq"
    assert is_stream_queue("orders", "keyq.orders.b.00007")
    assert not is_stream_queue("orders", "keyq.orders.dlq")
    assert not is_stream_queue("orders", "keyq.orders2.k.x")


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "{x}", "-lead", "x" * 65, "ü", None, 5])
def test_bad_stream_names(bad: object) -> None:
    with pytest.raises(InvalidStreamName):
        check_stream_name(bad)


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("", "empty"),
        (None, "str"),
        (b"bytes", "str"),
        ("\ud800", "surrogate"),
        ("é" * 2049, "4096"),
    ],
)
def test_bad_keys_and_one_at_the_limit(bad: object, why: str) -> None:
    with pytest.raises(InvalidKey, match=why):
        encode_key(bad)
    assert len(encode_key("é" * 2048)) == MAX_KEY_BYTES


@pytest.mark.broker_versions
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(key=keys)
def test_the_broker_accepts_every_name(
    stream: StreamFixture, amqp: pika.BlockingConnection, key: str
) -> None:
    """Declared as keyq declares its queues: durable (a transient non-exclusive queue is a
    deprecated feature of RabbitMQ 4.x, refused once denied); deleted at once, or by the stream
    fixture if the test fails in between."""
    name = key_queue_name(stream.name, key)
    stream.track(name)
    channel = amqp.channel()
    try:
        channel.queue_declare(name, durable=True)
        channel.queue_delete(name)
    except pika.exceptions.ChannelClosedByBroker as exc:  # pragma: no cover - the failure
        pytest.fail(f"broker refused {name!r}: {exc}")
    finally:
        if channel.is_open:
            channel.close()


@given(stream=streams, key=keys, incarnation=st.integers(min_value=0, max_value=9_999_999_999))
def test_every_incarnation_of_a_quorum_key_queue_is_a_short_valid_name(
    stream: str, key: str, incarnation: int
) -> None:
    base = key_queue_name(stream, key, incarnations=True)
    name = incarnation_name(base, incarnation)
    assert len(name.encode("utf-8")) <= MAX_QUEUE_NAME_BYTES
    assert INCARNATION_MARK not in base  # so no key's base name is another's incarnation
    assert base_queue_name(name) == base
    assert incarnation_of(name) == incarnation
    assert (name == base) == (incarnation == 0)


def test_incarnations_leave_other_streams_names_as_they_were() -> None:
    plain = "k" * 240
    classic = key_queue_name("s", plain)
    quorum = key_queue_name("s", plain, incarnations=True)
    assert classic.endswith(".k." + plain)  # classic names never change
    assert ".h." in quorum  # too long to leave room for an incarnation: digested
    assert key_queue_name("s", "order-1", incarnations=True) == key_queue_name("s", "order-1")
    assert base_queue_name("keyq.s.k.order-1") == "keyq.s.k.order-1"
    assert base_queue_name(bucket_queue_name("s", 3)) == bucket_queue_name("s", 3)
