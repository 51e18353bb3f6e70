"""A broker that accepts TCP but never completes the AMQP handshake is unavailable, said in one
line naming the broker (not its password) and the handshake's seconds: daemons retry, one-shot
commands exit 1, the producer raises in bounded time, the demo's chaos goes on."""

from __future__ import annotations

import re
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pika
import pytest
import redis

from keyq import Producer
from keyq.broker.errors import BrokerUnavailable
from keyq.broker.locks import FencedLocks
from keyq.broker.membership import Membership
from keyq.broker.naming import key_queue_name
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import ensure_stream_config
from keyq.demo.processes import Daemon
from keyq.demo.runner import Demo, DemoOptions
from tests.faults import FaultProxy
from tests.helpers import drain
from tests.silent_broker import SilentListener
from tests.workers import JanitorProcess, run_keyq, wait_until

PASSWORD = "never-shown-pw"
CONNECT_TIMEOUT = 0.5  # s; the handshake gets twice that (pika's stack timeout)
HANDSHAKE = re.compile(r"did not complete the AMQP handshake in 1 s")
EXIT_FAILURE = 1


@pytest.fixture
def silent() -> Iterator[SilentListener]:
    with SilentListener() as listener:
        yield listener


def silent_env(listener: SilentListener) -> dict[str, str]:
    """A keyq process's settings pointing at ``listener``, with a short connect timeout."""
    return {
        "KEYQ_AMQP_URL": listener.url_for(f"amqp://guest:{PASSWORD}@localhost/%2F"),
        "KEYQ_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT),
    }


def silent_settings(settings: Settings, listener: SilentListener) -> Settings:
    return load_settings(
        amqp_url=listener.url_for(f"amqp://guest:{PASSWORD}@localhost/%2F"),
        redis_url=settings.redis_url,
        connect_timeout=CONNECT_TIMEOUT,
    )


