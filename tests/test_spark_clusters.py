"""`keyq worker` against Spark beyond its own process: a standalone cluster and Spark Connect
(a server on loopback, tests/spark_cluster.py, or one pyspark starts for ``local[1]``). The
pipeline lives in this checkout: a cluster's executors import it because the worker sends it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from keyq.worker.batch.state_store import StateStore
from tests.spark_cluster import SparkConnectServer, SparkStandalone, spark_cluster_available
from tests.workers import wait_until

pytestmark = pytest.mark.slow
_MISSING = spark_cluster_available()
needs_spark_daemons = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))

KEYS = [f"meter-{i}" for i in range(5)]
PER_KEY = 40
ON_LOOPBACK = "spark.driver.host=127.0.0.1,spark.driver.bindAddress=127.0.0.1"


def _publish_and_check(stream: Any, producer: Any, worker: Any) -> None:
    worker.wait_ready(timeout=240)
    for n in range(1, PER_KEY + 1):
        for key in KEYS:
            producer.publish(key, {"n": n, "producer": "p"})
    producer.flush(30)
    store = StateStore(stream.redis, stream.name)

    def done() -> bool:
        return all((store.get(k) or {"applied": 0})["applied"] >= PER_KEY for k in KEYS)

    wait_until(done, 120, "the worker to apply every event", every=0.5)
    for key in KEYS:
        assert store.get(key) == {"applied": PER_KEY, "last": {"p": PER_KEY}, "violations": []}
    assert "dead-lettered" not in worker.log()
    assert worker.terminate() == 0


@needs_spark_daemons
def test_a_worker_on_a_standalone_cluster_fails_its_start_without_room_else_applies_a_stream(
    stream: Any, producer: Any, workers: Any, tmp_path: Path
) -> None:
    """Executors asking for more cores than any Spark worker has are never launched: the start
    gives up with the reason rather than wait for them forever."""
    with SparkStandalone(tmp_path / "spark") as standalone:
        too_many = f"{ON_LOOPBACK},spark.executor.cores={standalone.cores + 1}"
        env = {"KEYQ_SPARK_MASTER": standalone.url, "KEYQ_SPARK_START_TIMEOUT_S": "8"}
        no_room = workers(stream.name, mode="key", env={**env, "KEYQ_SPARK_CONF": too_many})
        assert no_room.wait(240) != 0
        log = no_room.log()
        assert "did not run the first job within 8 s" in log, log[-3000:]
        assert "free cores" in log

        conf = f"{ON_LOOPBACK},spark.executor.memory=512m"
        env = {"KEYQ_SPARK_MASTER": standalone.url, "KEYQ_SPARK_CONF": conf}
        worker = workers(stream.name, mode="key", env=env)
        _publish_and_check(stream, producer, worker)
        assert "sent tests.zip to Spark's executors" in worker.log()
        assert standalone.url in worker.log()  # the engine said which Spark it runs on


@pytest.mark.parametrize("remote", ["local[1]", pytest.param("server", marks=needs_spark_daemons)])
def test_a_worker_through_spark_connect_applies_a_stream(
    stream: Any, producer: Any, workers: Any, tmp_path: Path, remote: str
) -> None:
    """``local[1]`` makes pyspark start a Connect server of its own: the same client path a
    worker uses against a cluster's ``sc://host:15002``."""
    with contextlib.ExitStack() as servers:
        if remote == "server":
            remote = servers.enter_context(SparkConnectServer(tmp_path / "connect")).url
        worker = workers(stream.name, mode="key", env={"KEYQ_SPARK_REMOTE": remote})
        _publish_and_check(stream, producer, worker)
        assert remote in worker.log()  # the engine said which Spark it runs on
