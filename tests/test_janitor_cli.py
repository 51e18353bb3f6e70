"""``keyq janitor`` from the shell: one pass reclaims a drained idle queue; bad settings exit 2
in one line; a broker that is down is waited for rather than fatal."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

from keyq import Producer
from keyq.broker.naming import key_queue_name
from keyq.broker.settings import Settings
from tests.helpers import queue_depth
from tests.workers import REPO, JanitorProcess, keyq_environment, wait_until

EXIT_USAGE = 2


def keyq(settings: Settings, *args: str, env: dict[str, str] | None = None) -> Any:
    environment = keyq_environment(settings, env)
    return subprocess.Popen(
        [sys.executable, "-m", "keyq", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
        cwd=REPO,
    )


def test_one_pass_reclaims_a_drained_idle_queue(stream: Any, amqp: Any) -> None:
    with Producer(stream.name, mode="key") as producer:
        producer.publish("gone-quiet", {"n": 1})
        producer.publish("still-busy", {"n": 1})
        producer.flush()
    quiet = key_queue_name(stream.name, "gone-quiet")
    busy = key_queue_name(stream.name, "still-busy")
    amqp.channel().queue_purge(quiet)
    process = keyq(
        stream.settings,
        "janitor",
        "--stream",
        stream.name,
        "--idle-ttl",
        "0",
        "--once",
        env={"KEYQ_PUBLISH_LEASE_MS": "200", "KEYQ_RETIRE_GRACE_MS": "500"},
    )
    _out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert queue_depth(amqp, quiet) is None  # deleted
    assert queue_depth(amqp, busy) == 1  # a queue with an event stays
    assert "'deleted': 1" in err and "'not_empty': 1" in err


def test_bad_settings_exit_2_in_one_line(settings: Settings) -> None:
    process = keyq(settings, "janitor", "--once", env={"KEYQ_JANITOR_CONNECTIONS": "0"})
    _out, err = process.communicate(timeout=60)
    assert process.returncode == EXIT_USAGE
    assert "KEYQ_JANITOR_CONNECTIONS" in err
    assert "Traceback" not in err


def test_a_broker_that_is_down_is_waited_for(settings: Settings) -> None:
    # Nothing listens on port 1: the janitor retries with backoff until stopped.
    process = keyq(
        settings,
        "janitor",
        env={
            "KEYQ_AMQP_URL": "amqp://guest:hidden-pw@127.0.0.1:1/%2F",
            "KEYQ_CONNECT_TIMEOUT": "1",
        },
    )
    time.sleep(6)
    assert process.poll() is None  # still running, retrying
    process.send_signal(signal.SIGTERM)
    _out, err = process.communicate(timeout=60)
    assert process.returncode == 0
    assert "retrying" in err
    assert "hidden-pw" not in err


def counter(text: str, family: str) -> float:
    """The sum of a counter's samples in a Prometheus text page (0 if absent)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{family} ", f"{family}{{"))
    )


def test_metrics_endpoint_of_the_running_janitor(stream: Any, tmp_path: Any) -> None:
    with Producer(stream.name, mode="key") as producer:
        producer.publish("k", {"n": 1})
        producer.flush()
    # Port 0: the janitor binds a free port itself (no window in which another process could
    # take one the test picked) and logs which.
    janitor = JanitorProcess(
        stream.settings,
        tmp_path,
        "--stream",
        stream.name,
        "--metrics-port",
        "0",
        env={"KEYQ_JANITOR_INTERVAL_S": "0.2"},
    )
    try:
        bound = wait_until(
            lambda: re.search(r"metrics on http://[^:]+:(\d+)/metrics", janitor.log()),
            30,
            "metrics",
        )
        url = f"http://127.0.0.1:{bound.group(1)}/metrics"

        def page_after_a_pass() -> str:
            with urllib.request.urlopen(url, timeout=2) as response:
                text = str(response.read().decode())
            # The counter is served (as 0) before the first pass: wait for a pass, not a name.
            return text if counter(text, "keyq_janitor_passes_total") >= 1 else ""

        text = wait_until(page_after_a_pass, 30, "a completed janitor pass")
        for family in (
            "keyq_janitor_passes_total",
            "keyq_janitor_deletions_total",
            "keyq_janitor_skipped_total",
            "keyq_janitor_errors_total",
        ):
            assert f"# TYPE {family} counter" in text, text
    finally:
        assert janitor.terminate(60) == 0
        janitor.close()
