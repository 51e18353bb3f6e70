"""Rebalancing: a new worker gets its fair share quickly, a stopped one hands everything back
cleanly and in bounded time, and in-process callbacks see each queue come and go."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import pika
import pytest

from keyq import Producer
from keyq.broker.errors import KeyqError
from keyq.broker.locks import FencedLocks
from keyq.broker.naming import bucket_queue_name, key_queue_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.registry import QueueRegistry
from keyq.worker.amqp.link import RESERVED_CHANNELS
from keyq.worker.batch.state_store import StateStore
from keyq.worker.daemon import Worker
from keyq.worker.holding.handbacks import RELEASE_COOLDOWN_S
from keyq.worker.spark.engine import SparkEngine
from tests.conftest import StreamFixture
from tests.helpers import drain
from tests.test_worker_poison import fast_settings
from tests.workers import held_by, wait_until

pytestmark = pytest.mark.slow


def publish_rounds(producer: Producer, keys: list[str], numbers: range, flush: float = 30) -> None:
    for n in numbers:
        for key in keys:
            producer.publish(key, {"n": n, "producer": "p"})
    producer.flush(timeout=flush)


def states_problems(store: StateStore, keys: list[str], per_key: int) -> dict[str, Any]:
    wanted = {"applied": per_key, "last": {"p": per_key}, "violations": []}
    return {key: state for key in keys if (state := store.get(key)) != wanted}


def wait_exactly_once(store: StateStore, keys: list[str], per_key: int, timeout: float) -> None:
    def done() -> bool:
        return all((store.get(k) or {"applied": 0})["applied"] >= per_key for k in keys)

    with suppress(AssertionError):
        wait_until(done, timeout, "every event to be applied", every=0.3)
    problems = states_problems(store, keys, per_key)
    assert not problems, f"{len(problems)} keys wrong: {dict(list(problems.items())[:5])}"


def holding(stream: StreamFixture) -> dict[str, list[str]]:
    return held_by(stream.redis, stream.name)


def held_count(stream: StreamFixture, worker_id: str) -> int:
    return len(holding(stream).get(worker_id, []))


def shares(stream: StreamFixture) -> dict[str, int]:
    return {owner: len(queues) for owner, queues in holding(stream).items()}


@pytest.fixture
def bucket_producer(stream: StreamFixture) -> Iterator[Callable[[int], Producer]]:
    """Bucket-mode producers on the test's stream, closed at the end."""
    made: list[Producer] = []

    def make(buckets: int) -> Producer:
        options = {"mode": "bucket", "settings": stream.settings, "publish_timeout": 20}
        made.append(Producer(stream.name, buckets=buckets, **options))
        return made[-1]

    yield make
    for producer in made:
        with suppress(KeyqError):
            producer.close(timeout=5)


def test_a_third_worker_gets_its_fair_share_quickly(
    stream: StreamFixture, workers: Any, bucket_producer: Callable[[int], Producer]
) -> None:
    buckets = 12
    keys = [f"acct-{i:03d}" for i in range(200)]
    producer = bucket_producer(buckets)
    publish_rounds(producer, keys, range(1, 4))
    registry = QueueRegistry(stream.redis, stream.name)
    assert registry.count() == buckets
    queues = {bucket_queue_name(stream.name, b) for b in range(buckets)}
    assert set(registry.queues()) == queues

    options = {"mode": "bucket", "buckets": buckets}
    first = workers(stream.name, **options)
    second = workers(stream.name, **options)
    first.wait_ready()
    second.wait_ready()
    halves = {first.worker_id: 6, second.worker_id: 6}
    wait_until(lambda: shares(stream) == halves, 30, "two workers to hold 6 queues each")

    started = time.monotonic()
    third = workers(stream.name, **options).wait_ready()
    ready = time.monotonic()
    expected = {first.worker_id: 4, second.worker_id: 4, third.worker_id: 4}
    try:
        wait_until(lambda: shares(stream) == expected, 10, "4/4/4", every=0.05)
    except AssertionError:
        now = shares(stream)
        raise AssertionError(f"not balanced 10s after the third worker was ready: {now}") from None
    balanced = time.monotonic()
    print(f"third worker: ready {ready - started:.1f}s, balanced {balanced - ready:.2f}s after")
    assert set().union(*holding(stream).values()) == queues

    publish_rounds(producer, keys, range(4, 8))
    store = StateStore(stream.redis, stream.name)
    wait_exactly_once(store, keys, 7, timeout=60)
    for process in (first, second, third):
        assert process.process.poll() is None, process.log()[-3000:]


