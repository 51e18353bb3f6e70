"""Real connection failures: the right keyq error, quickly, with a clear message and no password;
whatever happens, every event the producer accepted is in its queue, in order."""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
import time
import traceback
import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pika
import pytest

from keyq import Producer
from keyq.broker.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    ConnectionFailed,
    KeyqError,
    ProducerClosed,
    PublishTimeout,
    RedisUnavailable,
)
from keyq.broker.naming import dead_letter_queue_name, key_queue_name
from keyq.broker.settings import Settings
from keyq.producer.lanes import WaitReason
from tests.conftest import StreamFixture
from tests.faults import FaultProxy
from tests.helpers import Landed, drain, events_in, queue_depth, settings_with
from tests.servers import PrivateRabbit
from tests.workers import wait_until

PASSWORD = "s3cret-pw"


# --------------------------------------------------------------------------- helpers
def _closed_port() -> int:
    """A loopback port nothing listens on (bound once, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _assert_no_secret(exc: BaseException, caplog: pytest.LogCaptureFixture, secret: str) -> None:
    """Not in any text a person or a log handler could see of ``exc``, its chain or the logs."""
    texts = ["".join(traceback.format_exception(exc))]
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts += [str(current), repr(current), *map(repr, current.args)]
        current = current.__cause__ or current.__context__
    for text in texts:
        assert secret not in text, f"password leaked: {text}"
    for record in caplog.records:
        shown = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            shown += "".join(traceback.format_exception(record.exc_info[1]))
        assert secret not in shown, f"password in log {record.name}: {shown}"
    assert secret not in caplog.text


def _producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("keyq-producer") and t.is_alive()]


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> list[threading.ExceptHookArgs]:
    """Exceptions that killed a background thread during the test."""
    errors: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    return errors


@pytest.fixture
def proxy(settings: Settings) -> Iterator[FaultProxy]:
    parts = urlsplit(settings.amqp_url)
    with FaultProxy(parts.hostname or "127.0.0.1", parts.port or 5672) as started:
        yield started


def _through_proxy(
    stream: StreamFixture, proxy: FaultProxy, settings: Settings | None = None, **options: Any
) -> Producer:
    """A key-mode producer for ``stream`` whose AMQP connection goes through ``proxy``."""
    settings = settings or stream.settings
    url = proxy.url_for(settings.amqp_url)
    return Producer(stream.name, mode="key", settings=settings, amqp_url=url, **options)


def _dedup(landed: list[Landed]) -> tuple[list[Landed], int]:
    """Messages with re-sent copies dropped (first copy kept), and how many were dropped."""
    first: dict[tuple[str, int], Landed] = {}
    for message in landed:
        first.setdefault((message.producer, message.seq), message)
    return list(first.values()), len(landed) - len(first)


# -------------------------------------------------------------------- refused connections
# Redis down with a user is not a credential issue; the vhost's URL has the real password.
@pytest.mark.parametrize(
    ("url", "expected", "words"),
    [
        ("amqp://guest:{pw}@{closed}/%2F", BrokerUnavailable, "RabbitMQ {closed}"),
        ("amqp://guest:{pw}@{rabbit}/%2F", AuthenticationFailed, "RabbitMQ credentials {rabbit}"),
        ("amqp://{login}@{rabbit}/{vhost}", AuthenticationFailed, "{vhost} access"),
        ("redis://:{pw}@{closed}/0", RedisUnavailable, "Redis {closed}"),
        ("redis://keyq:{pw}@{closed}/0", RedisUnavailable, "Redis {closed}"),
        ("redis://{user}:{pw}@{redis}/0", AuthenticationFailed, "Redis credentials"),
    ],
    ids=["down", "credentials", "vhost", "redis-down", "redis-down-with-user", "redis-user"],
)
def test_a_refused_connection_is_reported_quickly_saying_why_without_password(
    stream: StreamFixture,
    settings: Settings,
    caplog: pytest.LogCaptureFixture,
    thread_errors: list[threading.ExceptHookArgs],
    url: str,
    expected: type[KeyqError],
    words: str,
) -> None:
    """A producer that could not start says why and stops its threads, none of them crashing
    (tried five times)."""
    caplog.set_level(logging.DEBUG)
    amqp, redis = urlsplit(settings.amqp_url), urlsplit(settings.redis_url)
    places = {
        "pw": PASSWORD,
        "login": f"{amqp.username}:{amqp.password}",
        "closed": f"127.0.0.1:{_closed_port()}",
        "rabbit": f"{amqp.hostname}:{amqp.port or 5672}",
        "redis": f"{redis.hostname}:{redis.port or 6379}",
        "vhost": f"no-such-vhost-{uuid.uuid4().hex}",
        "user": f"nobody-{uuid.uuid4().hex[:8]}",
    }
    target = {f"{urlsplit(url).scheme}_url": url.format(**places)}
    before = set(_producer_threads())
    started = time.monotonic()
    with pytest.raises(KeyqError) as info:
        Producer(stream.name, settings=stream.settings, **target)
    assert time.monotonic() - started < 15, "not reported quickly"
    assert isinstance(info.value, expected), repr(info.value)
    text = str(info.value)
    for word in words.format(**places).split():
        assert word in text, f"{word!r} not in {text!r}"
    if expected is BrokerUnavailable:
        assert "refused" in text.lower(), f"does not say the connection was refused: {text}"
        assert isinstance(info.value, ConnectionFailed)
    if "{vhost}" in url:
        assert "vhost" in text or "virtual host" in text, text
    secret = f":{amqp.password}@" if "{vhost}" in url else PASSWORD
    _assert_no_secret(info.value, caplog, secret)
    for _ in range(4):
        with pytest.raises(expected):
            Producer(stream.name, settings=stream.settings, **target)
    assert set(_producer_threads()) <= before, "threads left behind"
    assert not thread_errors, [(e.thread, e.exc_value) for e in thread_errors]


# ------------------------------------------------------------------ through the proxy
def test_stalled_broker_times_out_publish_then_recovers(
    stream: StreamFixture, amqp: pika.BlockingConnection, proxy: FaultProxy
) -> None:
    key = "stalled"
    producer = _through_proxy(stream, proxy, confirm_window=50, publish_timeout=1)
    try:
        producer.publish(key, {"n": 0})
        producer.flush(10)  # connected, queue declared, lease held
        proxy.pause()
        for n in range(1, 51):  # fills the window of 50 unconfirmed events
            producer.publish(key, {"n": n})
        started = time.monotonic()
        with pytest.raises(PublishTimeout) as info:
            producer.publish(key, {"n": -1})
        waited = time.monotonic() - started
        assert 0.9 <= waited < 3, waited
        text = str(info.value)
        assert "50" in text and ("window" in text or "confirm" in text), text
        assert isinstance(info.value, TimeoutError)
        with pytest.raises(PublishTimeout):
            producer.flush(timeout=0.3)
        assert producer.stats["unconfirmed"] == 50
        proxy.resume()
        producer.flush(10)
        producer.publish(key, {"n": 51})
        producer.flush(10)
        assert producer.stats["unconfirmed"] == 0
    finally:
        proxy.resume()
        producer.close(10)
    landed = drain(amqp.channel(), key_queue_name(stream.name, key))
    assert [m.json()["n"] for m in landed] == list(range(52)), "the refused -1 landed, or a gap"
    assert [m.seq for m in landed] == list(range(1, 53))


def test_cut_connections_are_recovered_in_order(
    stream: StreamFixture, amqp: pika.BlockingConnection, proxy: FaultProxy
) -> None:
    keys = [f"cut-{i}" for i in range(5)]
    cuts_at = {900, 2100, 3300, 4400}
    published: dict[str, list[int]] = defaultdict(list)
    proxy.set_delay(0.005)  # keeps events in flight when the cut comes
    with _through_proxy(stream, proxy, publish_timeout=15) as producer:
        for n in range(5000):
            if n in cuts_at:
                proxy.cut()
            key = keys[n % len(keys)]
            receipt = producer.publish(key, {"n": n})
            published[key].append(n)
            assert receipt.seq == len(published[key])
        producer.flush(20)
        stats = producer.stats
        producer_id = producer.producer_id
        assert stats["unconfirmed"] == 0
        assert proxy.wait_connections(1, 5), "the producer did not reconnect by itself"
    assert stats["resent"] > 0, stats
    channel = amqp.channel()
    duplicates = 0
    for key in keys:
        landed = drain(channel, key_queue_name(stream.name, key))
        unique, dropped = _dedup(landed)
        duplicates += dropped
        assert {m.producer for m in landed} == {producer_id}
        assert [m.seq for m in unique] == list(range(1, len(published[key]) + 1)), key
        assert [m.json()["n"] for m in unique] == published[key]
    assert duplicates <= stats["resent"], (duplicates, stats)


def test_broker_gone_longer_than_reconnect_timeout_closes_the_producer(
    stream: StreamFixture, amqp: pika.BlockingConnection, proxy: FaultProxy
) -> None:
    key = "gone"
    settings = settings_with(stream.settings, reconnect_timeout=2)
    producer = _through_proxy(stream, proxy, settings=settings, publish_timeout=5)
    closed = False
    try:
        for n in range(10):
            producer.publish(key, {"n": n})
        producer.flush(10)
        proxy.refuse(True)
        proxy.cut()
        lost_at = time.monotonic()
        for n in range(10, 13):  # accepted while the producer is still retrying
            producer.publish(key, {"n": n})
        with pytest.raises(ProducerClosed) as info:
            producer.flush(timeout=15)
        took = time.monotonic() - lost_at
        assert 2 <= took < 10, took
        text = str(info.value)
        assert "3 events" in text and "RabbitMQ" in text, text
        assert "unreachable" in text or "unavailable" in text, text
        assert "guest:guest" not in text, "password in the message"
        assert isinstance(info.value.__cause__, BrokerUnavailable)
        with pytest.raises(ProducerClosed) as later:
            producer.publish(key, {"n": 99})
        assert isinstance(later.value.__cause__, BrokerUnavailable)
        closed = True
        with pytest.raises(ProducerClosed, match="3 events were never confirmed"):
            producer.close(5)
    finally:
        proxy.refuse(False)
        if not closed:  # an assertion failed above
            with contextlib.suppress(KeyqError):
                producer.close(1)
    landed = drain(amqp.channel(), key_queue_name(stream.name, key))
    assert [m.json()["n"] for m in landed] == list(range(10))


def test_handshakes_reset_while_reconnecting_are_retried_not_fatal(
    stream: StreamFixture, amqp: pika.BlockingConnection, proxy: FaultProxy
) -> None:
    """A restarting broker drops connections mid-handshake: at construction that is unavailable,
    not refused credentials (only a 403 is); while reconnecting it is retried, nothing lost."""
    proxy.drop_handshakes(True)
    with pytest.raises(KeyqError) as info:
        _through_proxy(stream, proxy)
    assert isinstance(info.value, BrokerUnavailable), repr(info.value)
    assert "credentials" not in str(info.value), "a login cut short read as refused credentials"
    proxy.drop_handshakes(False)
    key = "flapping"
    settings = settings_with(stream.settings, reconnect_timeout=20)
    with _through_proxy(stream, proxy, settings=settings, publish_timeout=20) as producer:
        for n in range(10):
            producer.publish(key, {"n": n})
        producer.flush(10)
        for drop in (proxy.refuse, proxy.drop_handshakes, proxy.refuse):
            drop(True)  # every attempt fails: reset at once, or in the middle of its handshake
            proxy.cut()
            for n in range(10, 20):
                producer.publish(key, {"n": n})
            time.sleep(1.5)
            drop(False)
            producer.flush(20)
        assert producer.stats["unconfirmed"] == 0
    landed = drain(amqp.channel(), key_queue_name(stream.name, key))
    unique, _ = _dedup(landed)
    assert [m.json()["n"] for m in unique] == list(range(10)) + list(range(10, 20)) * 3


@pytest.mark.parametrize("attempt", ["refused", "held open"])
def test_close_while_reconnecting_stops_cleanly(
    stream: StreamFixture,
    proxy: FaultProxy,
    thread_errors: list[threading.ExceptHookArgs],
    caplog: pytest.LogCaptureFixture,
    attempt: str,
) -> None:
    """Closing a producer whose broker is away ends its I/O thread within the close's
    timeout, between two attempts (refused) or during one (held open: no answer yet)."""
    caplog.set_level(logging.ERROR, logger="keyq.producer")
    before = set(_producer_threads())
    producer = _through_proxy(stream, proxy, publish_timeout=5)
    producer.publish("k", {"n": 0})
    producer.flush(10)
    if attempt == "refused":
        proxy.refuse(True)
    else:
        proxy.pause()
    proxy.cut()
    producer.publish("k", {"n": 1})
    if attempt == "held open":  # the next attempt is connected and waits for the broker
        assert proxy.wait_connections(1, timeout=5)
    started = time.monotonic()
    with pytest.raises(KeyqError) as info:  # one event could not be confirmed
        producer.close(1)
    # The close waits 1 s for the event; a connection's own timeouts are 5 s and more.
    assert time.monotonic() - started < 4
    assert isinstance(info.value, (PublishTimeout, ProducerClosed))
    assert set(_producer_threads()) <= before
    assert not thread_errors, [(e.thread, e.exc_value) for e in thread_errors]
    failures = [r.getMessage() for r in caplog.records if r.name.startswith("keyq")]
    assert not failures, failures  # the I/O thread ended as asked, not by failing


# --------------------------------------------------------------------- flow control
def test_broker_flow_control_times_out_publish_then_recovers(
    stream: StreamFixture, private_rabbit: PrivateRabbit
) -> None:
    """On the tests' own node: a memory alarm blocks every publisher of the node it is on."""
    key = "blocked"
    accepted: list[int] = []
    settings = settings_with(stream.settings, amqp_url=private_rabbit.url)
    with Producer(stream.name, mode="key", settings=settings, publish_timeout=2) as p:
        p.publish(key, {"n": 0})
        p.flush(10)  # the connection has published, so the broker will block it
        accepted.append(0)
        error: PublishTimeout | None = None
        waited = 0.0
        try:
            private_rabbit.ctl("set_vm_memory_high_watermark", "0.000001")
            private_rabbit.await_memory_alarm(True, timeout=15)
            # The broker tells the client of the block a moment late: the first may go.
            for n in range(1, 40):
                started = time.monotonic()
                try:
                    p.publish(key, {"n": n})
                except PublishTimeout as exc:
                    waited = time.monotonic() - started
                    error = exc
                    break
                accepted.append(n)
                time.sleep(0.1)
        finally:
            private_rabbit.ctl("set_vm_memory_high_watermark", "0.4")
        assert error is not None, "publish never waited for the blocked broker"
        assert 1.8 <= waited <= 6, waited
        text = str(error).lower()
        assert "flow control" in text or "block" in text, text
        private_rabbit.await_memory_alarm(False, timeout=15)
        p.flush(15)
        p.publish(key, {"n": 100})
        accepted.append(100)
        p.flush(10)
        assert p.stats["unconfirmed"] == 0
    connection = pika.BlockingConnection(pika.URLParameters(private_rabbit.url))
    queue = key_queue_name(stream.name, key)
    landed = _drain_and_delete(connection, stream, [queue])[queue]
    assert [m.json()["n"] for m in landed] == accepted


