"""Private RabbitMQ and Redis servers that a test starts, owns and may restart (the shared
services are never restarted), on free loopback ports with their data in a temporary folder.

The release is the environment's choice (:class:`Release`): the installed RabbitMQ and
redis-server by default; with ``KEYQ_TEST_RABBITMQ=4``, RabbitMQ 4.3 and Valkey 9 from the
Debian forky root of ``scripts/rabbitmq4.sh setup`` (``KEYQ_FORKY_ROOT``). Its programs need its
own libc, so they run under ``chroot`` in a mount namespace of their own (``unshare``): no mount
is left on the host, and folders have the same paths inside. A 4.x node denies every deprecated
feature and has an epmd of its own, never the machine's. Every server process dies with the
test process (PR_SET_PDEATHSIG): a session killed with -9 leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Self

import pika
import redis

from tests.helpers import poll_until

# The same path on the host and inside a forky root.
RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")

TEST_RABBITMQ_VARIABLE = "KEYQ_TEST_RABBITMQ"
FORKY_ROOT_VARIABLE = "KEYQ_FORKY_ROOT"
DEFAULT_FORKY_ROOT = Path("/var/cache/keyq-forky")

# Every deprecated feature of RabbitMQ 4.3, all denied on a 4.x node of the tests, so a test
# that uses one fails now; a node that lists one more fails to start, so the list stays whole.
DEPRECATED_FEATURES = (
    "amqp_address_v1",
    "amqp_filter_set_bug",
    "classic_queue_mirroring",
    "global_qos",
    "management_metrics_collection",
    "queue_master_locator",
    "ram_node_type",
    "transient_nonexcl_queues",
)

_PR_SET_PDEATHSIG = 1  # prctl(2)
# Erlang distribution (node to node, and the CLI to a node) on loopback only.
LOOPBACK_DIST = "-kernel inet_dist_use_interface {127,0,0,1}"

# In a fresh mount namespace: /proc for the root, a tmpfs on its /tmp for the mount points of
# folders under /tmp, each folder bound at its own path, then chroot. The mounts go away with
# the namespace's last process.
_IN_ROOT = r"""
root=$1; shift
mountpoint -q "$root/proc" || mount -t proc proc "$root/proc" || exit 125
mount -t tmpfs -o mode=1777 keyq-tmp "$root/tmp" || exit 125
while [ "$1" != -- ]; do
    mkdir -p "$root$1" && mount --bind "$1" "$root$1" || exit 125
    shift
done
shift
exec chroot "$root" "$@"
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for(
    check: Callable[[], object],
    timeout: float,
    what: str,
    error: type[Exception] = RuntimeError,
    every: float = 0.2,
) -> None:
    """``poll_until`` with an ``error`` that names ``what`` and the last exception."""
    message = f"timed out after {timeout:.0f}s waiting for {what}"
    poll_until(check, timeout, every, lambda last: error(f"{message}: {last}"))


def answers(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), 1):
        return True


