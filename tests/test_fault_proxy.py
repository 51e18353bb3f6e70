"""The fault-injection proxy itself, against the real Redis, with clients whose retries are
off (a retry would hide the fault): fault tests elsewhere trust it to do what it says."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from keyq.broker.settings import Settings
from tests.faults import FaultProxy

ClientFactory = Callable[..., "redis.Redis"]
LOGGER = FaultProxy.__module__


@pytest.fixture
def upstream(settings: Settings) -> tuple[str, int]:
    parts = urlsplit(settings.redis_url)
    return parts.hostname or "localhost", parts.port or 6379


@pytest.fixture
def proxy(caplog: pytest.LogCaptureFixture, upstream: tuple[str, int]) -> Iterator[FaultProxy]:
    """A started proxy to Redis; fails the test if its thread logged anything."""
    with caplog.at_level(logging.WARNING, logger=LOGGER), FaultProxy(*upstream) as fp:
        yield fp
    assert not [r for r in caplog.records if r.name == LOGGER]


@pytest.fixture
def client(proxy: FaultProxy, settings: Settings) -> Iterator[ClientFactory]:
    """Factory for clients through ``proxy`` with retries disabled."""
    made: list[redis.Redis] = []

    def make(socket_timeout: float = 0.5, single: bool = False) -> redis.Redis:
        c = redis.Redis.from_url(
            proxy.url_for(settings.redis_url),
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            single_connection_client=single,
        )
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_forwards_commands_and_a_client_closing_closes_upstream(
    client: ClientFactory, proxy: FaultProxy
) -> None:
    r, key = client(), f"keyq-test-proxy:{uuid.uuid4()}"
    assert r.ping() is True
    r.set(key, b"v" * 200_000, ex=60)  # larger than one chunk
    assert r.get(key) == b"v" * 200_000
    assert r.delete(key) == 1
    assert proxy.wait_connections(1)
    r.close()
    assert proxy.wait_connections(0), "the upstream side stayed open"


def test_pause_holds_bytes_and_resume_delivers_them_in_order(
    client: ClientFactory, proxy: FaultProxy
) -> None:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=2) as s:
        s.sendall(b"PING\r\n")
        assert s.recv(64) == b"+PONG\r\n"
        proxy.pause()
        s.sendall(b"ECHO a\r\nECHO b\r\n")
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            s.recv(64)
        assert proxy.connections == 1
        proxy.resume()
        s.settimeout(2)
        got = b""
        while len(got) < len(b"$1\r\na\r\n$1\r\nb\r\n"):
            chunk = s.recv(64)
            assert chunk, "proxy closed the connection"
            got += chunk
        assert got == b"$1\r\na\r\n$1\r\nb\r\n"
    assert client().ping(), "a new connection after resume"


def test_cut_resets_existing_connections_with_rst(client: ClientFactory, proxy: FaultProxy) -> None:
    # A pinned connection: the pool would silently replace a dead idle one.
    r = client(single=True)
    assert r.ping()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=2) as s:
        assert proxy.wait_connections(2)
        proxy.cut()
        assert proxy.connections == 0
        with pytest.raises(ConnectionResetError):
            s.recv(64)
    with pytest.raises(redis.ConnectionError):
        r.ping()
    assert client().ping()  # still accepting
    assert proxy.wait_connections(1)


def test_refuse_rejects_new_connections_only(client: ClientFactory, proxy: FaultProxy) -> None:
    existing = client()
    assert existing.ping()
    proxy.refuse()
    with pytest.raises(redis.ConnectionError):
        client().ping()
    assert existing.ping()
    assert proxy.connections == 1
    proxy.refuse(False)
    assert client().ping()


def test_delay_adds_latency(client: ClientFactory, proxy: FaultProxy) -> None:
    # The request and the reply are each held a second: a round trip of two at least, and a
    # socket timeout well past that, so that a loaded machine's scheduling does not count.
    r = client(socket_timeout=10)
    assert r.ping()
    proxy.set_delay(1.0)
    start = time.monotonic()
    assert r.ping()
    assert time.monotonic() - start >= 1.95
    proxy.set_delay(0)
    start = time.monotonic()
    assert r.ping()
    assert time.monotonic() - start < 0.5  # a loaded machine's round trip, not the delay
    with pytest.raises(ValueError):
        proxy.set_delay(-1)


def test_stop_is_idempotent_and_quiet(
    capfd: pytest.CaptureFixture[str], upstream: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    errors: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    fp = FaultProxy(*upstream).start()
    s = socket.create_connection(("127.0.0.1", fp.port), timeout=2)
    assert fp.wait_connections(1)
    fp.pause()
    s.sendall(b"PING\r\n")
    fp.stop()
    fp.stop()
    assert fp.connections == 0
    with pytest.raises(ConnectionResetError):
        s.recv(64)
    s.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", fp.port), timeout=1).close()
    with pytest.raises(RuntimeError):
        fp.start()
    fp.cut()  # harmless after stop
    FaultProxy(*upstream).stop()  # never started
    assert not errors
    assert capfd.readouterr().err == ""


def test_rejects_non_loopback_addresses_and_url_for_rewrites_host_and_port_only() -> None:
    with pytest.raises(ValueError, match="non-loopback"):
        FaultProxy("10.255.255.1", 6379)
    with pytest.raises(ValueError, match="non-loopback"):
        FaultProxy("127.0.0.1", 6379, listen_host="0.0.0.0")
    fp = FaultProxy("127.0.0.1", 1)  # never started: nothing connects
    try:
        p = fp.port
        assert (
            fp.url_for("amqp://guest:guest@rabbit.example:5672/%2F?heartbeat=5")
            == f"amqp://guest:guest@127.0.0.1:{p}/%2F?heartbeat=5"
        )
        assert fp.url_for("amqps://u:p%40ss@mq/vh") == f"amqps://u:p%40ss@127.0.0.1:{p}/vh"
        assert fp.url_for("redis://:secret@localhost:6379/2") == f"redis://:secret@127.0.0.1:{p}/2"
        assert fp.url_for("redis://[::1]:6380") == f"redis://127.0.0.1:{p}"
        assert fp.url_for("rediss://user@h/0?ssl_cert_reqs=none") == (
            f"rediss://user@127.0.0.1:{p}/0?ssl_cert_reqs=none"
        )
        with pytest.raises(ValueError):
            fp.url_for("http://example/")
    finally:
        fp.stop()