def test_sigterm_finishes_the_batch_and_hands_everything_back(
    stream: StreamFixture,
    workers: Any,
    bucket_producer: Callable[[int], Producer],
    amqp: pika.BlockingConnection,
    tmp_path: Path,
) -> None:
    buckets = 4
    shutdown_timeout = 15.0
    keys = [f"user-{i:02d}" for i in range(40)]
    per_key = 10
    producer = bucket_producer(buckets)
    marker = tmp_path / "batch-marker"
    env = {"KEYQ_TEST_BATCH_MARKER": str(marker), "KEYQ_TEST_BATCH_PAUSE": "1.0"}
    env |= {"KEYQ_SHUTDOWN_TIMEOUT": str(shutdown_timeout), "KEYQ_BATCH_MAX_EVENTS": "50"}
    # Long ttls: only an explicit release can clear its locks and membership in time.
    env |= {"KEYQ_LOCK_TTL_MS": "60000", "KEYQ_MEMBER_TTL_MS": "60000"}
    slow = "tests.pipelines:audit_slow"
    worker = workers(stream.name, mode="bucket", buckets=buckets, pipeline=slow, env=env)
    worker.wait_ready()
    publish_rounds(producer, keys, range(1, per_key + 1))
    queues = sorted(bucket_queue_name(stream.name, b) for b in range(buckets))
    mine = lambda: sorted(holding(stream).get(worker.worker_id, []))  # noqa: E731
    wait_until(lambda: mine() == queues, 20, "the worker to hold every queue")
    keys_of = StreamKeys(stream.name)
    assert stream.redis.zscore(keys_of.members, worker.worker_id) is not None
    assert stream.redis.hexists(keys_of.member_info, worker.worker_id)

    wait_until(marker.exists, 30, "a batch in flight", every=0.02)
    signalled = time.monotonic()
    code = worker.terminate(timeout=shutdown_timeout + 30)
    took = time.monotonic() - signalled
    print(f"SIGTERM to exit: {took:.2f}s (exit code {code})")
    log = worker.log()
    assert code == 0, log[-3000:]
    assert took < shutdown_timeout, log[-3000:]
    assert "stopped" in log

    # Locks released, membership gone, at once (the ttls are a minute long).
    assert worker.worker_id not in holding(stream)
    assert holding(stream) == {}
    assert stream.redis.zscore(keys_of.members, worker.worker_id) is None
    assert not stream.redis.hexists(keys_of.member_info, worker.worker_id)

    # The batch in flight was committed and acked; nothing was lost or applied twice.
    store = StateStore(stream.redis, stream.name)
    applied: dict[str, int] = {}
    for key in keys:
        state = store.get(key) or {"applied": 0, "last": {}, "violations": []}
        count = state["applied"]
        applied[key] = count
        assert state["violations"] == [], (key, state)
        assert state["last"] == ({"p": count} if count else {}), (key, state)
        assert store.get_marks(key).applied == count, key
    assert sum(applied.values()) > 0, "the batch in flight was not committed"

    def left() -> int:
        """Events back in their queues, not applied yet (a pack goes back whole)."""
        channel = amqp.channel()
        try:
            events = [event for queue in queues for event in drain(channel, queue, ack=False)]
            return sum(1 for event in events if event.seq > applied[event.key])
        finally:
            channel.close()  # what was read goes back, in order

    total = len(keys) * per_key
    back = lambda: left() + sum(applied.values()) == total  # noqa: E731
    wait_until(back, 10, "unprocessed events to be back in their queues")


