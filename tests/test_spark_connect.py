"""A worker pointed at Spark Connect (KEYQ_SPARK_REMOTE) instead of a local master.

``local[1]`` as the remote makes pyspark start a local Spark Connect server, so the test runs
the same client path a worker uses against a cluster's ``sc://host:15002``.
"""

from __future__ import annotations

from typing import Any

import pytest

from keyq import Producer
from keyq.worker.batch.state_store import StateStore
from tests.workers import wait_until

pytestmark = pytest.mark.slow


def test_worker_runs_its_batches_through_spark_connect(stream: Any, workers: Any) -> None:
    keys = [f"device-{i}" for i in range(5)]
    per_key = 40
    worker = workers(stream.name, mode="key", env={"KEYQ_SPARK_REMOTE": "local[1]"})
    worker.wait_ready(timeout=150)
    with Producer(stream.name, mode="key") as producer:
        for n in range(1, per_key + 1):
            for key in keys:
                producer.publish(key, {"n": n, "producer": "p"})
        producer.flush()
    store = StateStore(stream.redis, stream.name)

    def done() -> bool:
        return all((store.get(k) or {"applied": 0})["applied"] >= per_key for k in keys)

    wait_until(done, 90, "the worker to apply every event", every=0.5)
    for key in keys:
        state = store.get(key)
        assert state == {"applied": per_key, "last": {"p": per_key}, "violations": []}
    assert "local[1]" in worker.log()  # the engine said which Spark it runs on
    assert worker.terminate() == 0