class Closing:
    """A context manager that runs ``start()``, and ``close()`` at the end or if it fails."""

    def __enter__(self) -> Self:
        try:
            self.start()  # type: ignore[attr-defined]
        except BaseException:
            self.close()  # type: ignore[attr-defined]
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Release:
    """Where the programs come from: ``root`` None, the machine's; else a forky root (chroot)."""

    root: Path | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Release:
        """``KEYQ_TEST_RABBITMQ`` unset or ``3[.x]``: installed; ``4[.x]``: ``KEYQ_FORKY_ROOT``."""
        environ = os.environ if environ is None else environ
        wanted = environ.get(TEST_RABBITMQ_VARIABLE, "").strip()
        if wanted in ("", "3") or wanted.startswith("3."):
            return cls(None)
        if wanted == "4" or wanted.startswith("4."):
            root = environ.get(FORKY_ROOT_VARIABLE, "").strip() or DEFAULT_FORKY_ROOT
            return cls(Path(root).resolve())
        raise ValueError(
            f"{TEST_RABBITMQ_VARIABLE}={wanted!r}: expected 3 (the installed RabbitMQ) or 4 "
            "(RabbitMQ 4 from the forky root of scripts/rabbitmq4.sh)"
        )

    @property
    def rabbitmq_major(self) -> int:
        return 3 if self.root is None else 4

    @property
    def redis_server(self) -> str:
        return "redis-server" if self.root is None else "valkey-server"

    def missing(self, *, redis_server: bool = True) -> str | None:
        """None if nodes (and, with ``redis_server``, a Redis) can be started, else why not."""
        if self.root is None:
            if redis_server and shutil.which("redis-server") is None:
                return "redis-server is not installed"
            if not (RABBIT_BIN / "rabbitmq-server").exists():
                return f"rabbitmq-server is not installed under {RABBIT_BIN}"
            return None
        programs = ["usr/lib/rabbitmq/bin/rabbitmq-server", "usr/bin/epmd"]
        for program in programs + ["usr/bin/valkey-server"] * redis_server:
            if not (self.root / program).exists():
                return f"no /{program} in {self.root}: run `scripts/rabbitmq4.sh setup` (as root)"
        if os.geteuid() != 0:
            return f"the servers of {self.root} run under chroot, which needs root"
        if shutil.which("unshare") is None:
            return "unshare (util-linux) is not installed"
        return None

    def environment(self, inherited: Mapping[str, str], **variables: str) -> dict[str, str]:
        """``inherited`` and ``variables``; in a root, a minimal one (the caller's PATH is not)."""
        if self.root is None:
            return {**inherited, **variables}
        return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", **variables}

    def command(self, argv: Sequence[str], folders: Sequence[Path] = ()) -> list[str]:
        """``argv``, or in a root ``argv`` under chroot with ``folders`` mounted at their paths."""
        if self.root is None:
            return list(argv)
        mounts = [str(Path(folder).resolve()) for folder in folders]
        for mount in mounts:
            if not Path(mount).is_dir():
                raise FileNotFoundError(f"no folder {mount} to mount in {self.root}")
        unshare = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c"]
        return [*unshare, _IN_ROOT, "in-root", str(self.root), *mounts, "--", *argv]

    def rabbit_config(self) -> str:
        """What a node's rabbitmq.conf adds: on 4.x, every deprecated feature denied."""
        if self.root is None:
            return ""
        return "".join(f"deprecated_features.permit.{f} = false\n" for f in DEPRECATED_FEATURES)

    def erl_args(self) -> str:
        """Distribution on loopback; on 4.x with the caller's own epmd (ERL_EPMD_PORT)."""
        return LOOPBACK_DIST if self.root is None else f"{LOOPBACK_DIST} -start_epmd false"


def private_servers_available() -> str | None:
    """None if both servers can be started here, else why not."""
    return Release.from_environment().missing()


def check_deprecated_features_denied(ctl: Callable[..., str]) -> None:
    """RuntimeError naming the deprecated features a 4.x node (``ctl``) does not deny."""
    listed = json.loads(ctl("list_deprecated_features", "--formatter", "json", "-q"))
    permitted = sorted(str(f["name"]) for f in listed if f.get("state") != "denied")
    if permitted:
        raise RuntimeError(
            f"deprecated features still permitted on this node: {permitted} "
            "(add them to tests.servers.DEPRECATED_FEATURES)"
        )


def is_vm_of(pid: int, node: str) -> bool:
    """``pid`` is a live beam.smp started as RabbitMQ node ``node`` (under chroot too)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return "beam" in Path(exe).name and f"RABBITMQ_NODENAME={node}".encode() in environ


def die_with_parent() -> None:
    """In a child before exec: SIGTERM when the thread that started it ends (see spawn)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def write_cookie(home: Path) -> None:
    cookie = home / ".erlang.cookie"
    if not cookie.exists():
        cookie.write_text(secrets.token_hex(20).upper())
        cookie.chmod(0o400)