def test_a_confirm_that_comes_after_the_queue_was_retired_sends_the_event_again(
    stream: StreamFixture, amqp: pika.BlockingConnection, proxy: FaultProxy
) -> None:
    """An event reaches a queue after the janitor found it empty; the queue is retired and
    deleted with it, and its confirm (on a slow link) comes after: the event goes again."""
    from keyq.broker.retirement import Mark, RetirementFence

    settings = settings_with(
        stream.settings,
        amqp_url=proxy.url_for(stream.settings.amqp_url),
        publish_lease_ms=300,
        retire_grace_ms=600,
    )
    fence = RetirementFence(stream.redis, stream.name)
    with Producer(stream.name, mode="key", settings=settings) as producer:
        producer.publish("k", {"n": 1})
        producer.flush(10)
        queue = producer.config.queue_for("k")
        stream.track(queue)
        assert [m.seq for m in drain(amqp.channel(), queue)] == [1]
        proxy.set_delay(1.0)  # each way: the confirm comes about 2 s after the publish
        producer.publish("k", {"n": 2})
        wait_until(lambda: queue_depth(amqp, queue), 5, "the second event in its queue", 0.05)
        marked = [queue]
        assert fence.mark(marked, "test-deleter", 30_000) == {queue: Mark.MARKED}
        time.sleep(0.6)  # the grace: every lease from before the mark has run out
        amqp.channel().queue_delete(queue)  # with the event in it, its confirm still on its way
        time.sleep(2.0)  # the confirm arrives now, after the delete
        proxy.set_delay(0.0)
        fence.unmark(marked)
        producer.flush(20)
        assert producer.stats["late_confirms"] >= 1, producer.stats
    again = drain(amqp.channel(), queue)
    assert [(m.key, m.seq) for m in again] == [("k", 2)]


