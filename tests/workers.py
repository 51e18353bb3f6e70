"""Worker daemons as real processes, for tests that kill, pause and restart them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import redis

from keyq.broker.locks import FencedLocks
from keyq.broker.membership import Membership
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.redis_topology import connect, parse_redis_url
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import Settings
from keyq.worker.amqp.deliveries import DeliveryBuffer
from keyq.worker.amqp.link import ConsumerLink

REPO = Path(__file__).resolve().parent.parent

# Fast failover for tests: short ttls, small batches so runs see many commits.
FAST = {
    "KEYQ_LOCK_TTL_MS": "2000",
    "KEYQ_MEMBER_TTL_MS": "2000",
    "KEYQ_TICK_MS": "200",
    "KEYQ_SCAN_INTERVAL_MS": "500",
    "KEYQ_BATCH_MAX_EVENTS": "500",
    "KEYQ_BATCH_MAX_MS": "200",
    "KEYQ_SPARK_MASTER": "local[1]",
    "KEYQ_AMQP_HEARTBEAT": "2",
}


def keyq_environment(settings: Settings, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a keyq process under test: these services, this checkout."""
    return {
        **os.environ,
        "KEYQ_AMQP_URL": settings.amqp_url,
        "KEYQ_REDIS_URL": settings.redis_url,
        "PYTHONPATH": str(REPO),
        **(extra or {}),
    }


def run_keyq(
    settings: Settings, *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m keyq ARGS`` to completion, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "keyq", *args],
        capture_output=True,
        text=True,
        env=keyq_environment(settings, env),
        timeout=timeout,
        cwd=REPO,
    )


def bare_link(
    settings: Settings,
    stream: str,
    name: str,
    *,
    prefetch: int,
    buffer: DeliveryBuffer | None = None,
) -> ConsumerLink:
    """A worker's AMQP link, not started, with no worker heeding losses or disconnects: to
    drive consuming, acking and closing directly."""
    return ConsumerLink(
        settings=settings,
        stream=stream,
        name=name,
        buffer=buffer if buffer is not None else DeliveryBuffer(),  # an empty one is falsy
        prefetch=prefetch,
        on_disconnected=lambda _reason: None,
    )


def wait_until(check: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


class LoggedProcess:
    """``python -m keyq ARGS`` in a subprocess of this checkout, its output in ``log_path``."""

    def __init__(self, log_path: Path, args: list[str], env: dict[str, str], **popen: Any) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "keyq", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            **popen,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM and wait for a clean exit; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(10)
        self._log.close()


class WorkerProcess(LoggedProcess):
    """``keyq worker`` in a subprocess (``new_session``: a process group of its own)."""

    def __init__(
        self,
        settings: Settings,
        stream: str,
        log_dir: Path,
        *,
        pipeline: str = "tests.pipelines:audit",
        sink: str | None = None,
        env: Mapping[str, str] | None = None,
        until_idle: float | None = None,
        name: str | None = None,
        mode: str | None = None,
        buckets: int | None = None,
        new_session: bool = False,
    ) -> None:
        self.worker_id = name or f"w-{uuid.uuid4().hex[:8]}"
        self.stream = stream
        args = ["worker", "--stream", stream, "--pipeline", pipeline, "--worker-id", self.worker_id]
        options = ("--sink", "--mode", "--buckets", "--until-idle")
        for option, value in zip(options, (sink or None, mode, buckets, until_idle), strict=True):
            if value is not None:
                args += [option, str(value)]
        environment = keyq_environment(settings, {**FAST, **(env or {})})
        self._redis_url = environment["KEYQ_REDIS_URL"]
        super().__init__(
            log_dir / f"{self.worker_id}.log", args, environment, start_new_session=new_session
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float = 90) -> WorkerProcess:
        """Until the worker says in Redis that its first claim round is done."""
        client = connect(parse_redis_url(self._redis_url), socket_timeout=5)
        membership = Membership(client, self.stream, ttl_ms=1)

        def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited early:\n{self.log()[-3000:]}")
            try:
                return membership.serving(self.worker_id)
            except (redis.RedisError, OSError):
                return False  # a test may be cutting Redis: ask again

        try:
            wait_until(ready, timeout, f"worker {self.worker_id} to start")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its log ends:\n{self.log()[-3000:]}") from None
        finally:
            client.close()
        return self

    def kill(self) -> None:
        """kill -9: no cleanup of any kind."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def signal_group(self, signum: int) -> None:
        """Signal the worker's whole process group, as ``kill -- -PGID``, a supervisor or a
        terminal's Ctrl-C does (only for a worker started with ``new_session``)."""
        assert os.getpgid(self.process.pid) == self.process.pid, "not a group of its own"
        os.killpg(self.process.pid, signum)

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)


class JanitorProcess(LoggedProcess):
    """``keyq janitor ARGS`` in a subprocess."""

    def __init__(
        self, settings: Settings, log_dir: Path, *args: str, env: Mapping[str, str] | None = None
    ) -> None:
        log_path = log_dir / f"janitor-{uuid.uuid4().hex[:8]}.log"
        super().__init__(log_path, ["janitor", *args], keyq_environment(settings, env))

    def terminate(self, timeout: float = 30) -> int:
        return super().terminate(timeout)


def idle_janitor(
    settings: Settings,
    log_dir: Path,
    stream: str,
    *,
    idle_ttl_s: int,
    every_s: float,
    env: Mapping[str, str] | None = None,
) -> JanitorProcess:
    """A janitor of ``stream`` reclaiming queues idle ``idle_ttl_s``, looking every ``every_s``."""
    env = {"KEYQ_JANITOR_INTERVAL_S": str(every_s), **(env or {})}
    return JanitorProcess(
        settings, log_dir, "--stream", stream, "--idle-ttl", str(idle_ttl_s), env=env
    )


def held_by(client: redis.Redis, stream: str) -> dict[str, list[str]]:
    """worker id -> queues whose lock it holds now."""
    owners: dict[str, list[str]] = {}
    holders = FencedLocks(client, stream).holders(list(QueueRegistry(client, stream).queues()))
    for queue, lease in holders.items():
        if lease is not None:
            owners.setdefault(lease.owner, []).append(queue)
    return owners


def wait_until_members_see_each_other(
    client: redis.Redis, stream: str, worker_ids: list[str], timeout: float = 30
) -> None:
    """Until each worker has heartbeated twice since this call: its claim loop reads the live
    members in the tick that heartbeats, so after two each counts all others in its share."""
    members = StreamKeys(stream).members

    def stamps() -> dict[str, float]:
        return {w: float(client.zscore(members, w) or 0.0) for w in worker_ids}

    seen = {w: [stamp] for w, stamp in stamps().items()}

    def risen_twice() -> bool:
        for worker, stamp in stamps().items():
            if stamp > seen[worker][-1]:
                seen[worker].append(stamp)
        return all(len(history) >= 3 for history in seen.values())

    wait_until(risen_twice, timeout, f"workers {worker_ids} to see each other", every=0.05)
