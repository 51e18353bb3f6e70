"""Spark beyond the worker's process, on loopback, from the pyspark installation: a standalone
master with one worker, and a Spark Connect server. Ports are free ones, folders the test's
own; every process dies with the test (PDEATHSIG) and is stopped afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pyspark

from tests.helpers import poll_until
from tests.servers import Closing, answers, end_process, free_port, spawn

SPARK_HOME = Path(pyspark.__file__).resolve().parent
LOOPBACK = ["--host", "127.0.0.1"]


def spark_cluster_available() -> str | None:
    """None if a standalone cluster and a Connect server can be started here, else why."""
    if not (SPARK_HOME / "bin" / "spark-class").exists():
        return f"no spark-class under {SPARK_HOME}"
    if not (SPARK_HOME / "sbin" / "start-connect-server.sh").exists():
        return "no start-connect-server.sh in the pyspark installation"
    return None


def _environment(folder: Path) -> dict[str, str]:
    return {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",  # else the daemons advertise a non-loopback address
        "SPARK_LOG_DIR": str(folder / "logs"),
        "SPARK_PID_DIR": str(folder / "pids"),
        "SPARK_NO_DAEMONIZE": "1",
        "PYSPARK_PYTHON": sys.executable,
    }


def _wait(check: Callable[[], bool], timeout: float, what: str, log: Path) -> None:
    def failure(_last: Exception | None) -> Exception:
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        return RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}; log:\n{tail}")

    poll_until(check, timeout, 0.5, failure)


class _Daemon:
    def __init__(self, folder: Path, name: str, command: list[str]) -> None:
        self.log = folder / f"{name}.log"
        folder.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.process = spawn(command, env=_environment(folder), stdout=out, new_session=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                end_process(self.process, group=True)


class SparkStandalone(Closing):
    """A master and one worker (1 core, 1 GB) on 127.0.0.1."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.cores = 1
        self.port = free_port()
        self.ui_port = free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self._daemons: list[_Daemon] = []

    def start(self) -> None:
        spark_class = str(SPARK_HOME / "bin" / "spark-class")
        master_class = "org.apache.spark.deploy.master.Master"
        ports = ["--port", str(self.port), "--webui-port", str(self.ui_port)]
        master = _Daemon(self.folder, "master", [spark_class, master_class, *LOOPBACK, *ports])
        self._daemons.append(master)
        _wait(lambda: answers(self.port), 90, "the Spark master", master.log)
        options = ["--webui-port", str(free_port()), "--cores", str(self.cores)]
        options += ["--memory", "1g", "--work-dir", str(self.folder / "work"), self.url]
        main = "org.apache.spark.deploy.worker.Worker"
        worker = _Daemon(self.folder, "worker", [spark_class, main, *LOOPBACK, *options])
        self._daemons.append(worker)
        _wait(lambda: self.alive_workers() >= 1, 90, "a Spark worker registered", worker.log)

    def close(self) -> None:
        for daemon in reversed(self._daemons):
            daemon.stop()

    def alive_workers(self) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json", timeout=2) as page:
            return int(json.load(page).get("aliveworkers", 0))


class SparkConnectServer(Closing):
    """A Spark Connect server on 127.0.0.1, with a local Spark of its own."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"sc://127.0.0.1:{self.port}"
        self._daemon: _Daemon | None = None

    def start(self) -> None:
        command = [str(SPARK_HOME / "sbin" / "start-connect-server.sh"), "--wait"]
        command += ["--master", "local[1]", "--conf", "spark.ui.enabled=false"]
        for conf in ("address=127.0.0.1", f"port={self.port}"):
            command += ["--conf", f"spark.connect.grpc.binding.{conf}"]
        self._daemon = _Daemon(self.folder, "connect", command)
        _wait(lambda: answers(self.port), 150, "the Spark Connect server", self._daemon.log)

    def close(self) -> None:
        if self._daemon is not None:
            self._daemon.stop()