def test_a_queue_the_broker_keeps_refusing_does_not_hold_up_other_keys(
    stream: StreamFixture, private_rabbit: PrivateRabbit
) -> None:
    """A queue nacked for good (a quorum queue without replicas) keeps its events up to a room
    of their own, then its publishes time out saying why; other keys keep the whole window."""
    from keyq.producer.window import REFUSING_QUEUE_ROOM

    settings = settings_with(stream.settings, amqp_url=private_rabbit.url, publish_timeout=2.0)
    stuck = key_queue_name(stream.name, "stuck")
    other = key_queue_name(stream.name, "other")
    connection = pika.BlockingConnection(pika.URLParameters(private_rabbit.url))
    # A full queue that rejects publishes: the broker nacks every event sent to it.
    private_rabbit.ctl(
        "set_policy",
        "kq-reject",
        f"^{re.escape(stuck)}$",
        '{"max-length": 1, "overflow": "reject-publish"}',
        "--apply-to",
        "queues",
    )
    producer = Producer(stream.name, mode="key", settings=settings, confirm_window=1000)
    try:
        producer.publish("stuck", {"n": 0})
        producer.flush(10)  # the one event the queue takes (sent with others, a pack would be)
        for n in range(1, 5):
            producer.publish("stuck", {"n": n})
        time.sleep(5)  # refused over and over: the producer reconnects and names the queue
        accepted = 5
        with pytest.raises(PublishTimeout) as refused:
            for n in range(5, 2000):
                producer.publish("stuck", {"n": n}, timeout=3.0)
                accepted += 1
        assert "keeps refusing events for" in str(refused.value)
        assert accepted <= REFUSING_QUEUE_ROOM + 1, accepted  # the first got in; not 1,000
        for n in range(600):  # more than the window's room left with the old rule
            producer.publish("other", {"n": n}, timeout=5.0)
        # Declared on the I/O thread, maybe mid-reconnect: the queue can still be missing.
        wait_until(lambda: (events_in(connection, other) or 0) >= 600, 30, "the other key", 0.2)
        private_rabbit.ctl("clear_policy", "kq-reject")
        producer.flush(30)  # the refused events go in now
        # The policy can lift mid re-send, so the queue may hold later events before earlier
        # ones; workers apply by seq: every accepted event once, seq in accepted order.
        landed, _copies = _dedup(drain(connection.channel(), stuck))
        by_seq = sorted(landed, key=lambda message: message.seq)
        assert [(m.seq, m.json()["n"]) for m in by_seq] == [(n + 1, n) for n in range(accepted)]
    finally:
        with contextlib.suppress(Exception):
            private_rabbit.ctl("clear_policy", "kq-reject")
        with contextlib.suppress(KeyqError):
            producer.close(timeout=15)
        channel = connection.channel()
        for queue in (stuck, other):
            channel.queue_delete(queue)
        connection.close()


