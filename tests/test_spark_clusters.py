"""`keyq worker` against Spark beyond its own process: a standalone cluster and a Spark
Connect server, started on loopback (tests/spark_cluster.py).

The pipeline, ``tests.pipelines:audit``, lives in this checkout: a cluster's executors can
import it only because the worker sends it along, which the first test relies on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keyq import Producer
from keyq.worker.batch.state_store import StateStore
from tests.spark_cluster import SparkConnectServer, SparkStandalone, spark_cluster_available
from tests.workers import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        spark_cluster_available() is not None, reason=str(spark_cluster_available())
    ),
]

KEYS = [f"meter-{i}" for i in range(5)]
PER_KEY = 40
ON_LOOPBACK = "spark.driver.host=127.0.0.1,spark.driver.bindAddress=127.0.0.1"


@pytest.fixture
def standalone(tmp_path: Path) -> Iterator[SparkStandalone]:
    with SparkStandalone(tmp_path / "spark") as cluster:
        yield cluster


def _publish_and_check(stream: Any, worker: Any) -> None:
    worker.wait_ready(timeout=240)
    with Producer(stream.name, mode="key", settings=stream.settings) as producer:
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


def test_a_worker_on_a_standalone_cluster_sends_its_pipeline_and_applies_a_stream(
    stream: Any, workers: Any, standalone: SparkStandalone
) -> None:
    worker = workers(
        stream.name,
        mode="key",
        env={
            "KEYQ_SPARK_MASTER": standalone.url,
            "KEYQ_SPARK_CONF": f"{ON_LOOPBACK},spark.executor.memory=512m",
        },
    )
    _publish_and_check(stream, worker)
    assert "sent tests.zip to Spark's executors" in worker.log()
    assert standalone.url in worker.log()  # the engine said which Spark it runs on


def test_a_cluster_with_no_room_for_the_worker_fails_its_start_with_the_reason(
    stream: Any, workers: Any, standalone: SparkStandalone
) -> None:
    """Executors that ask for more cores than any Spark worker has are never launched, and
    the first job would wait for them forever: the start gives up with the reason."""
    worker = workers(
        stream.name,
        mode="key",
        env={
            "KEYQ_SPARK_MASTER": standalone.url,
            "KEYQ_SPARK_CONF": f"{ON_LOOPBACK},spark.executor.cores={standalone.cores + 1}",
            "KEYQ_SPARK_START_TIMEOUT_S": "8",
        },
    )
    assert worker.wait(240) != 0
    log = worker.log()
    assert "did not run the first job within 8 s" in log, log[-3000:]
    assert "free cores" in log


def test_a_worker_on_a_spark_connect_server_applies_a_stream(
    stream: Any, workers: Any, tmp_path: Path
) -> None:
    with SparkConnectServer(tmp_path / "connect") as server:
        worker = workers(stream.name, mode="key", env={"KEYQ_SPARK_REMOTE": server.url})
        _publish_and_check(stream, worker)
        assert server.url in worker.log()
