"""The ``park`` poison policy and redrive, with real workers: a key stops at its poison
event while every other key flows (those sharing its bucket too), its later events wait aside,
and a redrive applies the dead letter and then everything that waited, each once, in publish
order, also when the worker draining them is killed half way."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from keyq import Producer
from keyq.broker.key_control import KeyControl
from keyq.broker.naming import dead_letter_queue_name, key_queue_name
from keyq.worker.batch.state_store import StateStore
from tests.conftest import StreamFixture
from tests.helpers import queue_depth
from tests.workers import held_by, run_keyq, wait_until

pytestmark = pytest.mark.slow

PARKED = "parked-key"


def seen(store: StateStore, key: str, producer: Producer) -> list[int]:
    state = store.get(key) or {"seen": {}}
    return list(state["seen"].get(producer.producer_id, []))


def publish(producer: Producer, keys: list[str], numbers: range, poison: int | None) -> None:
    for n in numbers:
        for key in keys:
            event: dict[str, Any] = {"n": n, "producer": producer.producer_id}
            if key == PARKED and n == poison:
                event["poison"] = True
            producer.publish(key, event)
    producer.flush(timeout=30)


def keyq(stream: StreamFixture, *args: str) -> None:
    done = run_keyq(stream.settings, *args)
    assert done.returncode == 0, done.stderr + done.stdout


@pytest.mark.broker_versions
@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_a_parked_key_stops_while_its_bucket_flows_and_a_redrive_applies_all_in_order(
    stream: StreamFixture, workers: Any, amqp: Any, tmp_path: Path, queue_type: str
) -> None:
    fixed = tmp_path / "pipeline-fixed"
    # The producer fixes the stream's queue type (dead-letter and aside queues follow it).
    producer = Producer(
        stream.name, mode="bucket", buckets=1, queue_type=queue_type, settings=stream.settings
    )
    worker = workers(
        stream.name,
        pipeline="tests.pipelines:ledger_until_fixed",
        mode="bucket",
        buckets=1,
        env={"KEYQ_TEST_FIXED_MARKER": str(fixed), "KEYQ_MAX_ATTEMPTS": "2"},
    )
    worker.wait_ready()
    keyq(stream, "stream", "set", "--stream", stream.name, "--poison-policy", "park")
    store = StateStore(stream.redis, stream.name)
    control = KeyControl(stream.redis, stream.name)
    keys = [PARKED, "flowing-a", "flowing-b"]  # one bucket: all three share its queue
    try:
        publish(producer, keys, range(1, 31), poison=10)
        for key in keys[1:]:
            wait_until(lambda k=key: seen(store, k, producer) == list(range(1, 31)), 90, key)
        wait_until(lambda: PARKED in control.parked(), 30, "the key to be parked")
        assert seen(store, PARKED, producer) == list(range(1, 10))
        where = control.parked()[PARKED]
        assert (where.producer, where.seq) == (producer.producer_id, 10)

        publish(producer, keys, range(31, 41), poison=None)
        for key in keys[1:]:
            wait_until(lambda k=key: seen(store, k, producer) == list(range(1, 41)), 60, key)
        time.sleep(1.0)
        assert seen(store, PARKED, producer) == list(range(1, 10))  # still stopped
        assert queue_depth(amqp, dead_letter_queue_name(stream.name)) == 1
        aside = control.status(PARKED).aside
        assert len(aside) == 1 and queue_depth(amqp, aside[0]) == 30

        fixed.touch()
        keyq(stream, "dlq", "redrive", "--stream", stream.name, "--key", PARKED)
        wait_until(
            lambda: seen(store, PARKED, producer) == list(range(1, 41)),
            60,
            "the parked key's events, the redriven one first, each once in order",
        )
        wait_until(lambda: not control.status(PARKED).aside, 30, "the aside queues drained")
        assert queue_depth(amqp, dead_letter_queue_name(stream.name)) == 0
        assert PARKED not in control.parked()
        assert queue_depth(amqp, aside[0]) is None  # deleted once drained

        publish(producer, keys, range(41, 46), poison=None)  # it flows directly again
        for key in keys:
            wait_until(lambda k=key: seen(store, k, producer) == list(range(1, 46)), 60, key)
    finally:
        producer.close(timeout=10)
    assert worker.terminate() == 0, worker.log()[-3000:]


def test_a_redrive_survives_the_draining_worker_killed_half_way_in_key_mode(
    stream: StreamFixture, workers: Any, producer: Producer, amqp: Any, tmp_path: Path
) -> None:
    fixed = tmp_path / "pipeline-fixed"
    # Small batches, so that the drain takes many and the kill lands in the middle of it.
    env = {
        "KEYQ_TEST_FIXED_MARKER": str(fixed),
        "KEYQ_MAX_ATTEMPTS": "2",
        "KEYQ_BATCH_MAX_EVENTS": "10",
    }
    first = workers(stream.name, pipeline="tests.pipelines:ledger_until_fixed", mode="key", env=env)
    first.wait_ready()
    keyq(stream, "stream", "set", "--stream", stream.name, "--poison-policy", "park")
    store = StateStore(stream.redis, stream.name)
    control = KeyControl(stream.redis, stream.name)
    keys = [PARKED, "flowing"]
    total = 300
    publish(producer, keys, range(1, total + 1), poison=5)
    wait_until(lambda: seen(store, "flowing", producer) == list(range(1, total + 1)), 120, "flow")
    wait_until(lambda: PARKED in control.parked(), 30, "the key to be parked")

    def all_aside() -> bool:
        aside = control.status(PARKED).aside
        return len(aside) == 1 and queue_depth(amqp, aside[0]) == total - 5

    wait_until(all_aside, 60, "the parked key's later events to wait aside")
    assert seen(store, PARKED, producer) == [1, 2, 3, 4]

    second = workers(
        stream.name, pipeline="tests.pipelines:ledger_until_fixed", mode="key", env=env
    )
    second.wait_ready()
    fixed.touch()
    keyq(stream, "dlq", "redrive", "--stream", stream.name, "--key", PARKED)
    wait_until(lambda: len(seen(store, PARKED, producer)) > 5, 60, "the drain to start")
    queue = key_queue_name(stream.name, PARKED)

    def holder() -> Any:
        """The worker holding the key's queue (none for a moment while a rebalance hands it
        from one worker to the other)."""
        owners = held_by(stream.redis, stream.name)
        return next((w for w in (first, second) if queue in owners.get(w.worker_id, [])), None)

    draining = wait_until(holder, 30, "a worker holding the key's queue", every=0.05)
    draining.kill()
    at_kill = len(seen(store, PARKED, producer))
    print(f"killed the draining worker with {at_kill} of {total} events of the key applied")
    assert at_kill < total, "the drain was over before the kill: nothing was shown"
    wait_until(
        lambda: len(seen(store, PARKED, producer)) >= total,
        120,
        "the other worker to finish the drain",
    )
    time.sleep(1.0)
    assert seen(store, PARKED, producer) == list(range(1, total + 1))
    wait_until(lambda: not control.status(PARKED).aside, 30, "the aside queues drained")
    assert queue_depth(amqp, dead_letter_queue_name(stream.name)) == 0