def _drain_and_delete(
    connection: pika.BlockingConnection, stream: StreamFixture, queues: list[str]
) -> dict[str, list[Landed]]:
    """What landed in each queue of the tests' own node, then deleted with the DLQ."""
    try:
        channel = connection.channel()
        landed = {queue: drain(channel, queue) for queue in queues}
        for queue in queues:
            channel.queue_delete(queue)
        channel.queue_delete(dead_letter_queue_name(stream.name))
    finally:
        connection.close()
    return landed


@contextlib.contextmanager
def _suspended(rabbit: PrivateRabbit, queue: str) -> Iterator[None]:
    """A queue's process suspended on the tests' own node: it takes events, confirms none."""

    def hold(action: str) -> None:
        rabbit.ctl(
            "eval",
            f'{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<"/">>, queue, <<"{queue}">>)),'
            f" sys:{action}(amqqueue:get_pid(Q)).",
        )

    hold("suspend")
    try:
        yield
    finally:
        hold("resume")


def test_a_confirm_that_never_comes_makes_the_producer_send_again(
    stream: StreamFixture, private_rabbit: PrivateRabbit
) -> None:
    """Publishes left unanswered on a healthy connection: past ``confirm_timeout`` the producer
    reconnects and sends them again; all land in order, repeats only as copies."""
    settings = settings_with(stream.settings, amqp_url=private_rabbit.url, confirm_timeout=1.5)
    queue = key_queue_name(stream.name, "stalled")
    connection = pika.BlockingConnection(pika.URLParameters(private_rabbit.url))
    with Producer(stream.name, mode="key", settings=settings) as producer:
        producer.publish("stalled", {"n": 0})
        producer.flush(10)
        with _suspended(private_rabbit, queue):
            for n in range(1, 21):
                producer.publish("stalled", {"n": n})
            # One reconnect; then the stalled queue's own channel is reset, the connection stays.
            wait_until(
                lambda: min(
                    producer.stats["overdue_reconnects"], producer.stats["stalled_channel_resets"]
                ),
                15,
                "a reconnect and a channel reset for overdue confirms",
            )
            assert producer.stats["overdue_reconnects"] == 1, producer.stats
            assert producer.stats["unconfirmed"] == 20
        producer.flush(20)
        producer_id = producer.producer_id
    landed = _drain_and_delete(connection, stream, [queue])[queue]
    unique, copies = _dedup(landed)
    assert {m.producer for m in landed} == {producer_id}
    assert [m.json()["n"] for m in unique] == list(range(21))
    assert [m.seq for m in unique] == list(range(1, 22))
    assert copies >= 20, copies  # sent at least twice while the queue was stalled


