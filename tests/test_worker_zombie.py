"""A worker frozen (SIGSTOP) in the middle of a batch, past its lock ttl, is a zombie when it
wakes: its queues moved to another worker meanwhile, so its commit is refused by the fence and
nothing it does counts twice."""

from __future__ import annotations

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
from keyq.worker.batch.state_store import StateStore
from tests.conftest import StreamFixture
from tests.workers import held_by, wait_until, wait_until_members_see_each_other

pytestmark = pytest.mark.slow

KEY = "zombie-key"


def publish(producer: Producer, numbers: range) -> None:
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
    zombie = workers(
        stream.name,
        name=f"w-a-{suffix}",
        pipeline="tests.pipelines:audit_slow",
        mode="key",
        env={
            "KEYQ_TEST_BATCH_MARKER": str(marker),
            "KEYQ_TEST_BATCH_PAUSE": "1.5",
            "KEYQ_AMQP_HEARTBEAT": "2",
        },
    )
    successor = workers(stream.name, name=f"w-b-{suffix}", mode="key")
    zombie.wait_ready()
    successor.wait_ready()
    wait_until_members_see_each_other(
        stream.redis, stream.name, [zombie.worker_id, successor.worker_id]
    )

    first = 20
    publish(producer, range(1, first + 1))
    wait_until(marker.exists, 30, "the first worker to be inside a batch", every=0.02)
    zombie.pause()  # frozen after its pipeline ran, before its commit
    paused_at = time.monotonic()
    frozen_in = marker.read_text().split()
    assert frozen_in[0] == str(zombie.pid)
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
    publish(producer, range(first + 1, first + second + 1))
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
