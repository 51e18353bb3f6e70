"""keyq on Redis Cluster and under Sentinel (tests/redis_topologies.py), with the primary
holding a stream killed -9: the audit pipeline's state of every key is checked against what
was published (none lost, out of order or twice).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
import redis
import redis.cluster

from keyq import Producer
from keyq.broker.connections import open_redis
from keyq.broker.errors import ConfigurationError
from keyq.broker.naming import key_queue_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.redis_topology import parse_redis_url
from keyq.broker.settings import Settings, load_settings
from keyq.worker.batch.state_store import StateStore
from keyq.worker.config import WorkerSettings
from keyq.worker.daemon import Worker
from keyq.worker.spark.engine import SparkEngine
from tests.conftest import TEST_STREAM_PREFIX, StreamFixture
from tests.helpers import queue_depth
from tests.redis_topologies import (
    RedisClusterServers,
    RedisSentinelServers,
    redis_topologies_available,
)
from tests.workers import wait_until

KEYS = [f"dev-{i}" for i in range(12)]
PER_KEY = 120
BUCKETS: dict[str, int | None] = {"key": None, "bucket": 4}


# ---- URLs and slots (pure logic) ---------------------------------------------------------


def test_cluster_and_sentinel_urls_are_read_and_bad_ones_refused_without_the_password() -> None:
    cluster = parse_redis_url("redis+cluster://u:s3cret@10.0.0.1:7000,10.0.0.2,[::1]:7002")
    assert cluster.kind == "cluster" and cluster.password == "s3cret"
    assert cluster.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    sentinel = parse_redis_url("rediss+sentinel://h1:26380,h2/primary-a/2")
    read = (sentinel.kind, sentinel.service, sentinel.db, sentinel.tls)
    assert read == ("sentinel", "primary-a", 2, True)
    assert sentinel.nodes == (("h1", 26380), ("h2", 26379))
    for bad in (
        "redis+sentinel://:s3cret@h1:26379",  # no service
        "redis+cluster://:s3cret@h1:7000/3",  # a cluster has db 0 only
        "redis+cluster://:s3cret@h1:notaport",
        "redis+cluster://:s3cret@",
        "memcached://:s3cret@h1",
    ):
        with pytest.raises(ConfigurationError) as caught:
            load_settings(redis_url=bad)
        assert "s3cret" not in str(caught.value), bad


def test_every_key_of_a_stream_is_in_one_cluster_slot() -> None:
    """Scripts and pipelines touch several keys of a stream at once: a cluster refuses that
    (CROSSSLOT) unless all are in one slot."""
    for stream in ("orders", "a", "x-y_z", "0" * 64):
        keys = StreamKeys(stream)
        properties = [n for n in dir(StreamKeys) if isinstance(getattr(StreamKeys, n), property)]
        names = [getattr(keys, name) for name in properties]
        names += [keys.lock("keyq.q.k.a"), keys.retiring("keyq.q.k.b"), keys.lock_prefix + "c"]
        assert len(names) > 10
        slots = {redis.cluster.key_slot(name.encode()) for name in names}
        assert slots == {redis.cluster.key_slot(keys.config.encode())}, stream


# ---- the topologies, live ----------------------------------------------------------------

_MISSING = redis_topologies_available()
needs_servers = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterServers]:
    with RedisClusterServers(tmp_path / "redis-cluster") as servers:
        yield servers


@pytest.fixture
def redis_sentinel(tmp_path: Path) -> Iterator[RedisSentinelServers]:
    with RedisSentinelServers(tmp_path / "redis-sentinel") as servers:
        yield servers


def _stream_on(settings: Settings, name: str | None = None) -> StreamFixture:
    return StreamFixture(
        name=name or f"{TEST_STREAM_PREFIX}{uuid.uuid4().hex[:12]}",
        settings=settings,
        redis=open_redis(settings),
    )


def _publish_paced(producers: dict[str, Producer], seconds: float) -> threading.Thread:
    """Every key's events 1..PER_KEY on every stream, spread over ``seconds``."""

    def publish() -> None:
        pause = seconds / PER_KEY
        for n in range(1, PER_KEY + 1):
            for producer in producers.values():
                for key in KEYS:
                    producer.publish(key, {"n": n, "producer": "p"})
            time.sleep(pause)
        for producer in producers.values():
            producer.flush(120)

    thread = threading.Thread(target=publish, name="paced-publisher")
    thread.start()
    return thread