def test_a_stalled_queue_does_not_hold_up_the_other_keys(
    stream: StreamFixture, private_rabbit: PrivateRabbit
) -> None:
    """A stalled queue exhausts the connection's credit; once overdue it gets a channel of its
    own (reset, not reconnected, while stalled) and the other keys flow on."""
    # Packing off: packs would be too few messages to exhaust the queue's credit.
    settings = settings_with(
        stream.settings, amqp_url=private_rabbit.url, confirm_timeout=2.0, pack_max_events=1
    )
    stalled = key_queue_name(stream.name, "stalled")
    other = key_queue_name(stream.name, "other")
    connection = pika.BlockingConnection(pika.URLParameters(private_rabbit.url))
    with Producer(stream.name, mode="key", settings=settings) as producer:
        for key in ("stalled", "other"):
            producer.publish(key, {"n": 0})
        producer.flush(10)
        with _suspended(private_rabbit, stalled):
            for n in range(1, 1001):  # past the queue's credit: the connection stops being read
                producer.publish("stalled", {"n": n}, timeout=60)
            for n in range(1, 51):
                producer.publish("other", {"n": n}, timeout=60)
            wait_until(lambda: (events_in(connection, other) or 0) >= 51, 60, "the other key", 0.2)
            assert producer.stats["overdue_reconnects"] >= 1, producer.stats
            reconnects = producer.stats["overdue_reconnects"]
            time.sleep(3 * 2.0)  # several confirm timeouts with the queue still stalled
            assert producer.stats["overdue_reconnects"] == reconnects, producer.stats
            assert producer.stats["stalled_channel_resets"] >= 1, producer.stats
            assert producer.unconfirmed_by_queue.get(stalled, 0) == 1000
        producer.flush(60)
        producer_id = producer.producer_id
    landed = _drain_and_delete(connection, stream, [stalled, other])
    for queue, count in ((stalled, 1001), (other, 51)):
        unique, _copies = _dedup(landed[queue])
        assert {m.producer for m in landed[queue]} == {producer_id}
        assert [m.json()["n"] for m in unique] == list(range(count)), queue


