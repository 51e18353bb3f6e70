"""A private 3-node RabbitMQ cluster on loopback, of the release under test, with node faults
(``stop``, ``kill`` -9, ``restart``, ``cut`` of the clients through a node's FaultProxy). Its
nodes have names, ports, folders and config of their own, so the machine's node never applies,
and die with the test process; restarting a node needs the others running (mnesia).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from tests.faults import FaultProxy
from tests.servers import (
    RABBIT_BIN,
    Closing,
    Epmd,
    Release,
    amqp_answers,
    check_deprecated_features_denied,
    end_process,
    free_port,
    is_vm_of,
    rabbit_node_env,
    spawn,
    wait_for,
    write_cookie,
)

# Inherited variables that would point a node or the CLI somewhere else.
_ENV_PREFIXES = ("RABBITMQ_", "ERL_")
_ENV_NAMES = frozenset({"CONF_ENV_FILE", "NODENAME", "NODE_PORT", "NODE_IP_ADDRESS", "HOME"})

NodeRef = int | str
_QUEUE_COLUMNS = ("name", "type", "leader", "members", "online")
_LIST_COLUMNS = frozenset({"members", "online"})
# 3.10 and 4.3 list a classic queue whose node is down with its module's name as its type.
_QUEUE_TYPES = {
    "rabbit_classic_queue": "classic",
    "rabbit_quorum_queue": "quorum",
    "rabbit_stream_queue": "stream",
}


def cluster_available() -> str | None:
    """None if a cluster of the release under test can be started here, else why not."""
    return Release.from_environment().missing(redis_server=False)


class ClusterError(RuntimeError):
    pass


@dataclass(eq=False)
class _Node:
    index: int
    name: str
    folder: Path
    port: int
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    up: bool = False  # started by us and not stopped or killed since
    pid_file: Path = field(init=False)

    def __post_init__(self) -> None:
        self.pid_file = self.folder / "pid"

    def log_tail(self, lines: int = 30) -> str:
        text = []
        for path in [self.folder / "console.log", *sorted((self.folder / "log").glob("*.log"))]:
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                text.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(text)


@dataclass(frozen=True)
class QueueInfo:
    name: str
    type: str  # "classic", "quorum" or "stream"
    leader: str | None  # quorum: the leader's node; classic: the node the queue lives on
    members: list[str]  # quorum: the nodes with a replica (4.x: a classic queue's node)
    online: list[str]  # quorum: the members now running


class RabbitCluster(Closing):
    """Three RabbitMQ nodes clustered on loopback; a context manager (see the module)."""

    boot_timeout = 180.0

    def __init__(self, folder: Path | None = None) -> None:
        self.release = Release.from_environment()
        reason = self.release.missing(redis_server=False)
        if reason is not None:
            raise ClusterError(reason)
        # Our own folder inside ``folder`` (or the system temp dir), removed on close.
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix="kq-cluster-", dir=folder)).resolve()
        self.timings: dict[str, float] = {}
        self._closed = False
        self._proxies: list[FaultProxy] = []
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="kq-cluster-spawner")
        home = self.folder / "home"
        home.mkdir()
        write_cookie(home)
        # 4.x: an epmd of the cluster's own (started with the nodes), not the machine's.
        self._epmd = Epmd(self.release) if self.release.root is not None else None
        inherited = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(_ENV_PREFIXES) and k not in _ENV_NAMES
        }
        base_env = self.release.environment(inherited)
        if self._epmd is not None:
            base_env["ERL_EPMD_PORT"] = str(self._epmd.port)
        base_env.update(
            HOME=str(home.resolve()),
            ERL_EPMD_ADDRESS="127.0.0.1",
            # The CLI's own distribution port: any free one. Its default range, 35672-35682,
            # is shared by every rabbitmqctl on the machine and runs out under parallel calls.
            RABBITMQ_CTL_DIST_PORT_MIN="0",
            RABBITMQ_CTL_DIST_PORT_MAX="0",
        )
        self._ctl_env = base_env
        tag = secrets.token_hex(3)
        self._nodes: list[_Node] = []
        for index in range(3):
            name = f"kq{tag}{index + 1}@localhost"
            node_folder = self.folder / f"n{index + 1}"
            node_folder.mkdir()
            port = free_port()
            config = f"listeners.tcp.default = 127.0.0.1:{port}\n"
            env = {
                **base_env,
                **rabbit_node_env(self.release, node_folder, name, port, config),
                "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            }
            self._nodes.append(_Node(index, name, node_folder, port, env))
        atexit.register(self._kill_all)  # a last resort if close() is never reached

    @property
    def nodes(self) -> list[str]:
        return [node.name for node in self._nodes]

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self._nodes]

    @property
    def urls(self) -> list[str]:
        """One AMQP URL per node, straight to it (guest/guest: clients are on loopback)."""
        return [f"amqp://guest:guest@127.0.0.1:{node.port}/%2F" for node in self._nodes]

    @property
    def proxied_urls(self) -> list[str]:
        """One AMQP URL per node, through that node's FaultProxy (see :meth:`cut`)."""
        return [proxy.url_for(url) for proxy, url in zip(self._proxies, self.urls, strict=True)]

    def url(self, node: NodeRef) -> str:
        return self.urls[self._node(node).index]

    def proxy(self, node: NodeRef) -> FaultProxy:
        return self._proxies[self._node(node).index]

    def is_up(self, node: NodeRef) -> bool:
        """Started by us and not stopped or killed since (not a health check)."""
        return self._node(node).up

    def _node(self, node: NodeRef) -> _Node:
        if isinstance(node, int):
            return self._nodes[node]
        if node not in self.nodes:
            raise KeyError(f"{node!r} is not a node of this cluster ({self.nodes})")
        return self._nodes[self.nodes.index(node)]

    def _via(self, via: NodeRef | None) -> _Node:
        """``via``, or by default a node that is up."""
        if via is not None:
            return self._node(via)
        if not any(node.up for node in self._nodes):
            raise ClusterError("no node of the cluster is running")
        return next(node for node in self._nodes if node.up)

    def ctl(self, node: NodeRef, *args: str, timeout: float = 60) -> str:
        """``rabbitmqctl -n <node> args...``; its stdout, or ClusterError with its output."""
        command = ["rabbitmqctl", "-n", self._node(node).name, *args]
        try:
            done = subprocess.run(
                self.release.command([str(RABBIT_BIN / command[0]), *command[1:]], [self.folder]),
                env=self._ctl_env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"{' '.join(command)}: no answer in {timeout:.0f}s") from exc
        if done.returncode != 0:
            raise ClusterError(
                f"{' '.join(command)} exited {done.returncode}: "
                f"{(done.stdout + done.stderr).strip()[-2000:]}"
            )
        return done.stdout

    def running_nodes(self, via: NodeRef | None = None) -> list[str]:
        """The nodes ``via`` (default: a node that is up) sees running, per cluster_status."""
        status = json.loads(self.ctl(self._via(via).index, "cluster_status", "--formatter", "json"))
        return sorted(str(name) for name in status.get("running_nodes", []))

    def start(self) -> RabbitCluster:
        """Start every node in parallel, join the others to the first, wait for all."""
        began = time.monotonic()
        if self._epmd is not None:
            self._epmd.start(self._spawner)
        for node in self._nodes:
            self._spawn(node)
        self._parallel([partial(self._await_boot, n) for n in self._nodes])
        self.timings["start"] = time.monotonic() - began
        _wait(lambda: amqp_answers(self.urls[0]), 30, f"an AMQP login as guest on {self.nodes[0]}")
        if self.release.rabbitmq_major >= 4:
            check_deprecated_features_denied(partial(self.ctl, 0))
        began = time.monotonic()
        first = self._nodes[0]
        for node in self._nodes[1:]:
            self.ctl(node.index, "stop_app")
            self.ctl(node.index, "join_cluster", first.name, timeout=120)
            self.ctl(node.index, "start_app", timeout=self.boot_timeout)
        self._await_running(set(self.nodes), via=[first])
        self.timings["join"] = time.monotonic() - began
        self._proxies = [FaultProxy("127.0.0.1", node.port).start() for node in self._nodes]
        return self

    def close(self) -> None:
        """Stop every node (gracefully, then kill -9 what is left) and remove the folder."""
        if self._closed:
            return
        self._closed = True
        for proxy in self._proxies:
            with contextlib.suppress(Exception):
                proxy.stop()
        began = time.monotonic()
        # 4.x: a node holding durable classic queues waits 30 s as it stops for a Khepri quorum
        # the other nodes, stopping too, no longer give: a few seconds, then kill -9.
        grace = 90 if self.release.rabbitmq_major < 4 else 8
        self._parallel(
            [partial(self._stop_node, n, grace) for n in self._nodes if n.process is not None],
            swallow=True,
        )
        self._kill_all()
        self._spawner.shutdown()
        self.timings["close"] = time.monotonic() - began
        atexit.unregister(self._kill_all)
        shutil.rmtree(self.folder, ignore_errors=True)

    def stop(self, node: NodeRef) -> float:
        """Stop ``node`` gracefully (its whole VM); returns the seconds it took."""
        began = time.monotonic()
        self._stop_node(self._node(node))
        return time.monotonic() - began

    def kill(self, node: NodeRef) -> float:
        """``kill -9`` of ``node``'s beam.smp; returns once it is gone (seconds taken)."""
        target = self._node(node)
        pid = self.os_pid(target.index)
        began = time.monotonic()
        target.up = False
        os.kill(pid, signal.SIGKILL)
        if target.process is not None:
            target.process.wait(30)  # the script waits on beam.smp, so it ends with it
            target.process = None
        _wait(lambda: not _alive(pid), 30, f"pid {pid} of {target.name} to end")
        return time.monotonic() - began

    def restart(self, node: NodeRef) -> float:
        """Start a stopped or killed ``node`` again; seconds until the running nodes list it."""
        target = self._node(node)
        if target.up:
            self._stop_node(target)
        began = time.monotonic()
        self._spawn(target)
        self._await_boot(target)
        self._await_running(
            {n.name for n in self._nodes if n.up}, via=[n for n in self._nodes if n.up]
        )
        return time.monotonic() - began

    def cut(self, node: NodeRef) -> None:
        """Reset every client connection through ``node``'s proxy; new ones are accepted."""
        self.proxy(node).cut()

    def os_pid(self, node: NodeRef) -> int:
        """The OS pid of ``node``'s beam.smp (from its pid file, or asked of the node)."""
        target = self._node(node)
        pid: int | None = None
        with contextlib.suppress(OSError, ValueError):
            pid = int(target.pid_file.read_text().strip())
        if pid is None or not is_vm_of(pid, target.name):
            answer = self.ctl(target.index, "eval", "os:getpid().")
            pid = int(answer.strip().strip('"'))
        if not is_vm_of(pid, target.name):
            raise ClusterError(f"pid {pid} is not the VM of {target.name}")
        return pid

    def list_queues(self, *columns: str, via: NodeRef | None = None) -> list[dict[str, Any]]:
        """``list_queues <columns>`` of vhost ``/`` as dicts (JSON: 4.x's CSV fails on lists)."""
        out = self.ctl(self._via(via).index, "list_queues", "-q", *columns, "--formatter", "json")
        rows = json.loads(out) if out.strip() else []
        for row in rows:
            for column in _LIST_COLUMNS.intersection(row):
                row[column] = _node_list(row[column])
            if "type" in row:
                row["type"] = _QUEUE_TYPES.get(row["type"], row["type"])
        return [dict(row) for row in rows]

    def queue_info(self, queue: str, via: NodeRef | None = None) -> QueueInfo:
        """What ``via`` (default: a node that is up) now says of ``queue``."""
        target = self._via(via)
        for row in self.list_queues(*_QUEUE_COLUMNS, via=target.index):
            if row.get("name") == queue:
                leader = row["leader"] or None
                if row["type"] == "classic" and leader is None:
                    # 4.x names a running classic queue's node as its leader; 3.10 never does,
                    # and neither lists the node of one whose node is down: ask the metadata.
                    leader = self.home_node(queue, via=target.index)
                return QueueInfo(queue, row["type"], leader, row["members"], row["online"])
        raise KeyError(f"no queue {queue!r}")

    def home_node(self, queue: str, via: NodeRef | None = None) -> str | None:
        """The node a classic queue lives on, also while that node is down (None: no queue)."""
        # 4.x keeps the record of a queue whose node is down where lookup finds it; 3.10 only
        # in its durable table (mnesia, which 4.x's Khepri metadata store no longer has).
        name = f'rabbit_misc:r(<<"/">>, queue, {_erlang_binary(queue)})'
        expression = (
            f"case rabbit_amqqueue:lookup({name}) of {{ok, Q}} -> node(amqqueue:get_pid(Q)); "
            f"_ -> case catch mnesia:dirty_read(rabbit_durable_queue, {name}) of "
            "[D] -> node(amqqueue:get_pid(D)); _ -> none end end."
        )
        answer = self.ctl(self._via(via).index, "eval", expression).strip().strip("'")
        return None if answer == "none" else answer

    def leaders(self, prefix: str = "") -> dict[str, str]:
        """Every quorum queue named ``prefix...`` and its leader now, in one listing."""
        return {
            row["name"]: row["leader"]
            for row in self.list_queues("name", "type", "leader")
            if row["name"].startswith(prefix) and row["type"] == "quorum" and row["leader"]
        }

    def await_replicas(self, prefix: str = "", timeout: float = 120) -> None:
        """Wait until every replica of every quorum queue named ``prefix...`` is online (one
        whose node was down waits for its next boot); the error names the queues still short."""
        offline: dict[str, list[str]] = {}

        def all_online() -> bool:
            offline.clear()
            for row in self.list_queues("name", "type", "members", "online"):
                missing = sorted(set(row["members"]) - set(row["online"]))
                if row["name"].startswith(prefix) and row["type"] == "quorum" and missing:
                    offline[row["name"]] = missing
            return not offline

        try:
            _wait(all_online, timeout, f"every replica of the quorum queues {prefix}* online")
        except ClusterError as exc:
            short = ", ".join(f"{queue} on {nodes}" for queue, nodes in sorted(offline.items()))
            raise ClusterError(f"{exc}; {len(offline)} still short: {short[:2000]}") from None

    def leader_of(self, queue: str) -> str:
        """The node leading quorum queue ``queue`` (a dead one until another is elected: see
        :meth:`await_leader`), or the home node of a classic queue."""
        info = self.queue_info(queue)
        if info.leader is None:
            raise ClusterError(f"{queue!r} has no leader now: {info}")
        return info.leader

    def await_leader(self, queue: str, *, not_on: NodeRef, timeout: float = 60) -> str:
        """Wait until ``queue``'s leader is a running node other than ``not_on``; return it."""
        excluded = self._node(not_on).name
        found: list[str] = []

        def elected() -> bool:
            info = self.queue_info(queue)
            found[:] = [str(info.leader)]
            return (
                info.leader is not None
                and info.leader != excluded
                and self._node(info.leader).up
                and (info.type != "quorum" or info.leader in info.online)
            )

        _wait(elected, timeout, f"a leader of {queue!r} other than {excluded}")
        return found[0]

    def _spawn(self, node: _Node) -> None:
        """Start ``node``'s VM from the spawner thread (die_with_parent: see tests.servers)."""
        node.pid_file.unlink(missing_ok=True)  # a kill -9 leaves it behind
        command = self.release.command([str(RABBIT_BIN / "rabbitmq-server")], [self.folder])
        with (node.folder / "console.log").open("ab") as console:
            # its own process group: killable as a whole
            node.process = spawn(
                command, env=node.env, stdout=console, new_session=True, thread=self._spawner
            )
        node.up = True

    def _await_boot(self, node: _Node) -> None:
        process = node.process
        assert process is not None
        deadline = time.monotonic() + self.boot_timeout
        while not node.pid_file.exists():  # fail fast if the VM exits (a port taken...)
            if process.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(
                    f"{node.name} did not boot (exit {process.poll()})\n{node.log_tail()}"
                )
            time.sleep(0.1)
        left = str(int(max(1, deadline - time.monotonic())))
        wait = ("wait", str(node.pid_file), "--timeout", left)
        try:
            self.ctl(node.index, *wait, timeout=self.boot_timeout + 30)
        except ClusterError as exc:
            raise ClusterError(f"{node.name} did not boot: {exc}\n{node.log_tail()}") from exc

    def _await_running(self, expected: set[str], via: list[_Node]) -> None:
        def all_running() -> bool:
            return all(expected <= set(self.running_nodes(n.index)) for n in via)

        _wait(all_running, self.boot_timeout, f"cluster_status to list {sorted(expected)}")

    def _stop_node(self, node: _Node, timeout: float = 90) -> None:
        node.up = False
        process = node.process
        if process is None:
            return
        try:
            if process.poll() is None:
                self.ctl(node.index, "stop", str(node.pid_file), timeout=timeout)
            process.wait(30)
        except (ClusterError, subprocess.TimeoutExpired):
            end_process(process, group=True)
        node.process = None

    def _kill_all(self) -> None:
        for node in self._nodes:
            node.up = False
            if node.process is not None:
                end_process(node.process, group=True)
                node.process = None
        if self._epmd is not None:
            self._epmd.stop()

    def _parallel(self, jobs: list[Callable[[], object]], *, swallow: bool = False) -> None:
        if not jobs:
            return
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = [pool.submit(job) for job in jobs]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors and not swallow:
            raise errors[0]  # type: ignore[misc]


def _node_list(value: object) -> list[str]:
    """A list column of ``list_queues`` in JSON (a list, or ``""`` for none), sorted."""
    if isinstance(value, list):
        return sorted(str(name) for name in value)
    return sorted(name.strip() for name in str(value or "").strip("[]").split(",") if name.strip())


def _erlang_binary(text: str) -> str:
    """``text`` as an Erlang binary expression, whatever characters it holds."""
    return f"list_to_binary({list(text.encode())})"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


_wait = partial(wait_for, error=ClusterError)
