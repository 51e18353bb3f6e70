"""keyq daemons as child processes, for the demo: start, kill -9, stop, and their ids."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

from keyq.broker.membership import Membership


class Daemon:
    """``python -m keyq <command> ...`` with its output in a log file."""

    def __init__(self, kind: str, args: list[str], log_dir: Path) -> None:
        self.kind = kind
        self.id = f"{kind}-{uuid.uuid4().hex[:6]}"
        self.log_path = log_dir / f"{self.id}.log"
        id_option = "--worker-id" if kind == "worker" else "--janitor-id"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "keyq", kind, *args, id_option, self.id],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
        )
        self.started = time.monotonic()

    def serving(self, membership: Membership) -> bool:
        """A worker that says in Redis that its first claim round is done (False while Redis
        does not answer)."""
        try:
            return self.kind == "worker" and membership.serving(self.id)
        except (redis.RedisError, OSError):
            return False

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """kill -9: no cleanup of any kind."""
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self._log.close()

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then wait for a clean exit (kill -9 after ``timeout``)."""
        if self.alive:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        return int(self.process.returncode or 0)


def log_folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="keyq-demo-"))