def test_a_declaration_left_unanswered_does_not_hold_up_other_new_keys(
    stream: StreamFixture, private_rabbit: PrivateRabbit
) -> None:
    """Declarations queued behind a stuck queue's are asked again elsewhere once it is
    overdue: other new keys land meanwhile, the stuck key's in order once it answers."""
    settings = settings_with(stream.settings, amqp_url=private_rabbit.url, confirm_timeout=1.5)
    stuck = key_queue_name(stream.name, "stuck")
    fresh = [f"fresh-{n}" for n in range(40)]
    connection = pika.BlockingConnection(pika.URLParameters(private_rabbit.url))
    with Producer(stream.name, mode="key", settings=settings) as first:
        first.publish("stuck", {"n": 0})
        first.flush(10)

    def landed(key: str) -> int:
        found = events_in(connection, key_queue_name(stream.name, key))
        return -1 if found is None else found  # None: not declared yet

    producer: Producer | None = None
    try:
        with _suspended(private_rabbit, stuck):
            producer = Producer(stream.name, mode="key", settings=settings)
            for n in range(1, 4):
                producer.publish("stuck", {"n": n})
            for n in range(3):
                for key in fresh:
                    producer.publish(key, {"n": n})
            wait_until(lambda: [landed(k) for k in fresh] == [3] * len(fresh), 15, "new keys", 0.2)
        producer.flush(20)
        producer_id = producer.producer_id
    finally:
        if producer is not None:
            with contextlib.suppress(KeyqError):
                producer.close(timeout=15)
    queues = [stuck, *(key_queue_name(stream.name, key) for key in fresh)]
    everything = _drain_and_delete(connection, stream, queues)
    unique, _copies = _dedup([m for m in everything[stuck] if m.producer == producer_id])
    assert [m.json()["n"] for m in unique] == [1, 2, 3]
    for key in fresh:
        got, _ = _dedup(everything[key_queue_name(stream.name, key)])
        assert [m.json()["n"] for m in got] == [0, 1, 2], key


