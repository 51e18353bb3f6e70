"""``keyq worker`` from the shell: mistakes give one clear line and the right exit code, and a
key-mode worker hands back a queue that went idle, so the janitor can reclaim it."""

from __future__ import annotations

import re
import threading
from typing import Any
from urllib.parse import urlsplit

import pytest

from keyq import Producer
from keyq.broker.locks import FencedLocks
from keyq.broker.naming import key_queue_name
from keyq.broker.settings import Settings, load_settings
from keyq.worker.batch.state_store import StateStore
from keyq.worker.config import WorkerSettings
from keyq.worker.daemon import Worker
from tests.helpers import queue_depth
from tests.workers import run_keyq, wait_until

EXIT_FAILURE = 1
EXIT_USAGE = 2


@pytest.mark.parametrize(
    ("stream_name", "pipeline", "extra", "says"),
    [
        ("s", "no_such_module:run", (), "No module named 'no_such_module'"),
        ("s", "keyq.demo.orders:EVENT_TYPES", (), "is not a function"),
        ("s", "keyq.demo.orders:pipeline", ("--sink", "ftp://x"), "parquet:"),
        ("no spaces", "keyq.demo.orders:pipeline", (), "(?i)stream"),
    ],
    ids=["pipeline-not-importable", "pipeline-not-a-function", "unknown-sink", "bad-stream"],
)
def test_a_bad_pipeline_sink_or_stream_is_a_usage_error(
    settings: Settings, stream_name: str, pipeline: str, extra: tuple[str, ...], says: str
) -> None:
    done = run_keyq(settings, "worker", "--stream", stream_name, "--pipeline", pipeline, *extra)
    assert done.returncode == EXIT_USAGE
    assert re.search(says, done.stderr), done.stderr
    assert "Traceback" not in done.stderr


def test_wrong_credentials_fail_fast_without_showing_the_password(settings: Settings) -> None:
    secret = "s3cret-Pa55"
    url = settings.amqp_url.replace("guest:guest@", f"guest:{secret}@")
    assert secret in url
    command = ("worker", "--stream", "s", "--pipeline", "keyq.demo.orders:pipeline")
    done = run_keyq(settings, *command, env={"KEYQ_AMQP_URL": url, "KEYQ_RECONNECT_TIMEOUT": "1"})
    assert done.returncode == EXIT_FAILURE
    assert "refused the credentials" in done.stderr
    assert secret not in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_key_mode_worker_hands_back_an_idle_queue(
    stream: Any, producer: Producer, spark_engine: Any, amqp: Any
) -> None:
    settings = load_settings(
        WorkerSettings, idle_release_ms=1500, tick_ms=100, scan_interval_ms=200
    )
    for n in range(1, 6):
        producer.publish("sensor-1", {"n": n, "producer": "p"})
    producer.flush()
    queue = key_queue_name(stream.name, "sensor-1")
    assigned: list[str] = []
    revoked: list[str] = []
    worker = Worker(
        stream.name,
        "tests.pipelines:audit",
        settings=settings,
        engine=spark_engine,
        on_assigned=assigned.extend,
        on_revoked=revoked.extend,
    )
    runner = threading.Thread(target=worker.run, daemon=True)
    runner.start()
    try:
        store = StateStore(stream.redis, stream.name)
        wait_until(lambda: (store.get("sensor-1") or {}).get("applied") == 5, 60, "processing")
        locks = FencedLocks(stream.redis, stream.name)
        assert queue in assigned  # the worker held it (it may already have let go: 1.5 s)
        # Nothing more arrives: after idle_release_ms the worker lets the queue go.
        wait_until(lambda: locks.holder(queue) is None, 15, "the idle queue to be released")
        # on_revoked fires on the batch thread after the release: wait for it, not assume it.
        wait_until(lambda: queue in revoked, 15, "on_revoked for the released queue")
        assert worker.stats()["released"] >= 1
        channel = amqp.channel()
        declared = channel.queue_declare(queue, passive=True)
        assert declared.method.consumer_count == 0  # free for the janitor
        assert queue_depth(amqp, queue) == 0
    finally:
        worker.stop()
        runner.join(60)
    assert not runner.is_alive()


@pytest.mark.slow
def test_a_worker_waits_for_a_broker_that_is_down_and_for_redis_gone_while_spark_starts(
    stream: Any, producer: Producer, workers: Any
) -> None:
    """A daemon started beside a broker that is still starting (or restarting) waits for it
    instead of exiting. Then Redis, which answered the start-up check, goes away while Spark
    starts (the cluster soak cut it then): the worker waits for it too, then serves."""
    from tests.faults import FaultProxy

    producer.publish("waited", {"n": 1, "producer": "p"})
    producer.flush(30)
    broker = urlsplit(stream.settings.amqp_url)
    redis_at = urlsplit(stream.settings.redis_url)
    with (
        FaultProxy(broker.hostname or "127.0.0.1", broker.port or 5672) as amqp_proxy,
        FaultProxy(redis_at.hostname or "127.0.0.1", redis_at.port or 6379) as redis_proxy,
    ):
        amqp_proxy.refuse(True)
        env = {
            "KEYQ_AMQP_URL": amqp_proxy.url_for(stream.settings.amqp_url),
            "KEYQ_REDIS_URL": redis_proxy.url_for(stream.settings.redis_url),
        }
        worker = workers(stream.name, env=env)
        wait_until(lambda: "waiting for the services" in worker.log(), 30, "a waiting worker")
        assert worker.process.poll() is None
        amqp_proxy.refuse(False)
        # The line on how Redis persists comes after the services check, before Spark.
        wait_until(lambda: "Redis " in worker.log(), 60, "the services check")
        redis_proxy.refuse(True)
        redis_proxy.cut()
        wait_until(
            lambda: (
                "retrying in" in worker.log().split("Redis ", 1)[1]
                or worker.process.poll() is not None
            ),
            180,
            "the worker to meet the Redis outage after Spark started",
        )
        assert worker.process.poll() is None, worker.log()[-2000:]
        redis_proxy.refuse(False)
        worker.wait_ready(120)
        store = StateStore(stream.redis, stream.name)
        wait_until(lambda: store.get("waited") is not None, 60, "the event applied")
        assert worker.terminate(60) == 0
    assert "guest:guest@" not in worker.log()
    # Spark's driver logs with keyq's configuration: no banner of its default profile.
    assert "spark ready in" in worker.log()
    assert "Using Spark's default log4j profile" not in worker.log()
    assert "To adjust logging level" not in worker.log()


def test_a_worker_stopped_while_it_starts_exits_cleanly(
    stream: Any, workers: Any, tmp_path: Any
) -> None:
    """A supervisor may stop a worker before it serves (still importing its pipeline, say):
    that is a clean stop, exit 0, not a death by SIGTERM."""
    importing = tmp_path / "importing"
    (tmp_path / "kq_slow_import_pipe.py").write_text(
        f"import pathlib, time\npathlib.Path({str(importing)!r}).touch()\ntime.sleep(3)\n"
        "def run(df, ctx):\n    return df\n"
    )
    worker = workers(
        stream.name, pipeline="kq_slow_import_pipe:run", env={"PYTHONPATH": str(tmp_path)}
    )
    wait_until(importing.exists, 60, "the pipeline's import")
    assert worker.terminate(timeout=60) == 0, worker.log()[-3000:]