def rabbit_node_env(
    release: Release, folder: Path, name: str, port: int, config: str, plugins: Sequence[str] = ()
) -> dict[str, str]:
    """Write a node's config files into ``folder``; the variables that point the node there."""
    (folder / "rabbitmq.conf").write_text(config + release.rabbit_config())
    (folder / "enabled_plugins").write_text(f"[{','.join(plugins)}].\n")
    (folder / "rabbitmq-env.conf").write_text("")
    home = folder.resolve()
    files = {
        "MNESIA_BASE": "mnesia",
        "LOG_BASE": "log",
        "ENABLED_PLUGINS_FILE": "enabled_plugins",
        "CONFIG_FILE": "rabbitmq.conf",
        "CONF_ENV_FILE": "rabbitmq-env.conf",
        "PID_FILE": "pid",
    }
    return {
        **{f"RABBITMQ_{variable}": str(home / file) for variable, file in files.items()},
        "RABBITMQ_NODENAME": name,
        "RABBITMQ_NODE_PORT": str(port),
        "RABBITMQ_DIST_PORT": str(free_port()),
        "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": release.erl_args(),
        "ERL_CRASH_DUMP": str(home / "erl_crash.dump"),
    }


_spawner_lock = threading.Lock()
_spawner: ThreadPoolExecutor | None = None


def spawn(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdout: IO[bytes] | int | None = None,
    new_session: bool = False,
    thread: ThreadPoolExecutor | None = None,
) -> subprocess.Popen[bytes]:
    """Popen ``command`` from ``thread`` (default: one living as long as the process), so that
    PDEATHSIG fires when the process ends, not the caller's thread."""
    global _spawner
    if thread is None:
        with _spawner_lock:
            if _spawner is None:
                _spawner = ThreadPoolExecutor(1, thread_name_prefix="kq-server-spawner")
            thread = _spawner

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            list(command),
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
            start_new_session=new_session,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - only prctl, no locks
        )

    return thread.submit(start).result()


def end_process(process: subprocess.Popen[bytes], *, group: bool = False) -> None:
    """kill -9 of ``process`` (and, with ``group``, its whole process group), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(10)


class Epmd:
    """An epmd of a 4.x node or cluster's own, on a free loopback port, in the foreground."""

    def __init__(self, release: Release) -> None:
        self.release = release
        self.port = free_port()
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, thread: ThreadPoolExecutor | None = None) -> Epmd:
        if self._process is not None and self._process.poll() is None:
            return self
        command = ["epmd", "-port", str(self.port), "-address", "127.0.0.1"]
        self._process = spawn(
            self.release.command(command),
            env=self.release.environment(os.environ),
            stdout=subprocess.DEVNULL,
            thread=thread,
        )
        wait_for(lambda: answers(self.port), 20, f"epmd on port {self.port}")
        return self

    def stop(self) -> None:
        if self._process is not None:
            end_process(self._process)
            self._process = None