def test_a_queue_whose_probe_is_cut_off_while_its_channel_opens_is_probed_again(
    stream: StreamFixture, amqp: pika.BlockingConnection, proxy: FaultProxy
) -> None:
    """A connection lost while a probe's channel opens (held by the proxy, then cut): the next
    connection probes again, or the queue's events wait for good."""
    queue = key_queue_name(stream.name, "probed")
    with _through_proxy(stream, proxy, publish_timeout=15) as producer:
        producer.publish("probed", {"n": 1})
        producer.flush(10)
        link = producer._link
        probing = threading.Event()

        def probe_while_paused() -> None:
            # As ``_on_channel_closed`` does on a 404 "down or inaccessible".
            link.probes.mark_unreachable(queue, "404 down")
            link.lanes[queue].wait(WaitReason.UNREACHABLE)
            link.probes.probe(queue, link.ctx.queue_args)
            probing.set()

        proxy.pause()
        link.ctx.ioloop.add_callback_threadsafe(probe_while_paused)
        assert probing.wait(5)
        producer.publish("probed", {"n": 2})  # waits for the probe: the queue is unreachable
        time.sleep(0.2)
        proxy.cut()
        proxy.resume()
        producer.flush(15)
        assert proxy.wait_connections(1, 5)
        producer_id = producer.producer_id
    unique, _copies = _dedup(drain(amqp.channel(), queue))
    assert [(m.producer, m.json()["n"]) for m in unique] == [(producer_id, 1), (producer_id, 2)]