def assert_one_line_failure(done: subprocess.CompletedProcess[str]) -> None:
    """Exit 1, and stderr is one line saying why: the handshake, the broker without its
    password."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == EXIT_FAILURE, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("keyq: RabbitMQ at amqp://guest:***@127.0.0.1:"), lines[0]
    assert HANDSHAKE.search(lines[0]), lines[0]
    assert PASSWORD not in done.stderr + done.stdout


# --------------------------------------------------------------------------- the worker
@pytest.mark.broker_versions
def test_a_worker_waits_for_a_silent_broker_logging_each_attempt_and_goes_on_once_it_answers(
    stream: Any, workers: Any
) -> None:
    """The broker silent (a paused proxy in front of it: TCP is accepted, nothing is said),
    then answering: one warning per attempt, no password, then past its services check."""
    broker = urlsplit(stream.settings.amqp_url)
    with FaultProxy(broker.hostname or "127.0.0.1", broker.port or 5672) as proxy:
        proxy.pause()
        env = {
            "KEYQ_AMQP_URL": proxy.url_for(stream.settings.amqp_url),
            "KEYQ_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT),
        }
        worker = workers(stream.name, env=env)
        # Each attempt takes the handshake's 1 s, then the backoff (0.5, 1, 2… s).
        wait_until(
            lambda: len(HANDSHAKE.findall(worker.log())) >= 3 or worker.process.poll() is not None,
            30,
            "three attempts on the silent broker",
        )
        assert worker.process.poll() is None, worker.log()[-3000:]
        warnings = [line for line in worker.log().splitlines() if HANDSHAKE.search(line)]
        assert len(warnings) >= 3
        assert all(
            " WARNING keyq.worker " in line and "waiting for the services, retrying in" in line
            for line in warnings
        ), warnings
        assert len(warnings) in (proxy.accepted, proxy.accepted - 1), (warnings, proxy.accepted)
        assert all(f"//{broker.username}:***@127.0.0.1:" in line for line in warnings), warnings
        assert f":{broker.password}@" not in worker.log(), "the password is in the worker's log"
        proxy.resume()
        # The line on how Redis persists comes right after the services check passed.
        wait_until(
            lambda: "Redis " in worker.log() or worker.process.poll() is not None,
            30,
            "the services check to pass",
        )
        assert worker.process.poll() is None, worker.log()[-3000:]
        assert worker.terminate(60) == 0
    assert "Traceback" not in worker.log()


# --------------------------------------------------------------------------- the janitor
def test_the_janitor_daemon_retries_a_broker_that_never_answers(
    settings: Settings, silent: SilentListener, tmp_path: Path
) -> None:
    janitor = JanitorProcess(settings, tmp_path, "--log-level", "WARNING", env=silent_env(silent))
    try:
        # A pass fails after the handshake's 1 s, then waits 1 s, 2 s…: three passes in 6 s.
        wait_until(
            lambda: silent.accepted >= 3 or janitor.process.poll() is not None, 30, "3 passes"
        )
        assert janitor.process.poll() is None
        assert janitor.terminate(60) == 0, janitor.log()[-3000:]
    finally:
        janitor.close()
    log = janitor.log()
    retries = [line for line in log.splitlines() if "janitor pass failed, retrying in" in line]
    assert len(retries) >= 2, log[-3000:]
    assert all(HANDSHAKE.search(line) for line in retries), retries
    assert "Traceback" not in log
    assert PASSWORD not in log


# --------------------------------------------------------------------- one-shot and the producer
def test_one_shot_commands_and_the_producer_on_a_broker_that_never_answers_fail_in_one_line(
    stream: Any, silent: SilentListener
) -> None:
    """One janitor pass, status (text and JSON: asked of the broker once the stream is
    configured, one attempt each), publish (in bounded time) and the demo; the producer's
    constructor raises ``BrokerUnavailable`` after one attempt, in bounded time."""
    ensure_stream_config(stream.redis, stream.name, "key")
    for command in [
        ("janitor", "--once", "--log-level", "WARNING"),
        ("status", "--stream", stream.name),
        ("status", "--stream", stream.name, "--json"),
        ("publish", "--stream", stream.name, "--key", "k", "--event", "{}"),
        ("demo", "--orders", "5", "--events", "20", "--wait-for-services", "0"),
    ]:
        started, attempts = time.monotonic(), silent.accepted
        done = run_keyq(stream.settings, *command, env=silent_env(silent), timeout=60)
        assert_one_line_failure(done)
        if command[0] == "status":
            assert silent.accepted == attempts + 1
        if command[0] == "publish":
            assert time.monotonic() - started < 20
    started, attempts = time.monotonic(), silent.accepted
    with pytest.raises(BrokerUnavailable) as raised:
        Producer(stream.name, mode="key", settings=silent_settings(stream.settings, silent))
    took = time.monotonic() - started
    # The handshake has 1 s; the constructor gives up waiting after 3 connect timeouts + 1 s
    # (with room for a busy machine: the point is a bound, where the old code had none).
    assert took < CONNECT_TIMEOUT * 3 + 1 + 5, took
    message = str(raised.value)
    assert HANDSHAKE.search(message), message
    assert "amqp://guest:***@127.0.0.1:" in message
    assert PASSWORD not in message + repr(raised.value)
    assert silent.accepted == attempts + 1, "the producer's constructor tried more than once"


@pytest.mark.broker_versions
def test_a_producer_whose_broker_goes_silent_reconnects_once_it_answers(
    stream: Any, amqp: pika.BlockingConnection
) -> None:
    """Connected, then the broker says nothing more (a paused proxy: new connections are
    accepted and get no answer either): reconnect attempts fail on the handshake, and once the
    broker answers again, every event is confirmed, in order."""
    broker = urlsplit(stream.settings.amqp_url)
    with FaultProxy(broker.hostname or "127.0.0.1", broker.port or 5672) as proxy:
        settings = load_settings(
            amqp_url=proxy.url_for(stream.settings.amqp_url),
            redis_url=stream.settings.redis_url,
            connect_timeout=CONNECT_TIMEOUT,
            amqp_heartbeat=1,
            confirm_timeout=1.0,
            reconnect_timeout=60.0,
        )
        with Producer(stream.name, mode="key", settings=settings) as producer:
            for n in range(5):
                producer.publish("k", {"n": n})
            producer.flush(10)
            proxy.pause()
            for n in range(5, 10):
                producer.publish("k", {"n": n})
            # The overdue confirms make it reconnect; each attempt meets the silence (a new
            # connection through the paused proxy, never answered).
            wait_until(lambda: proxy.connections >= 3, 30, "two reconnect attempts")
            proxy.resume()
            producer.flush(30)
            assert producer.stats["resent"] >= 5
    landed = drain(amqp.channel(), key_queue_name(stream.name, "k"))
    # Re-sent events may land twice (a confirm lost with the connection); each n in order.
    firsts = list(dict.fromkeys(message.json()["n"] for message in landed))
    assert firsts == list(range(10)), firsts


# --------------------------------------------------------------------------- the demo's chaos
class _SleepingWorker(Daemon):
    """A stand-in for a worker: a real process (``sleep``) that says in Redis it serves and
    holds one queue, so that a chaos step kills it and measures the failover."""

    def __init__(self, client: redis.Redis, stream: str, log_dir: Path) -> None:
        self.kind = "worker"
        self.id = f"worker-{uuid.uuid4().hex[:6]}"
        self.log_path = log_dir / f"{self.id}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(["sleep", "120"], stdout=self._log)
        self.started = time.monotonic()
        Membership(client, stream, ttl_ms=120_000).heartbeat(self.id, {"ready": True})
        queue = key_queue_name(stream, self.id)
        QueueRegistry(client, stream).register({queue: self.id}, announce=False)
        assert FencedLocks(client, stream).acquire(queue, self.id, 120_000) is not None


class _ChaosOnly(Demo):
    """The demo's chaos thread, fast, over stand-in workers."""

    chaos_pause_s = (0.05, 0.1)

    def __init__(self, settings: Settings, options: DemoOptions, log_dir: Path) -> None:
        super().__init__(settings, options)
        self.client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
        self.log_dir = log_dir

    def _start_worker(self) -> Daemon:
        worker = _SleepingWorker(self.client, self.stream, self.log_dir)
        with self._lock:
            self._workers.append(worker)
        return worker


