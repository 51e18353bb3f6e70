"""Private RabbitMQ and Redis servers that a test starts, owns and may restart.

The shared services are never restarted by a test (other tests and sessions use them); a test
that needs a broker or Redis restart starts its own from the locally installed binaries, on
free loopback ports, with its data in a temporary folder, and restarts those.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pika
import redis

_RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_for(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            last = exc
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not come up in {timeout:.0f}s: {last}")


def private_servers_available() -> str | None:
    """None if both servers can be started here, else why not."""
    if shutil.which("redis-server") is None:
        return "redis-server is not installed"
    if not (_RABBIT_BIN / "rabbitmq-server").exists():
        return f"rabbitmq-server is not installed under {_RABBIT_BIN}"
    return None


class PrivateRedis:
    """A redis-server that keeps every write on disk (AOF, fsync always), so it can be killed
    and restarted without losing committed state, as a production Redis for keyq must."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> PrivateRedis:
        log = (self.folder / "redis.log").open("ab")
        self._process = subprocess.Popen(
            [
                "redis-server",
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dir",
                str(self.folder),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        _wait_for(lambda: redis.Redis.from_url(self.url).ping(), 20, "private Redis")
        return self

    def kill(self) -> None:
        """kill -9: a crash, not a shutdown."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait(10)
        self._process = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        self.kill()


class PrivateRabbit:
    """A second RabbitMQ node of the installed release, on its own ports, run as this user.

    ``management`` enables the management plugin on a free port of its own (``management_url``,
    statistics refreshed every second); ``nofile`` starts the node with that file-descriptor
    limit (soft and hard), as a systemd ``LimitNOFILE=`` would.
    """

    def __init__(
        self, folder: Path, *, management: bool = False, nofile: int | None = None
    ) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.node = f"keyq{self.port}@localhost"
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"
        self.nofile = nofile
        self.management_url: str | None = None
        config = f"listeners.tcp.default = 127.0.0.1:{self.port}\nloopback_users = none\n"
        plugins = "[]"
        if management:
            management_port = free_port()
            self.management_url = f"http://guest:guest@127.0.0.1:{management_port}"
            plugins = "[rabbitmq_management]"
            config += (
                f"management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {management_port}\n"
                "collect_statistics_interval = 1000\n"
            )
        (self.folder / "enabled_plugins").write_text(f"{plugins}.\n")
        (self.folder / "rabbitmq.conf").write_text(config)
        cookie = self.folder / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(secrets.token_hex(16).upper())
            cookie.chmod(0o400)
        self._env = {
            **os.environ,
            "HOME": str(self.folder),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_MNESIA_BASE": str(self.folder / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.folder / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.folder / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.folder / "rabbitmq.conf"),
            "RABBITMQ_PID_FILE": str(self.folder / "pid"),
        }

    def ctl(self, *args: str, timeout: float = 90) -> str:
        """``rabbitmqctl -n`` this node; its output."""
        done = subprocess.run(
            [str(_RABBIT_BIN / "rabbitmqctl"), "-n", self.node, *args],
            env=self._env,
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return done.stdout

    def start(self) -> PrivateRabbit:
        command = [str(_RABBIT_BIN / "rabbitmq-server"), "-detached"]
        if self.nofile is not None:
            command = ["prlimit", f"--nofile={self.nofile}:{self.nofile}", *command]
        subprocess.run(
            command,
            env=self._env,
            check=True,
            capture_output=True,
            timeout=30,
        )
        self.ctl("wait", str(self.folder / "pid"), "--timeout", "90", timeout=120)

        def answers() -> bool:
            pika.BlockingConnection(pika.URLParameters(self.url)).close()
            return True

        _wait_for(answers, 30, "private RabbitMQ")
        return self

    def stop(self) -> None:
        """A clean stop: durable queues and persistent messages are kept for the next start."""
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self.ctl("stop", str(self.folder / "pid"), timeout=60)
        with contextlib.suppress(OSError, ValueError):  # it would not stop: end it
            os.kill(int((self.folder / "pid").read_text().strip()), signal.SIGKILL)
        (self.folder / "pid").unlink(missing_ok=True)

    def restart(self) -> None:
        self.stop()
        self.start()