def test_in_process_callbacks_see_assignments_and_revocations(
    stream: StreamFixture,
    workers: Any,
    bucket_producer: Callable[[int], Producer],
    spark_engine: SparkEngine,
) -> None:
    buckets = 4
    keys = [f"dev-{i:02d}" for i in range(40)]
    producer = bucket_producer(buckets)
    publish_rounds(producer, keys, range(1, 3))
    queues = {bucket_queue_name(stream.name, b) for b in range(buckets)}
    assert set(QueueRegistry(stream.redis, stream.name).queues()) == queues

    lock = threading.Lock()
    calls: list[tuple[str, list[str], str]] = []

    def record(kind: str) -> Any:
        def callback(names: list[str]) -> None:
            with lock:
                calls.append((kind, list(names), threading.current_thread().name))

        return callback

    def seen(kind: str) -> list[str]:
        with lock:
            return [q for k, names, _ in calls if k == kind for q in names]

    callbacks = {"on_assigned": record("assigned"), "on_revoked": record("revoked")}
    options = {"mode": "bucket", "buckets": buckets, "settings": fast_settings()}
    worker = Worker(
        stream.name, "tests.pipelines:audit", engine=spark_engine, **options, **callbacks
    )
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            worker.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            failure.append(exc)

    thread = threading.Thread(target=serve, name="test-worker-batch-loop", daemon=True)
    thread.start()
    try:
        wait_until(lambda: set(seen("assigned")) == queues, 30, "on_assigned for every queue")
        assert sorted(seen("assigned")) == sorted(queues)  # each queue once
        assert seen("revoked") == []
        assert sorted(worker.held) == sorted(queues)
        store = StateStore(stream.redis, stream.name)
        wait_exactly_once(store, keys, 2, timeout=30)

        peer = workers(stream.name, mode="bucket", buckets=buckets).wait_ready()
        wait_until(lambda: len(seen("revoked")) >= 2, 30, "on_revoked for half the queues")
        wait_until(lambda: held_count(stream, peer.worker_id) == 2, 15, "the peer to take its half")
        revoked = set(seen("revoked"))
        assert len(seen("revoked")) == 2, calls
        assert revoked == set(holding(stream)[peer.worker_id])
        assert set(worker.held) == queues - revoked
        assert set(holding(stream)[worker.worker_id]) == queues - revoked

        publish_rounds(producer, keys, range(3, 5))
        wait_exactly_once(store, keys, 4, timeout=60)
    finally:
        worker.stop()
        thread.join(timeout=40)
    assert not thread.is_alive(), "the worker did not stop"
    assert not failure, failure
    # Shutdown hands back the rest, and says so.
    assert sorted(seen("revoked")) == sorted(queues), calls
    assert worker.held == []
    # Callbacks run on the batch loop's thread (here, the thread that called run()).
    assert {name for _, _, name in calls} == {"test-worker-batch-loop"}
    taken = lambda: held_count(stream, peer.worker_id) == buckets  # noqa: E731
    wait_until(taken, 20, "the peer to take every queue")
    assert peer.terminate() == 0, peer.log()[-3000:]


def test_a_burst_of_claims_never_outlasts_the_locks_already_held(
    stream: StreamFixture, producer: Producer, workers: Any
) -> None:
    """800 queues found at once are claimed over several ticks, the locks renewed between:
    none expires. Lock ttl 5 s: a 2-core machine under other work stalls a worker for over
    1.5 s (the slack a 2 s ttl leaves past its claim budget) now and then."""
    keys = [f"burst-{n}" for n in range(800)]
    for key in keys:
        producer.publish(key, {"n": 1})
    producer.flush(60)
    fast_locks = {"KEYQ_LOCK_TTL_MS": "5000", "KEYQ_MEMBER_TTL_MS": "5000", "KEYQ_TICK_MS": "1000"}
    worker = workers(stream.name, mode="key", env=fast_locks).wait_ready()
    state = StreamKeys(stream.name).state
    wait_until(lambda: stream.redis.hlen(state) == len(keys), 180, "every key committed")
    assert worker.log().count("(lock lost)") == 0, "locks expired while the worker claimed"


