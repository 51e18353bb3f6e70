"""Workers as real processes, killed with kill -9, added and removed mid-run: every event
published is applied exactly once, in order, per key (checked by the audit fold's evidence).
A worker frozen (SIGSTOP) mid-batch past its lock ttl is a zombie when it wakes: its queues
moved to another worker meanwhile, so the fence refuses its commit and nothing counts twice."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from keyq import Producer
from keyq.broker.naming import key_queue_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.routes import RouteBook
from keyq.worker.batch.state_store import StateStore
from tests.conftest import StreamFixture
from tests.workers import held_by, wait_until, wait_until_members_see_each_other

pytestmark = pytest.mark.slow


def publish_paced(stream: str, mode: str, keys: list[str], per_key: int, errors: list[Any]) -> None:
    """Publishes ``per_key`` events a key, in rounds, 20 every 0.15 s; a failure goes to
    ``errors``, for the test."""
    try:
        with Producer(stream, mode=mode, buckets=None if mode == "key" else 8) as producer:
            for n in range(1, per_key + 1):
                for key in keys:
                    producer.publish(key, {"n": n, "producer": "p"})
                if n % 20 == 0:
                    producer.flush()
                    time.sleep(0.15)
            producer.flush()
    except BaseException as exc:  # noqa: BLE001 - handed to the test
        errors.append(exc)


def check_exactly_once(store: StateStore, keys: list[str], per_key: int) -> None:
    problems: dict[str, Any] = {}
    for key in keys:
        state = store.get(key)
        if state is None:
            problems[key] = "no state"
        elif state["applied"] != per_key or state["violations"] or state["last"] != {"p": per_key}:
            problems[key] = {
                "applied": state["applied"],
                "last": state["last"],
                "violations": state["violations"][:5],
            }
    assert not problems, f"{len(problems)} keys wrong: {dict(list(problems.items())[:5])}"


def wait_applied(store: StateStore, keys: list[str], per_key: int, timeout: float) -> None:
    def all_applied() -> bool:
        for key in keys:
            state = store.get(key)
            if state is None or state["applied"] < per_key:
                return False
        return True

    try:
        wait_until(all_applied, timeout, "every event to be applied", every=0.5)
    except AssertionError:
        check_exactly_once(store, keys, per_key)  # says which keys are short
        raise


# Also run on RabbitMQ 4.3 in CI: the core of keyq end to end on a current broker.
@pytest.mark.broker_versions
@pytest.mark.parametrize("mode", ["key", "bucket", "auto"])
def test_kill_add_and_remove_workers_mid_run(mode: str, stream: Any, workers: Any) -> None:
    keys = [f"order-{i}" for i in range(12)]
    per_key = 300
    store = StateStore(stream.redis, stream.name)
    options: dict[str, Any] = {"mode": mode, "buckets": None if mode == "key" else 8}
    if mode == "auto":  # each key at about 6 events a second: promoted as the run begins
        options["env"] = {"KEYQ_AUTO_PROMOTE_RATE": "3"}
    first = workers(stream.name, **options)
    second = workers(stream.name, **options)
    first.wait_ready()
    second.wait_ready()
    errors: list[Any] = []
    publisher = threading.Thread(
        target=publish_paced, args=(stream.name, mode, keys, per_key, errors), daemon=True
    )
    publisher.start()

    def progress() -> int:
        return sum((store.get(k) or {"applied": 0})["applied"] for k in keys)

    wait_until(lambda: progress() > len(keys) * 30, 60, "processing to start")
    first.kill()  # kill -9 mid-run
    third = workers(stream.name, **options).wait_ready()  # scale up mid-run
    wait_until(lambda: progress() > len(keys) * 150, 90, "processing to go on")
    assert second.terminate() == 0  # scale down: a clean hand-over
    assert "stopped" in second.log()
    publisher.join(120)
    assert not errors, errors
    wait_applied(store, keys, per_key, timeout=90)
    check_exactly_once(store, keys, per_key)
    if mode == "auto":  # the keys were moved to queues of their own through the kills
        assert RouteBook(stream.redis, stream.name).counts().get("promoted:rate", 0) > 0
    assert third.process.poll() is None
    assert set(held_by(stream.redis, stream.name)) <= {third.worker_id}


KEY = "zombie-key"


def publish_numbered(producer: Producer, numbers: range) -> None:
    for n in numbers:
        producer.publish(KEY, {"n": n, "producer": "p"})
    producer.flush(timeout=20)


def applied(store: StateStore) -> int:
    return int((store.get(KEY) or {"applied": 0})["applied"])


def member_info(client: redis.Redis, stream: str, worker_id: str) -> dict[str, Any] | None:
    raw = client.hget(StreamKeys(stream).member_info, worker_id)
    return None if raw is None else dict(orjson.loads(raw))


def test_a_paused_worker_is_fenced_out_when_it_resumes(
    stream: StreamFixture, workers: Any, producer: Producer, tmp_path: Path
) -> None:
    store = StateStore(stream.redis, stream.name)
    marker = tmp_path / "batch-marker"
    suffix = uuid.uuid4().hex[:8]
    # Both start at once (Spark takes a while to start on a busy machine). Member ranks are
    # sorted ids, so with one queue the zombie-to-be ("w-a-…") is the one whose fair share it
    # is, and the successor ("w-b-…") takes nothing until the zombie stops heartbeating, once
    # each has seen the other (one ready first would otherwise claim as if alone).
    slow = {"KEYQ_TEST_BATCH_MARKER": str(marker), "KEYQ_TEST_BATCH_PAUSE": "1.5"}
    pipeline = "tests.pipelines:audit_slow"
    zombie = workers(stream.name, name=f"w-a-{suffix}", pipeline=pipeline, mode="key", env=slow)
    successor = workers(stream.name, name=f"w-b-{suffix}", mode="key")
    zombie.wait_ready()
    successor.wait_ready()
    ids = [zombie.worker_id, successor.worker_id]
    wait_until_members_see_each_other(stream.redis, stream.name, ids)

    first = 20
    publish_numbered(producer, range(1, first + 1))
    wait_until(marker.exists, 30, "the first worker to be inside a batch", every=0.02)
    zombie.pause()  # frozen after its pipeline ran, before its commit
    paused_at = time.monotonic()
    assert marker.read_text().split()[0] == str(zombie.pid)
    # Nothing of the batch it is frozen in was committed, and the successor held nothing.
    assert applied(store) == 0
    queue = key_queue_name(stream.name, KEY)
    assert held_by(stream.redis, stream.name) == {zombie.worker_id: [queue]}

    wait_until(lambda: applied(store) == first, 60, "the second to apply them all", every=0.2)
    took_over = time.monotonic() - paused_at
    print(f"second worker applied everything {took_over:.1f}s after the pause")
    owners = held_by(stream.redis, stream.name)
    assert owners == {successor.worker_id: [queue]}, owners

    zombie.resume()
    resumed_at = time.monotonic()

    def refused() -> bool:
        info = member_info(stream.redis, stream.name, zombie.worker_id)
        in_info = info is not None and int(info.get("commits_refused", 0)) >= 1
        return in_info or "commit refused" in zombie.log()

    wait_until(refused, 30, "the zombie's commit to be refused", every=0.2)
    print(f"zombie's commit refused {time.monotonic() - resumed_at:.1f}s after resuming")

    second = 10
    publish_numbered(producer, range(first + 1, first + second + 1))
    total = first + second
    wait_until(lambda: applied(store) == total, 60, "every later event applied", every=0.2)
    time.sleep(1.0)  # let anything late (a zombie's write) land before the final check

    assert store.get(KEY) == {"applied": total, "last": {"p": total}, "violations": []}
    marks = store.get_marks(KEY)
    assert marks.applied == total
    assert marks.seqs == {producer.producer_id: total}

    info = member_info(stream.redis, stream.name, zombie.worker_id)
    log = zombie.log()
    print(f"zombie info after resuming: {info}")
    assert (info is not None and info["commits_refused"] >= 1) or "commit refused" in log
    assert zombie.process.poll() is None, log[-3000:]
    assert successor.process.poll() is None, successor.log()[-3000:]

    assert zombie.terminate() == 0, zombie.log()[-3000:]
    assert successor.terminate() == 0, successor.log()[-3000:]
    assert store.get(KEY) == {"applied": total, "last": {"p": total}, "violations": []}
