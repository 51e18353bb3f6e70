"""Idempotent publishing across restarts: a producer process publishes events with dedupe ids
and is killed -9 before flushing; a new process publishes the same events with the same ids;
each is applied once, in order, whichever process's copy got there first."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

import orjson
import pytest

from tests.conftest import StreamFixture
from tests.workers import keyq_environment, wait_until

pytestmark = pytest.mark.slow

EVENTS = 300
PUBLISHER = f"""
import sys, time
from keyq import Producer
stream, then = sys.argv[1], sys.argv[2]
producer = Producer(stream, mode="key")
for n in range(1, {EVENTS} + 1):
    producer.publish("order-key", {{"n": n, "producer": "app"}}, dedupe_id=f"order-{{n}}")
    if then == "hang" and n == {EVENTS} // 2:
        producer.flush(timeout=30)  # half confirmed, the rest on its way when killed
if then == "hang":
    print("published", flush=True)
    time.sleep(120)  # killed -9 here, never flushed
producer.flush(timeout=30)
producer.close()
print("flushed", flush=True)
"""


def seen(stream: StreamFixture) -> list[int]:
    raw = stream.redis.hget(stream.keys.state, "order-key")
    return [] if raw is None else list(orjson.loads(raw)["seen"].get("app", []))


def test_a_restarted_producer_republishing_the_same_ids_applies_each_once(
    stream: StreamFixture, workers: Any
) -> None:
    worker = workers(stream.name, pipeline="tests.pipelines:ledger", mode="key")
    worker.wait_ready()
    env = keyq_environment(stream.settings)
    first = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, stream.name, "hang"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert first.stdout is not None
    assert first.stdout.readline().strip() == "published"
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    # What the killed process got to the broker is applied; wait until it is, so that the
    # second process's copies of those events are repeats the worker must recognise.
    wait_until(lambda: len(seen(stream)) > 0, 30, "the killed producer's events applied")
    time.sleep(1.0)
    before = len(seen(stream))
    again = subprocess.run(
        [sys.executable, "-c", PUBLISHER, stream.name, "flush"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    wait_until(lambda: len(seen(stream)) >= EVENTS, 90, "every event applied")
    time.sleep(1.0)  # let anything late land before the final check
    applied = seen(stream)
    print(f"{before} events applied from the killed producer before the second started")
    assert applied == list(range(1, EVENTS + 1)), applied[:20]
    assert worker.terminate() == 0, worker.log()[-3000:]