class PrivateRedis:
    """A redis-server (Valkey on 4.x) with every write on disk (AOF, fsync always): it can be
    killed and restarted without losing committed state."""

    def __init__(self, folder: Path, release: Release | None = None) -> None:
        self.release = release or Release.from_environment()
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server's OS pid (the server itself, under chroot too), while it runs."""
        return self._process.pid if self._process is not None else None

    def start(self) -> PrivateRedis:
        command = [self.release.redis_server, "--bind", "127.0.0.1", "--port", str(self.port)]
        command += ["--dir", str(self.folder.resolve()), "--save", ""]
        command += ["--appendonly", "yes", "--appendfsync", "always"]
        with (self.folder / "redis.log").open("ab") as log:
            self._process = spawn(
                self.release.command(command, [self.folder]),
                env=self.release.environment(os.environ),
                stdout=log,
            )
        wait_for(lambda: redis.Redis.from_url(self.url).ping(), 20, "private Redis")
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
    """A RabbitMQ node of the release under test, on its own ports, run as this user.

    ``management``: the management plugin on a port of its own (``management_url``, statistics
    every second); ``prometheus``: rabbitmq_prometheus on another (``prometheus_port``,
    ``prometheus_url``); ``nofile``: that file-descriptor limit, as systemd's ``LimitNOFILE=``.
    On 4.x the management metrics collection is denied: ``/api/consumers`` answers 400.
    """

    def __init__(
        self,
        folder: Path,
        *,
        management: bool = False,
        nofile: int | None = None,
        prometheus: bool = False,
        release: Release | None = None,
    ) -> None:
        self.release = release or Release.from_environment()
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.node = f"keyq{self.port}@localhost"
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"
        self.nofile = nofile
        self.management_url: str | None = None
        self.prometheus_port: int | None = None
        self.prometheus_url: str | None = None
        config = f"listeners.tcp.default = 127.0.0.1:{self.port}\nloopback_users = none\n"
        plugins = []
        if management:
            port = free_port()
            self.management_url = f"http://guest:guest@127.0.0.1:{port}"
            plugins.append("rabbitmq_management")
            config += f"management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {port}\n"
            config += "collect_statistics_interval = 1000\n"
        if prometheus:
            self.prometheus_port = port = free_port()
            self.prometheus_url = f"http://127.0.0.1:{port}"
            plugins.append("rabbitmq_prometheus")
            config += f"prometheus.tcp.ip = 127.0.0.1\nprometheus.tcp.port = {port}\n"
        write_cookie(self.folder)
        self._epmd = Epmd(self.release) if self.release.root is not None else None
        self._env = self.release.environment(
            os.environ,
            HOME=str(self.folder.resolve()),
            **rabbit_node_env(self.release, self.folder, self.node, self.port, config, plugins),
        )
        if self._epmd is not None:
            self._env.update(ERL_EPMD_PORT=str(self._epmd.port), ERL_EPMD_ADDRESS="127.0.0.1")
        self._process: subprocess.Popen[bytes] | None = None
        self._checked = False

    def ctl(self, *args: str, timeout: float = 90) -> str:
        """``rabbitmqctl -n`` this node; its output."""
        argv = [str(RABBIT_BIN / "rabbitmqctl"), "-n", self.node, *args]
        done = subprocess.run(
            self.release.command(argv, [self.folder]),
            env=self._env,
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return done.stdout

    def await_memory_alarm(self, active: bool, timeout: float = 15) -> None:
        """Wait until the node's memory alarm is on (``active``) or off."""
        wait_for(
            lambda: ("memory" in self.ctl("eval", "rabbit_alarm:get_alarms().")) == active,
            timeout,
            f"the memory alarm {'on' if active else 'off'}",
        )

    @property
    def os_pid(self) -> int | None:
        """The OS pid of the node's VM (beam.smp), from its pid file, while it runs."""
        with contextlib.suppress(OSError, ValueError):
            return int((self.folder / "pid").read_text().strip())
        return None

    def start(self) -> PrivateRabbit:
        if self._epmd is not None:
            self._epmd.start()
        pid_file = self.folder / "pid"
        pid_file.unlink(missing_ok=True)
        command = self.release.command([str(RABBIT_BIN / "rabbitmq-server")], [self.folder])
        if self.nofile is not None:
            command = ["prlimit", f"--nofile={self.nofile}:{self.nofile}", *command]
        with (self.folder / "console.log").open("ab") as console:
            self._process = spawn(command, env=self._env, stdout=console, new_session=True)
        process = self._process

        def booted() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"{self.node} exited {process.returncode} while booting")
            return pid_file.exists()

        try:
            wait_for(booted, 90, f"the pid file of {self.node}")
            self.ctl("wait", str(pid_file.resolve()), "--timeout", "90", timeout=120)
            wait_for(lambda: amqp_answers(self.url), 30, "private RabbitMQ")
            if not self._checked and self.release.rabbitmq_major >= 4:
                check_deprecated_features_denied(self.ctl)
                self._checked = True
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """A clean stop: durable queues and persistent messages are kept for the next start."""
        process, self._process = self._process, None
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self.ctl("stop", str((self.folder / "pid").resolve()), timeout=60)
        if process is not None:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                end_process(process, group=True)
        pid = self.os_pid
        if pid is not None and is_vm_of(pid, self.node):  # its VM outlived the script
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        (self.folder / "pid").unlink(missing_ok=True)
        if self._epmd is not None:
            self._epmd.stop()

    def restart(self) -> None:
        self.stop()
        self.start()


def amqp_answers(url: str) -> bool:
    pika.BlockingConnection(pika.URLParameters(url)).close()
    return True
