"""No key is ever stranded, under a randomized schedule of what operators and faults do.

Poison events park some keys, an operator pauses others, a worker is killed -9 half way through
publishing, and a janitor with a one-second idle ttl reclaims queues all along. Then the pipeline
is fixed and each parked key redriven (two redrives of one key at once, one killed -9 and run
again, a worker killed -9 meanwhile), and the paused keys resumed while every worker restarts.
Every key must end with its events applied exactly once, in order, nothing left aside, parked or
dead-lettered. Each seed draws its own keys, poison positions, pause and kill moments.

``KEYQ_TEST_STRANDING_MATRIX=all`` runs every mode with every queue type, ``KEYQ_TEST_SEEDS``
(e.g. ``1,2,3``) more seeds, ``KEYQ_TEST_STRANDING_SCALE`` (keys x events) a larger scale.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from keyq import Producer
from keyq.broker.key_control import KeyControl
from keyq.broker.naming import dead_letter_queue_name
from keyq.broker.routes import RouteBook
from keyq.broker.stranded import StrandedRecord
from keyq.worker.batch.state_store import StateStore
from tests.conftest import StreamFixture
from tests.helpers import queue_depth
from tests.workers import REPO, idle_janitor, keyq_environment, run_keyq, wait_until

pytestmark = pytest.mark.slow

# KEYQ_TEST_STRANDING_SCALE=80x80 runs the field's scale: 80 keys of 80 events, 10 poisoned.
KEYS, EVENTS = (int(n) for n in os.environ.get("KEYQ_TEST_STRANDING_SCALE", "12x40").split("x"))
SEEDS = [int(s) for s in os.environ.get("KEYQ_TEST_SEEDS", "").split(",") if s.strip()]
# What a queue type changes (a quorum queue's delivery count and its redelivery) is the same
# in every mode: the suite pairs each mode with one queue type, the full matrix is opt-in.
COMBINATIONS = [("key", "classic"), ("auto", "classic"), ("bucket", "quorum")]
if os.environ.get("KEYQ_TEST_STRANDING_MATRIX") == "all":
    COMBINATIONS += [("bucket", "classic"), ("key", "quorum")]


def _cases() -> list[Any]:
    seeds = SEEDS or [1]
    return [
        pytest.param(mode, queue_type, seed, id=f"{mode}-{queue_type}-seed{seed}")
        for mode, queue_type in COMBINATIONS
        for seed in seeds
    ]


class Scenario:
    """The stream, its workers, and what was published."""

    def __init__(self, stream: StreamFixture, workers: Any, tmp: Path, mode: str, seed: int):
        self.stream, self._start, self.mode = stream, workers, mode
        self.rng = random.Random(seed)
        self.fixed = tmp / "pipeline-fixed"
        self.env = {"KEYQ_TEST_FIXED_MARKER": str(self.fixed), "KEYQ_MAX_ATTEMPTS": "2"}
        self.env |= {"KEYQ_BATCH_MAX_EVENTS": "50", "KEYQ_IDLE_RELEASE_MS": "1000"}
        self.running: list[Any] = []

    def worker(self) -> Any:
        shape = {"mode": self.mode, "buckets": None if self.mode == "key" else 4, "env": self.env}
        started = self._start(
            self.stream.name, pipeline="tests.pipelines:ledger_until_fixed", **shape
        )
        self.running.append(started)
        return started

    def kill_one(self) -> None:
        victim = self.rng.choice(self.running)
        victim.kill()
        self.running.remove(victim)

    def kill_all(self) -> None:
        while self.running:
            self.running.pop().kill()

    def keyq(self, *args: str) -> str:
        done = run_keyq(self.stream.settings, *args, "--stream", self.stream.name)
        assert done.returncode == 0, done.stderr + done.stdout
        return done.stdout

    def redrive(self, key: str) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "keyq", "dlq", "redrive", "--stream", self.stream.name]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "cwd": REPO}
        env = keyq_environment(self.stream.settings)
        return subprocess.Popen([*command, "--key", key, "--wait", "120"], env=env, **pipes)


def finished(process: subprocess.Popen[str]) -> bool:
    """A redrive's end: True if it put letters back, False if another had already (the
    second of two at once, or one run again after a kill that came too late)."""
    out, err = process.communicate(timeout=180)
    if process.returncode == 0:
        return True
    assert process.returncode == 1 and "no dead letters of key" in err, err + out
    return False


@pytest.mark.parametrize(("mode", "queue_type", "seed"), _cases())
def test_no_key_is_stranded_under_park_pause_redrive_and_kills(
    stream: StreamFixture,
    workers: Any,
    amqp: Any,
    tmp_path: Path,
    mode: str,
    queue_type: str,
    seed: int,
) -> None:
    run = Scenario(stream, workers, tmp_path, mode, seed)
    rng = run.rng
    keys = [f"acct-{rng.randrange(10_000)}-{i}" for i in range(KEYS)]
    poisoned = {key: rng.randint(2, EVENTS - 5) for key in keys[: max(3, KEYS // 8)]}
    paused = keys[len(poisoned) : len(poisoned) + 3]
    pause_at, kill_at = rng.randint(3, EVENTS // 3), rng.randint(EVENTS // 3, 2 * EVENTS // 3)
    print(f"seed {seed}: poison {poisoned}, pause {paused} at {pause_at}, kill at {kill_at}")

    producer = Producer(
        stream.name,
        mode=mode,
        buckets=None if mode == "key" else 4,
        queue_type=queue_type,
        settings=stream.settings,
    )
    run.worker().wait_ready()
    run.worker()
    run.keyq("stream", "set", "--poison-policy", "park")
    stranded_after = {"KEYQ_STRANDED_AFTER_S": "5"}
    janitor = idle_janitor(
        stream.settings, tmp_path, stream.name, idle_ttl_s=1, every_s=0.5, env=stranded_after
    )
    store = StateStore(stream.redis, stream.name)
    control = KeyControl(stream.redis, stream.name)

    def seen(key: str) -> list[int]:
        state = store.get(key) or {"seen": {}}
        return list(state["seen"].get(producer.producer_id, []))

    try:
        for n in range(1, EVENTS + 1):
            if n == pause_at:
                run.keyq("pause", *(arg for key in paused for arg in ("--key", key)))
            if n == kill_at:
                run.kill_one()
                run.worker()
            for key in keys:
                event: dict[str, Any] = {"n": n, "producer": producer.producer_id}
                if poisoned.get(key) == n:
                    event["poison"] = True
                producer.publish(key, event)
            time.sleep(rng.uniform(0, 0.05))
        producer.flush(timeout=60)

        flowing = [key for key in keys if key not in poisoned and key not in paused]
        everything = list(range(1, EVENTS + 1))
        for key in flowing:
            wait_until(lambda k=key: seen(k) == everything, 180, f"key {key} to flow")
        wait_until(lambda: set(control.parked()) == set(poisoned), 60, "the poisoned keys parked")

        run.fixed.touch()
        first, second, *others = list(poisoned)
        together = [run.redrive(first), run.redrive(first)]
        killed = run.redrive(second)
        time.sleep(rng.uniform(0.05, 1.0))
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        run.kill_one()
        run.worker()
        outcomes = [finished(process) for process in together]
        assert True in outcomes, "neither of two redrives at once put the key's letter back"
        finished(run.redrive(second))  # again, after the kill
        for key in others:
            assert finished(run.redrive(key))

        run.kill_all()  # every worker restarts while the paused keys are resumed
        run.keyq("resume", *(arg for key in paused for arg in ("--key", key)))
        time.sleep(3.0)  # past the janitor's idle ttl and the dead workers' locks
        run.worker()
        run.worker()

        def stuck() -> str:
            return ", ".join(f"{key}: {len(seen(key))}" for key in keys if seen(key) != everything)

        try:
            wait_until(lambda: not stuck(), 240, "every key applied 1..N once, in order")
        except AssertionError:
            for key in (key for key in keys if seen(key) != everything):
                inspect = ("inspect", "--stream", stream.name, "--key", key)
                print(run_keyq(stream.settings, *inspect).stdout)
            raise AssertionError(f"seed {seed}: keys not applied 1..N: {stuck()}") from None
        for key in keys:
            assert seen(key) == everything, (key, seen(key))
        wait_until(lambda: not control.keys_aside(), 60, "nothing left aside")
        assert control.parked() == {} and control.paused() == {}
        assert queue_depth(amqp, dead_letter_queue_name(stream.name)) == 0
        record = StrandedRecord(stream.redis, stream.name)
        wait_until(lambda: record.all() == {}, 30, "no key reported stranded")
        if mode == "auto":  # the paused keys moved to queues of their own, held back
            assert RouteBook(stream.redis, stream.name).counts().get("promoted:stopped", 0) > 0
    finally:
        producer.close(timeout=10)
        janitor.terminate()
        janitor.close()
