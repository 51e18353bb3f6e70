"""A connection drop with many held queues, while Redis is slow: the AMQP I/O thread, which
must keep heartbeats and deliveries moving, never waits on Redis for the locks of the
consumers it lost; the claim loop releases them, all of them, in one round trip."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from keyq import Producer
from keyq.broker.locks import FencedLocks, Lease
from keyq.broker.naming import key_queue_name
from keyq.broker.settings import load_settings
from keyq.worker.config import WorkerSettings
from keyq.worker.daemon import Worker
from keyq.worker.spark.engine import SparkEngine
from tests.conftest import StreamFixture
from tests.faults import FaultProxy
from tests.workers import wait_until

pytestmark = pytest.mark.slow

KEYS = 120
REDIS_DELAY_S = 0.05  # each way, per chunk: a Redis round trip takes over 100 ms
# Waiting on Redis per lost consumer would stall the I/O loop for KEYS round trips (12 s); a
# quarter of that leaves room for a loaded machine's pauses, which reached 1.07 s.
LOOP_GAP_LIMIT_S = KEYS * 2 * REDIS_DELAY_S / 4


@pytest.fixture
def proxies(stream: StreamFixture) -> Iterator[tuple[FaultProxy, FaultProxy]]:
    amqp, redis = (urlsplit(url) for url in (stream.settings.amqp_url, stream.settings.redis_url))
    with FaultProxy("127.0.0.1", amqp.port or 5672) as a, FaultProxy("127.0.0.1", redis.port) as r:
        yield a, r


def test_a_connection_drop_with_many_held_queues_does_not_stall_the_io_loop_on_slow_redis(
    stream: StreamFixture,
    producer: Producer,
    spark_engine: SparkEngine,
    proxies: tuple[FaultProxy, FaultProxy],
) -> None:
    amqp_proxy, redis_proxy = proxies
    keys = [f"dev-{n:03d}" for n in range(KEYS)]
    queues = [key_queue_name(stream.name, key) for key in keys]
    for key in keys:
        producer.publish(key, {"n": 1, "producer": "p"})
    producer.flush(timeout=60)

    settings = load_settings(
        WorkerSettings,
        amqp_url=amqp_proxy.url_for(stream.settings.amqp_url),
        redis_url=redis_proxy.url_for(stream.settings.redis_url),
        # Locks that outlive the test: a lock found gone was released, not expired.
        lock_ttl_ms=120_000,
        member_ttl_ms=10_000,
        tick_ms=200,
        scan_interval_ms=500,
        idle_release_ms=600_000,
        batch_max_ms=200,
    )
    worker = Worker(
        stream.name, "tests.pipelines:audit", mode="key", settings=settings, engine=spark_engine
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    locks = FencedLocks(stream.redis, stream.name)
    try:
        wait_until(lambda: len(worker.held) == KEYS, 90, f"the worker to hold all {KEYS} queues")
        wait_until(lambda: worker.stats()["events"] == KEYS, 60, "every event to be applied")
        before: dict[str, Lease | None] = locks.holders(queues)
        assert all(lease is not None for lease in before.values())
        session = worker._session
        assert session is not None
        link = session.link

        redis_proxy.set_delay(REDIS_DELAY_S)
        link.reset_loop_gap()
        cut_at = time.monotonic()
        amqp_proxy.cut()

        def released() -> bool:
            now = locks.holders(queues)
            return all(now[queue] != before[queue] for queue in queues)

        wait_until(released, 30, "the lost consumers' locks to be released", every=0.05)
        took = time.monotonic() - cut_at
        # The gap is known once the I/O thread is back in its loop: connected again.
        wait_until(lambda: link.connected, 30, "the link to reconnect", every=0.05)
        wait_until(lambda: len(worker.held) == KEYS, 60, "the queues to be held again")
        gap = link.max_loop_gap_s
        print(f"locks released {took:.2f} s after the cut; longest I/O loop gap {gap:.3f} s")
        assert gap < LOOP_GAP_LIMIT_S, (
            f"the I/O loop stalled {gap:.2f} s: it waited on Redis for {KEYS} lost consumers"
        )
        assert worker.stats()["lost"] >= KEYS
    finally:
        redis_proxy.set_delay(0)
        worker.stop()
        thread.join(60)
    assert not thread.is_alive()
