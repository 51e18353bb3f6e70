"""Workers as real processes, killed with kill -9, added and removed mid-run: every event
published is applied exactly once, in order, per key (checked by the audit fold's evidence)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from keyq import Producer
from keyq.broker.routes import RouteBook
from keyq.worker.batch.state_store import StateStore
from tests.workers import held_by, wait_until

# Also run on RabbitMQ 4.3 in CI: the core of keyq end to end on a current broker.
pytestmark = [pytest.mark.slow, pytest.mark.broker_versions]


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
