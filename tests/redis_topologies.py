"""Redis Cluster and Redis under Sentinel on loopback, for tests that kill primaries: the
installed ``redis-server`` on free ports and folders of their own, writes on disk (AOF, fsync
always); every process gets SIGTERM if the test process dies (PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import time
from functools import partial
from pathlib import Path
from typing import Any

import redis
import redis.cluster

from tests.servers import Closing, free_port, spawn, wait_for

SERVICE = "kq-primary"


def redis_topologies_available() -> str | None:
    """None if Redis Cluster and Sentinel can be started here, else why not."""
    missing = [p for p in ("redis-server", "redis-cli") if shutil.which(p) is None]
    return f"{missing[0]} is not installed" if missing else None


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (10,000 higher) is free too, below 55,536."""
    for _ in range(200):
        port = random.randint(20_000, 55_000)
        with contextlib.ExitStack() as probes:
            try:
                for candidate in (port, port + 10_000):
                    probe = probes.enter_context(socket.socket())
                    probe.bind(("127.0.0.1", candidate))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


_wait = partial(wait_for, every=0.1)


class _Server:
    """One redis-server process (data node or sentinel) on a fixed port and folder."""

    def __init__(self, folder: Path, port: int, args: list[str], config: str = "") -> None:
        self.folder = folder
        self.port = port
        self._args = args
        self._config = config
        self.process: subprocess.Popen[bytes] | None = None
        folder.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        command = ["redis-server"]
        if self._config:
            conf = self.folder / "server.conf"
            if not conf.exists():  # a sentinel rewrites its own file: keep it across restarts
                conf.write_text(self._config)
            command.append(str(conf))
        command += ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder)]
        command += self._args
        with (self.folder / "server.log").open("ab") as log:
            self.process = spawn(command, stdout=log)
        _wait(lambda: self.client().ping(), 20, f"redis-server on {self.port}")

    def client(self) -> redis.Redis:
        return redis.Redis("127.0.0.1", self.port, decode_responses=True, socket_timeout=2)

    def kill(self) -> None:
        """kill -9: a crash, not a shutdown."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self.process = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


_DURABLE = ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]


class RedisClusterServers(Closing):
    """3 primaries and 3 replicas, cluster-enabled, failover after 2 s of silence."""

    def __init__(self, folder: Path, node_timeout_ms: int = 2000) -> None:
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", *_DURABLE]
        args += ["--cluster-node-timeout", str(node_timeout_ms)]
        self.servers = [
            _Server(folder / f"node-{index}", _free_cluster_port(), args) for index in range(6)
        ]

    @property
    def url(self) -> str:
        nodes = ",".join(f"127.0.0.1:{server.port}" for server in self.servers[:3])
        return f"redis+cluster://{nodes}"

    def start(self) -> None:
        for server in self.servers:
            server.start()
        nodes = [f"127.0.0.1:{server.port}" for server in self.servers]
        create = ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "1"]
        subprocess.run([*create, "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.await_healthy()
        self.await_replicas()

    def close(self) -> None:
        for server in self.servers:
            server.kill()

    def await_replicas(self, timeout: float = 60) -> None:
        """Every live primary has a replica in sync (so a commit can be confirmed)."""

        def linked() -> bool:
            infos = [s.client().info("replication") for s in self.servers if s.alive]
            return all(i["role"] != "master" or _online_replicas(i) >= 1 for i in infos)

        _wait(linked, timeout, "every primary's replica in sync")

    def client(self) -> redis.cluster.RedisCluster:
        return redis.cluster.RedisCluster(
            startup_nodes=[
                redis.cluster.ClusterNode("127.0.0.1", s.port)  # type: ignore[no-untyped-call]
                for s in self.servers
                if s.alive
            ],
            decode_responses=True,
            socket_timeout=2,
        )

    def primary_for(self, key: str) -> _Server:
        """The server that serves ``key``'s slot now, as a live node sees it."""
        slot = redis.cluster.key_slot(key.encode())
        for server in self.servers:
            if not server.alive:
                continue
            with contextlib.suppress(redis.exceptions.RedisError):
                for start, end, primary, *_ in server.client().execute_command("CLUSTER SLOTS"):
                    if int(start) <= slot <= int(end):
                        return next(s for s in self.servers if s.port == int(primary[1]))
        raise RuntimeError(f"no live node knows who serves slot {slot}")

    def await_healthy(self, timeout: float = 60) -> None:
        """Every live node says the cluster is ok (every slot served)."""

        def ok() -> bool:
            return all(_cluster_state(s.client()) == "ok" for s in self.servers if s.alive)

        _wait(ok, timeout, "cluster_state:ok")

    def kill_primary_of(self, key: str, timeout: float = 60) -> tuple[_Server, float]:
        """kill -9 the primary serving ``key``; it and the seconds until a replica serves."""
        old = self.primary_for(key)
        old.kill()
        started = time.monotonic()
        _wait(
            lambda: self.primary_for(key) is not old,
            timeout,
            f"a replica to take over from {old.port}",
        )
        self.await_healthy(timeout)
        return old, time.monotonic() - started

    def restart(self, server: _Server) -> None:
        """Start a killed node again: it rejoins (as a replica of its successor)."""
        server.kill()
        server.start()
        self.await_healthy()


