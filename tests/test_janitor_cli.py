"""``keyq janitor`` from the shell: one pass reclaims a drained idle queue; bad settings exit 2
in one line; a broker that is down is waited for rather than fatal. Its metrics endpoint is
scraped in tests/test_metrics.py."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

from keyq import Producer
from keyq.broker.settings import Settings
from tests.helpers import queue_depth
from tests.workers import REPO, keyq_environment, run_keyq

EXIT_USAGE = 2


def test_one_pass_reclaims_a_drained_idle_queue_and_bad_settings_exit_2_in_one_line(
    stream: Any, producer: Producer, amqp: Any
) -> None:
    quiet = producer.publish("gone-quiet", {"n": 1}).queue
    busy = producer.publish("still-busy", {"n": 1}).queue
    producer.flush()
    amqp.channel().queue_purge(quiet)
    env = {"KEYQ_PUBLISH_LEASE_MS": "200", "KEYQ_RETIRE_GRACE_MS": "500"}
    done = run_keyq(
        stream.settings, "janitor", "--stream", stream.name, "--idle-ttl", "0", "--once", env=env
    )
    assert done.returncode == 0, done.stderr
    assert queue_depth(amqp, quiet) is None  # deleted
    assert queue_depth(amqp, busy) == 1  # a queue with an event stays
    assert "'deleted': 1" in done.stderr and "'not_empty': 1" in done.stderr
    done = run_keyq(stream.settings, "janitor", "--once", env={"KEYQ_JANITOR_CONNECTIONS": "0"})
    assert done.returncode == EXIT_USAGE
    assert "KEYQ_JANITOR_CONNECTIONS" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_broker_that_is_down_is_waited_for(settings: Settings) -> None:
    """Nothing listens on port 1: the janitor retries with backoff until stopped."""
    down = {"KEYQ_AMQP_URL": "amqp://guest:hidden-pw@127.0.0.1:1/%2F", "KEYQ_CONNECT_TIMEOUT": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "keyq", "janitor"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=keyq_environment(settings, down),
        cwd=REPO,
    )
    # Stopped once it has said it retries (a fixed sleep raced its start on a loaded machine).
    assert process.stderr is not None
    seen = [process.stderr.readline()]
    while "retrying" not in seen[-1] and seen[-1]:
        seen.append(process.stderr.readline())
    assert process.poll() is None, "".join(seen)  # still running, retrying
    process.send_signal(signal.SIGTERM)
    _out, rest = process.communicate(timeout=60)
    err = "".join(seen) + rest
    assert process.returncode == 0, err
    assert "hidden-pw" not in err