def _applied(stores: list[StateStore]) -> int:
    try:
        return sum((s.get(key) or {"applied": 0})["applied"] for s in stores for key in KEYS)
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException):
        return 0


def _check_every_key(streams: dict[str, StreamFixture]) -> None:
    """Wait for every event to be applied, then: none lost, none twice, none reordered."""
    stores = {mode: StateStore(s.redis, s.name) for mode, s in streams.items()}
    wanted = len(stores) * len(KEYS) * PER_KEY
    try:
        wait_until(
            lambda: _applied(list(stores.values())) >= wanted, 180, "every event applied", 0.5
        )
    finally:
        expected = {"applied": PER_KEY, "last": {"p": PER_KEY}, "violations": []}
        for mode, store in stores.items():
            for key in KEYS:
                assert store.get(key) == expected, f"{mode} {key}: {store.get(key)}"


def _run_with_a_primary_killed(
    url: str,
    workers: Any,
    kill_primary: Callable[[list[StreamFixture]], float],
    bucket_name: Callable[[StreamFixture], str] = lambda _key_stream: "",
) -> float:
    """Both modes, a worker each; the streams' primary killed -9 a third of the way: the
    failover's seconds."""
    settings = load_settings(redis_url=url)
    key_stream = _stream_on(settings)
    streams = {"key": key_stream, "bucket": _stream_on(settings, bucket_name(key_stream) or None)}
    try:
        running = [
            workers(s.name, mode=mode, buckets=BUCKETS[mode], env={"KEYQ_REDIS_URL": url})
            for mode, s in streams.items()
        ]
        for worker in running:
            worker.wait_ready(150)
        producers = {
            mode: Producer(s.name, mode=mode, buckets=BUCKETS[mode], settings=settings)
            for mode, s in streams.items()
        }
        publisher = _publish_paced(producers, seconds=12)
        stores = [StateStore(s.redis, s.name) for s in streams.values()]
        third = len(stores) * len(KEYS) * PER_KEY // 3
        wait_until(lambda: _applied(stores) >= third, 90, "a third of the events applied", 0.2)
        took = kill_primary(list(streams.values()))
        publisher.join(180)
        assert not publisher.is_alive(), "publishing did not finish"
        for producer in producers.values():
            producer.close()
        _check_every_key(streams)
        for worker in running:
            assert worker.process.poll() is None, worker.log()[-3000:]
        return took
    finally:
        for s in streams.values():
            s.track(*(key_queue_name(s.name, key) for key in KEYS))
            s.cleanup()


@pytest.mark.slow
@needs_servers
def test_both_modes_keep_every_event_when_the_cluster_primary_of_their_slot_is_killed(
    redis_cluster: RedisClusterServers, workers: Any
) -> None:
    def same_primary(key_stream: StreamFixture) -> str:
        """A bucket stream whose slot the same primary serves, so one kill hits both."""
        wanted = redis_cluster.primary_for(key_stream.keys.config)
        while True:
            name = f"{TEST_STREAM_PREFIX}{uuid.uuid4().hex[:12]}"
            if redis_cluster.primary_for(StreamKeys(name).config) is wanted:
                return name

    def kill(streams: list[StreamFixture]) -> float:
        old, took = redis_cluster.kill_primary_of(streams[0].keys.config)
        # The promoted replica has no replica of its own: commits wait (nothing acked)
        # until the old primary is back, as its replica.
        time.sleep(3)
        redis_cluster.restart(old)
        return took

    took = _run_with_a_primary_killed(redis_cluster.url, workers, kill, same_primary)
    print(f"cluster failover took {took:.1f}s")