def _online_replicas(info: dict[str, Any]) -> int:
    """Replicas in sync, from INFO replication."""
    return sum(
        1
        for name, value in info.items()
        if name.startswith("slave") and isinstance(value, dict) and value.get("state") == "online"
    )


def _replicas_of(server: _Server) -> int:
    return _online_replicas(server.client().info("replication"))


def _cluster_state(client: redis.Redis) -> str:
    info = client.execute_command("CLUSTER INFO")
    if isinstance(info, dict):
        return str(info.get("cluster_state"))
    return "ok" if "cluster_state:ok" in str(info) else "not ok"


class RedisSentinelServers(Closing):
    """A primary, 2 replicas and 3 sentinels (quorum 2), failover after 2 s of silence."""

    def __init__(self, folder: Path, down_after_ms: int = 2000) -> None:
        ports = [free_port() for _ in range(3)]
        primary = ports[0]
        replica = ["--replicaof", "127.0.0.1", str(primary)]
        self.data = [
            _Server(folder / f"data-{i}", port, _DURABLE + ([] if port == primary else replica))
            for i, port in enumerate(ports)
        ]
        config = (
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} 10000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        self.sentinels = [
            _Server(folder / f"sentinel-{i}", free_port(), ["--sentinel"], config) for i in range(3)
        ]

    @property
    def url(self) -> str:
        nodes = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{nodes}/{SERVICE}"

    def start(self) -> None:
        for server in self.data + self.sentinels:
            server.start()
        _wait(lambda: _replicas_of(self.primary()) == 2, 30, "both replicas linked")

    def close(self) -> None:
        self.thaw_replicas()
        for server in self.sentinels + self.data:
            server.kill()

    def primary(self) -> _Server:
        """The data server the sentinels name as primary now."""
        for sentinel in self.sentinels:
            if not sentinel.alive:
                continue
            with contextlib.suppress(redis.exceptions.RedisError):
                _host, port = sentinel.client().execute_command(
                    "SENTINEL GET-MASTER-ADDR-BY-NAME", SERVICE
                )
                return next(server for server in self.data if server.port == int(port))
        raise RuntimeError("no sentinel answers")

    def cut_off_replicas(self) -> None:
        """Freeze every replica (SIGSTOP) and close its link: no write reaches one until thawed,
        not even into a socket buffer."""
        primary = self.primary()
        for server in self.data:
            if server is not primary and server.process is not None:
                server.process.send_signal(signal.SIGSTOP)
        primary.client().execute_command("CLIENT", "KILL", "TYPE", "replica")
        _wait(lambda: _replicas_of(primary) == 0, 10, "cut")

    def thaw_replicas(self) -> None:
        for server in self.data:
            if server.process is not None and server.process.poll() is None:
                server.process.send_signal(signal.SIGCONT)

    def kill_primary(
        self, timeout: float = 60, *, thaw_replicas: bool = False
    ) -> tuple[_Server, float]:
        """kill -9 the primary (then thaw frozen replicas); it and the seconds until the
        sentinels name another that accepts writes."""
        old = self.primary()
        old.kill()
        if thaw_replicas:
            self.thaw_replicas()
        started = time.monotonic()

        def promoted() -> bool:
            new = self.primary()
            return new is not old and new.client().info("replication")["role"] == "master"

        _wait(promoted, timeout, f"the sentinels to replace {old.port}")
        return old, time.monotonic() - started

    def restart(self, server: _Server) -> None:
        """Start a killed data server again: the sentinels make it a replica."""
        server.kill()
        server.start()


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.redis_topologies cluster|sentinel -- COMMAND…`` on that topology."""
    import argparse
    import os
    import sys
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m tests.redis_topologies")
    parser.add_argument("topology", choices=("cluster", "sentinel"))
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    missing = redis_topologies_available()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kq-redis-") as folder:
        kind = RedisClusterServers if args.topology == "cluster" else RedisSentinelServers
        with kind(Path(folder)) as servers:
            print(f"KEYQ_REDIS_URL={servers.url}", file=sys.stderr, flush=True)
            env = {**os.environ, "KEYQ_REDIS_URL": servers.url}
            return subprocess.run(command, env=env, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
