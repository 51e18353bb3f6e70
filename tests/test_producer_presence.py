"""A producer keeps its presence in Redis while it runs and loses it when it stops, so that
a worker can tell a sequence gap that will still fill from one that never will
(``keyq.broker.producer_presence``). Real producer processes, killed with -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from keyq import Producer
from keyq.broker.producer_presence import ProducerPresence
from tests.conftest import StreamFixture
from tests.workers import wait_until

_RUN_A_PRODUCER = """
import sys, time
from keyq import Producer
producer = Producer(sys.argv[1], mode="key")
producer.publish("acct", {"n": 1})
producer.flush(30)
print(producer.producer_id, flush=True)
time.sleep(600)
"""


def test_a_producer_is_present_while_it_runs_and_gone_once_closed(
    stream: StreamFixture, producer: Producer
) -> None:
    presence = ProducerPresence(stream.redis, stream.name)
    assert presence.alive([producer.producer_id, "someone-else"]) == {producer.producer_id}
    producer.publish("acct", {"n": 1})
    producer.close(30)
    assert presence.alive([producer.producer_id]) == set()


def test_a_killed_producer_is_gone_within_its_ttl(stream: StreamFixture) -> None:
    ttl_s = 1.0
    env = {
        **os.environ,
        "KEYQ_AMQP_URL": stream.settings.amqp_url,
        "KEYQ_REDIS_URL": stream.settings.redis_url,
        "KEYQ_PRODUCER_TTL_MS": str(int(ttl_s * 1000)),
    }
    process = subprocess.Popen(
        [sys.executable, "-c", _RUN_A_PRODUCER, stream.name],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    presence = ProducerPresence(stream.redis, stream.name)
    try:
        assert process.stdout is not None
        producer_id = process.stdout.readline().strip()
        assert producer_id, process.communicate(timeout=30)[0]
        time.sleep(3 * ttl_s)  # renewed while it runs, though its ttl passed thrice
        assert presence.alive([producer_id]) == {producer_id}
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        wait_until(lambda: not presence.alive([producer_id]), ttl_s + 1, "it to be gone", 0.05)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