@pytest.mark.slow
@needs_servers
def test_both_modes_keep_every_event_when_the_sentinel_primary_is_killed(
    redis_sentinel: RedisSentinelServers, workers: Any
) -> None:
    def kill(_streams: list[StreamFixture]) -> float:
        _old, took = redis_sentinel.kill_primary()
        return took

    took = _run_with_a_primary_killed(redis_sentinel.url, workers, kill)
    print(f"sentinel failover took {took:.1f}s")


@pytest.mark.slow
@needs_servers
@pytest.mark.parametrize("min_replicas", [0, None], ids=["WAIT off", "WAIT by default"])
def test_a_primary_killed_before_its_replicas_have_a_commit(
    min_replicas: int | None,
    redis_sentinel: RedisSentinelServers,
    spark_engine: SparkEngine,
) -> None:
    """A commit its replicas never saw, then the primary killed -9: without WAIT the events
    were acked and are gone; with WAIT (the default) they are applied again on the new one."""
    settings = load_settings(redis_url=redis_sentinel.url)
    stream = _stream_on(settings)
    key = "acct"
    queue = key_queue_name(stream.name, key)
    stream.track(queue)
    fast = {"lock_ttl_ms": 2000, "member_ttl_ms": 2000, "tick_ms": 200, "scan_interval_ms": 500}
    fast.update(batch_max_ms=200, redis_replica_timeout_ms=500)
    serve = load_settings(
        WorkerSettings, redis_url=redis_sentinel.url, redis_min_replicas=min_replicas, **fast
    )
    worker = Worker(
        stream.name, "tests.pipelines:audit", mode="key", settings=serve, engine=spark_engine
    )
    serving = threading.Thread(target=worker.run, name="worker")
    serving.start()
    try:
        assert worker.ready.wait(60), "the worker did not start"
        redis_sentinel.cut_off_replicas()
        with Producer(stream.name, mode="key", settings=settings) as producer:
            for n in range(1, 41):
                producer.publish(key, {"n": n, "producer": "p"})
            producer.flush(30)
        store = StateStore(stream.redis, stream.name)
        wait_until(lambda: (store.get(key) or {}).get("applied") == 40, 60, "the commit")
        if min_replicas == 0:
            wait_until(lambda: worker.stats()["events"] == 40, 30, "the acks")
        else:
            wait_until(lambda: worker.stats()["commits_unreplicated"] >= 1, 30, "a WAIT")
        redis_sentinel.kill_primary(thaw_replicas=True)
        if min_replicas == 0:
            time.sleep(5)  # time for anything that could come back to come back
        else:
            wait_until(
                lambda: (_state_of(stream, key) or {}).get("applied") == 40,
                120,
                "the events applied again on the new primary",
                every=0.5,
            )
            wait_until(lambda: worker.stats()["events"] == 40, 60, "the acks")
        state = _state_of(stream, key)
    finally:
        worker.stop()
        serving.join(60)
    try:
        with pika.BlockingConnection(pika.URLParameters(stream.settings.amqp_url)) as amqp:
            assert queue_depth(amqp, queue) == 0  # every event acked before the worker stopped
        if min_replicas == 0:
            # The failure WAIT prevents: acked, then lost with the primary.
            assert state is None, state
        else:
            assert state == {"applied": 40, "last": {"p": 40}, "violations": []}, state
    finally:
        stream.cleanup()


def _state_of(stream: StreamFixture, key: str) -> Any:
    for _ in range(50):
        try:
            return StateStore(stream.redis, stream.name).get(key)
        except redis.exceptions.RedisError:
            time.sleep(0.2)
    raise AssertionError("Redis did not answer after the failover")
