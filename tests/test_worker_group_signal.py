"""SIGTERM to the worker's process group (``kill -- -PGID``, a supervisor) or to every process
under it (systemd's ``KillMode=control-group``): Spark's JVM and Python workers must not act
on it, so the worker finishes the batch in flight and stops cleanly; yet they die with the
worker killed outright. Real processes; the tree is read from /proc (no ``task/*/children``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench import proc_cpu
from keyq import Producer
from keyq.broker.naming import key_queue_name
from keyq.worker.batch.state_store import StateStore
from tests.helpers import drain
from tests.workers import WorkerProcess, wait_until

pytestmark = pytest.mark.slow

SPARK_ERRORS = ("Py4J", "Traceback", "cannot start Spark", "batch interrupted")
KEYS = [f"device-{i}" for i in range(4)]
PER_KEY = 60
SPARK_SUBMIT = re.compile("spark-submit|SparkSubmit")


@dataclass(frozen=True)
class Proc:
    """A process, told apart from a later one that reuses its pid by its start time."""

    pid: int
    ppid: int
    started: int
    cmdline: str

    def alive(self) -> bool:
        now = _read(self.pid)
        return now is not None and now.started == self.started


def _read(pid: int) -> Proc | None:
    """The process, or None if it is gone or a zombie (dead, only not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name in brackets may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return Proc(pid, int(fields[1]), int(fields[19]), cmdline.replace(b"\0", b" ").decode())


def descendants(root: int) -> list[Proc]:
    """Every live process below ``root``."""
    below = proc_cpu.tree(root, proc_cpu.snapshot())[1:]
    return [proc for pid in below if (proc := _read(pid)) is not None]


# Spark's Python daemon: keyq's for a local master (keyq.worker.spark.daemon, which runs
# Spark's own), Spark's (pyspark.daemon) otherwise.
PYTHON_DAEMONS = ("keyq.worker.spark.daemon", "pyspark.daemon")


def python_daemon(proc: Proc) -> bool:
    return any(f"-m {module} " in proc.cmdline + " " for module in PYTHON_DAEMONS)


def assert_clean_log(worker: WorkerProcess) -> None:
    log = worker.log()
    for sign in SPARK_ERRORS:
        assert sign not in log, f"{sign!r} in the worker's log:\n{log[-4000:]}"


@pytest.mark.parametrize("reach", ["process-group", "every-process"])
def test_sigterm_mid_batch_finishes_the_batch_and_loses_nothing(
    reach: str, stream: Any, producer: Producer, workers: Any, amqp: Any, tmp_path: Path
) -> None:
    for n in range(1, PER_KEY + 1):
        for key in KEYS:
            producer.publish(key, {"n": n, "producer": "p"})
    producer.flush()
    marker = tmp_path / "batch-running"
    worker: WorkerProcess = workers(
        stream.name,
        pipeline="tests.pipelines:audit_paced",
        new_session=True,
        env={
            "KEYQ_TEST_BATCH_MARKER": str(marker),
            "KEYQ_TEST_EVENT_PAUSE": "0.02",  # up to 2 s a batch of 100
            "KEYQ_BATCH_MAX_EVENTS": "100",
        },
    )

    running = lambda: marker.exists() or worker.process.poll() is not None  # noqa: E731
    wait_until(running, 90, "a batch in Spark", every=0.05)
    assert marker.exists(), f"worker exited early:\n{worker.log()[-3000:]}"
    spark = descendants(worker.pid)
    assert any(python_daemon(proc) for proc in spark), spark
    if reach == "process-group":
        worker.signal_group(signal.SIGTERM)
    else:  # the worker and every process below it, whatever their group or session
        for pid in [p.pid for p in descendants(worker.pid)] + [worker.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    stopping = time.monotonic()
    assert worker.wait(60) == 0, worker.log()[-4000:]
    stopped_in = time.monotonic() - stopping
    assert_clean_log(worker)
    assert "finishing the batch in flight" in worker.log()
    wait_until(lambda: not any(proc.alive() for proc in spark), 15, "Spark to exit")

    # Every event is applied exactly once, in order, or back in its queue: none is lost.
    store = StateStore(stream.redis, stream.name)
    channel = amqp.channel()
    applied_total = 0
    for key in KEYS:
        state = store.get(key) or {"applied": 0, "last": {}, "violations": []}
        applied = state["applied"]
        assert state["violations"] == [], (key, state)
        assert state["last"].get("p", 0) == applied, (key, state)
        left = [landed.json()["n"] for landed in drain(channel, key_queue_name(stream.name, key))]
        # A pack goes back whole until every event in it is committed: what a worker would
        # skip by seq (applied already) can lead what is left, in order, never more.
        skipped = [n for n in left if n <= applied]
        assert skipped == list(range(applied - len(skipped) + 1, applied + 1)), (key, left)
        assert left[len(skipped) :] == list(range(applied + 1, PER_KEY + 1)), (key, applied, left)
        applied_total += applied
    # The batch in flight was finished and committed, and the rest was handed back.
    assert 0 < applied_total < PER_KEY * len(KEYS), applied_total
    print(f"stopped {stopped_in:.1f}s after SIGTERM; {applied_total} events applied")


def test_group_sigterm_while_spark_starts_exits_cleanly(
    stream: Any, producer: Producer, workers: Any
) -> None:
    producer.publish("device-0", {"n": 1, "producer": "p"})  # the stream is configured
    producer.flush()
    # Spark takes its time to start on a loaded machine: the watchdog is not under test here.
    worker: WorkerProcess = workers(
        stream.name, new_session=True, env={"KEYQ_SHUTDOWN_TIMEOUT": "120"}
    )

    def starting() -> Proc | None:
        """The worker's child pyspark launched: ``spark-submit`` until it execs the JVM."""
        if worker.process.poll() is not None:
            raise AssertionError(f"worker exited early:\n{worker.log()[-3000:]}")
        children = [p for p in descendants(worker.pid) if p.ppid == worker.pid]
        return next((p for p in children if SPARK_SUBMIT.search(p.cmdline)), None)

    jvm: Proc = wait_until(starting, 60, "Spark's JVM to start", every=0.05)
    time.sleep(1.0)  # well into the JVM's start-up, before the session exists
    assert "spark ready" not in worker.log()
    worker.signal_group(signal.SIGTERM)
    assert worker.wait(120) == 0, worker.log()[-4000:]
    assert_clean_log(worker)
    assert "stopped while starting" in worker.log()
    wait_until(lambda: not jvm.alive(), 15, "the JVM to exit with the worker")


def test_kill_9_of_the_worker_takes_its_spark_processes_with_it(
    stream: Any, producer: Producer, workers: Any
) -> None:
    producer.publish("device-0", {"n": 1, "producer": "p"})
    producer.flush()
    worker: WorkerProcess = workers(stream.name, new_session=True).wait_ready()
    spark = descendants(worker.pid)
    commands = " ".join(proc.cmdline for proc in spark)
    # The JVM and the Python daemon its warm-up job started, both outside the worker's
    # process group, so no group signal reaches them ...
    assert "org.apache.spark.deploy.SparkSubmit" in commands, commands
    assert any(python_daemon(proc) for proc in spark), commands
    outside = [proc for proc in spark if os.getpgid(proc.pid) != worker.pid]
    assert len(outside) == len(spark), [
        (proc.pid, os.getpgid(proc.pid), proc.cmdline[:80]) for proc in spark
    ]
    # ... and yet all of them go when the worker is killed outright.
    killed = time.monotonic()
    worker.kill()
    wait_until(lambda: not any(proc.alive() for proc in spark), 15, "Spark to exit")
    print(f"{len(spark)} Spark processes gone {time.monotonic() - killed:.1f}s after kill -9")