def test_the_chaos_thread_reports_a_step_the_silent_broker_failed_and_goes_on(
    stream: Any, silent: SilentListener, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    demo = _ChaosOnly(
        silent_settings(stream.settings, silent),
        DemoOptions(stream=stream.name, max_workers=3, seed=3),
        tmp_path,
    )
    for _ in range(2):
        demo._start_worker()
    chaos = threading.Thread(target=demo._chaos_loop, args=(demo.client,), daemon=True)
    try:
        with caplog.at_level("WARNING", logger="keyq.demo"):
            chaos.start()

            def failed_then_more() -> bool:
                actions = list(demo.chaos.actions)
                failed = [i for i, action in enumerate(actions) if "failed" in action]
                return bool(failed) and failed[0] < len(actions) - 1

            wait_until(lambda: failed_then_more() or not chaos.is_alive(), 30, "a failed step")
            assert chaos.is_alive(), "the chaos thread died"
            assert failed_then_more(), demo.chaos.actions
    finally:
        demo._stop.set()
        chaos.join(10)
        for worker in demo._workers:
            worker.kill()
        demo.client.close()
    failed = [action for action in demo.chaos.actions if "failed" in action]
    assert demo.chaos.failed_steps == len(failed)
    for action in failed:
        assert action["action"] == "kill -9" and action["held"] == 1, action
        assert action["failed"].startswith("failover not measured: RabbitMQ at "), action
        assert HANDSHAKE.search(action["failed"]), action
    lines = [r.getMessage() for r in caplog.records if r.name == "keyq.demo"]
    assert len(lines) == len(failed), lines
    assert all("chaos step kill -9 failed, going on with the next" in line for line in lines)
    assert not any(r.exc_info for r in caplog.records if r.name == "keyq.demo")
    assert PASSWORD not in caplog.text
