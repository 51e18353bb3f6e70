"""A worker's /readyz and /livez, on a real worker process: not ready while RabbitMQ refuses
it, ready once its first claim round is done; not live while its claim loop is stuck on a
Redis that stopped answering, live again when Redis answers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from keyq import Producer
from keyq.broker.settings import Settings
from tests.conftest import StreamFixture
from tests.faults import FaultProxy
from tests.scrapes import scrape
from tests.servers import free_port
from tests.workers import wait_until


def _proxy(url: str, default_port: int) -> FaultProxy:
    parts = urlsplit(url)
    return FaultProxy(parts.hostname or "127.0.0.1", parts.port or default_port).start()


def _status(port: int, path: str) -> int | None:
    try:
        return scrape(port, path)[0]
    except OSError:
        return None  # not serving yet


def _holds(check: Callable[[], bool], seconds: float) -> bool:
    """``check`` stays true for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not check():
            return False
        time.sleep(0.2)
    return True


def test_readyz_waits_for_the_first_claim_round_and_livez_for_a_turning_claim_loop(
    settings: Settings, stream: StreamFixture, producer: Producer, workers: Any
) -> None:
    producer.publish("k-1", {"n": 1})  # the stream exists: the worker has one to serve
    producer.flush(30)
    amqp = _proxy(settings.amqp_url, 5672)
    redis_proxy = _proxy(settings.redis_url, 6379)
    port = free_port()
    try:
        amqp.refuse(True)
        worker = workers(
            stream.name,
            env={
                "KEYQ_AMQP_URL": amqp.url_for(settings.amqp_url),
                "KEYQ_REDIS_URL": redis_proxy.url_for(settings.redis_url),
                "KEYQ_METRICS_PORT": str(port),
                "KEYQ_METRICS_HOST": "127.0.0.1",
                # A stalled Redis holds a call this long: the claim loop stops turning.
                "KEYQ_CONNECT_TIMEOUT": "30",
            },
        )
        wait_until(lambda: _status(port, "/readyz") is not None, 60, "the metrics endpoint")
        # RabbitMQ refuses the worker: it serves nothing, and says so, yet is alive.
        assert _holds(lambda: _status(port, "/readyz") == 503, 3)
        assert _status(port, "/livez") == 200 and _status(port, "/healthz") == 200
        assert _status(port, "/metrics") == 200

        amqp.refuse(False)
        worker.wait_ready(120)  # its first claim round, as Redis records it
        assert _status(port, "/readyz") == 200
        assert _status(port, "/livez") == 200

        redis_proxy.pause()  # every Redis call now hangs: the claim loop's heartbeat too
        paused = time.monotonic()
        wait_until(lambda: _status(port, "/livez") == 503, 15, "livez to fail")
        # Not before the lock ttl (2 s here): a slow tick is no dead loop.
        assert time.monotonic() - paused >= 1.5
        assert _status(port, "/healthz") == 503

        redis_proxy.resume()
        wait_until(lambda: _status(port, "/livez") == 200, 45, "livez to recover")
        wait_until(lambda: _status(port, "/readyz") == 200, 45, "readyz after the stall")
    finally:
        amqp.stop()
        redis_proxy.stop()