def test_a_worker_holds_no_more_queues_than_its_connection_has_channels_for(
    stream: StreamFixture, producer: Producer, workers: Any
) -> None:
    """With no ``KEYQ_MAX_HELD_QUEUES``, as many queues as its connection has channels (24,
    keyq keeps 8): none claimed it cannot consume; every key reached as drained ones go."""
    capacity = 24 - RESERVED_CHANNELS
    keys = [f"narrow-{n}" for n in range(3 * capacity)]
    publish_rounds(producer, keys, range(1, 4), flush=60)
    narrow = {"KEYQ_AMQP_URL": f"{stream.settings.amqp_url}?channel_max=24"}
    narrow["KEYQ_IDLE_RELEASE_MS"] = "1000"
    worker = workers(stream.name, mode="key", env=narrow).wait_ready()
    store = StateStore(stream.redis, stream.name)
    most_held = 0

    def every_key_applied() -> bool:
        nonlocal most_held
        most_held = max(most_held, held_count(stream, worker.worker_id))
        return all((store.get(key) or {"applied": 0})["applied"] >= 3 for key in keys)

    wait_until(every_key_applied, 120, "every key applied", every=0.05)
    assert states_problems(store, keys, 3) == {}
    assert capacity // 2 <= most_held <= capacity
    log = worker.log()
    assert re.search(r"consuming \S+ failed|NoFreeChannels", log) is None, log[-3000:]


def test_quiet_queues_published_to_again_are_claimed_at_once_without_a_scan(
    stream: StreamFixture, producer: Producer, workers: Any
) -> None:
    """Quiet keys published to again are claimed within 0.75 s, between ticks (3 s) and with
    no scan (10 min): the producer's lease announces each woken queue. Twice in a row: ticks
    alone would do that about 6 % of the time."""
    slow = {"KEYQ_SCAN_INTERVAL_MS": "600000", "KEYQ_IDLE_RELEASE_MS": "1000"}
    slow |= {"KEYQ_TICK_MS": "3000", "KEYQ_LOCK_TTL_MS": "9000", "KEYQ_MEMBER_TTL_MS": "9000"}
    keys = ["sleeper-a", "sleeper-b", "sleeper-c"]
    queues = [key_queue_name(stream.name, key) for key in keys]
    workers(stream.name, mode="key", env=slow).wait_ready()
    publish_rounds(producer, keys, range(1, 2))  # new queues: announced, claimed between ticks
    store = StateStore(stream.redis, stream.name)
    locks = FencedLocks(stream.redis, stream.name)
    for n in (2, 3):

        def applied(count: int = n - 1) -> bool:
            return all((store.get(key) or {}).get("applied") == count for key in keys)

        wait_until(applied, 60, f"event {n - 1} of every key")
        wait_until(lambda: all(locks.holder(q) is None for q in queues), 30, "queues let go")
        quiet_since = int(time.time() * 1000) - 60_000  # as if quiet for a minute
        stream.redis.zadd(stream.keys.registry, dict.fromkeys(queues, quiet_since))
        # The producer's lease has run out, and the worker's cool-down on handed-back queues.
        time.sleep(max(stream.settings.publish_lease_ms / 1000, RELEASE_COOLDOWN_S) + 0.5)
        published = time.monotonic()
        publish_rounds(producer, keys, range(n, n + 1))
        claimed = wait_until(
            lambda: all(locks.holder(q) is not None for q in queues) and time.monotonic(),
            10,
            "the woken queues claimed",
            every=0.02,
        )
        assert claimed - published < 0.75, f"claimed {claimed - published:.2f} s after publish"
        assert all(stream.redis.zscore(stream.keys.woken, q) is not None for q in queues)
    wait_until(lambda: all((store.get(k) or {}).get("applied") == 3 for k in keys), 30, "all")
    assert states_problems(store, keys, 3) == {}
