"""The docs run as written: the README's quickstart, step by step, and every command of the
runbook in docs/operations.md, pasted with its placeholders filled.

The quickstart is the fenced blocks after a ``<!-- quickstart:KIND -->`` comment in README.md,
run unmodified from the checkout's root but for the stream ``orders``, which becomes the test's:
a worker block in the background (Ctrl-C'd when the next starts), python in this venv, shell in
bash with the venv's ``bin`` first on PATH. An output block is what the block before prints
(``…``: any text; lines may be left out); a block that only reads is run again until it does.
The step that starts RabbitMQ and Redis is skipped when they already answer, as the README allows.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import orjson
import pika
import pytest

from keyq.broker.settings import Settings, load_settings
from tests.conftest import StreamFixture, reachable
from tests.operator_helpers import dead_letter, letters_for, record_stream
from tests.workers import wait_until

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
OPERATIONS = REPO / "docs" / "operations.md"
BIN = Path(sys.executable).parent

STEP = re.compile(r"<!-- quickstart:(\w+) -->\n```\w+\n(.*?)\n```", re.DOTALL)
DOC_STREAM = re.compile(r"\borders\b")
READS = ("keyq state ", "keyq inspect ")
WORKER_UP = ("serving stream {stream}", "stream {stream} has no producer yet")
WORKER_START_S = 180.0
WORKER_STOP_S = 60.0
SETTLE_S = 120.0

RUNBOOK_SECTION = "## When something goes wrong"
RUNBOOK_COMMAND = re.compile(r"`(keyq [^`]+)`")
REASON = "poison: bad payload"
FIXED_PAYLOAD = {"type": "created", "order": "order-17"}
USAGE_ERROR = 2


@dataclass(frozen=True)
class Step:
    kind: str  # services, worker, python, shell or output
    text: str


def quickstart(stream: str) -> list[Step]:
    """The README's quickstart steps, on ``stream`` instead of ``orders``."""
    steps = [
        Step(kind, DOC_STREAM.sub(stream, text)) for kind, text in STEP.findall(README.read_text())
    ]
    assert [step.kind for step in steps][:3] == ["services", "worker", "python"], steps
    return steps


def environment(settings: Settings) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
        "KEYQ_AMQP_URL": settings.amqp_url,
        "KEYQ_REDIS_URL": settings.redis_url,
    }


def prints(expected: str, actual: str) -> bool:
    """``actual`` is the same JSON, or holds each shown line in order (``…``: anything)."""
    try:
        return bool(orjson.loads(actual) == orjson.loads(expected))
    except orjson.JSONDecodeError:
        pass
    lines = iter(" ".join(line.split()) for line in actual.splitlines())
    for shown in expected.splitlines():
        pattern = ".*".join(re.escape(" ".join(part.split())) for part in shown.split("…"))
        if not any(re.fullmatch(pattern, line) for line in lines):
            return False
    return True


class Workers:
    """The worker the README runs in its second terminal: one at a time."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self._env, self._log_dir = env, log_dir
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, command: str, stream: str) -> None:
        self.stop()
        path = self._log_dir / f"worker-{time.monotonic_ns()}.log"
        self._log = path.open("wb")
        self._process = subprocess.Popen(
            ["bash", "-c", command],
            cwd=REPO,
            env=self._env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        marks = [mark.format(stream=stream) for mark in WORKER_UP]
        process = self._process

        def up() -> bool:
            assert process.poll() is None, f"worker exited: {path.read_text()[-3000:]}"
            return any(mark in path.read_text() for mark in marks)

        wait_until(up, WORKER_START_S, f"the worker up, logging to {path}", every=0.5)

    def stop(self) -> None:
        """Ctrl-C: the worker finishes its batch, hands its queues back and exits 0."""
        if self._process is None:
            return
        process, self._process = self._process, None
        os.killpg(process.pid, signal.SIGINT)
        try:
            assert process.wait(WORKER_STOP_S) == 0
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            assert self._log is not None
            self._log.close()


@pytest.fixture
def workers(settings: Settings, tmp_path: Path) -> Iterator[Workers]:
    running = Workers(environment(settings), tmp_path)
    yield running
    running.stop()


def run(step: Step, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    if step.kind == "python":
        script = tmp_path / "quickstart_step.py"
        script.write_text(step.text + "\n")
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-e", "-c", step.text]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_the_readme_quickstart_runs_as_written_and_prints_what_it_shows(
    stream: StreamFixture,
    settings: Settings,
    workers: Workers,
    tmp_path: Path,
    spark_class_archive: Path | None,
) -> None:
    env = environment(settings)
    steps = quickstart(stream.name)
    checked = 0
    for index, step in enumerate(steps):
        if step.kind == "output":
            continue
        after = steps[index + 1] if index + 1 < len(steps) else None
        shown = after.text if after is not None and after.kind == "output" else None
        if step.kind == "services" and (
            reachable(settings.amqp_url, 5672) and reachable(settings.redis_url, 6379)
        ):
            continue  # skipped only because RabbitMQ and Redis already answer
        if step.kind == "worker":
            workers.start(step.text, stream.name)
            continue
        reads = all(line.startswith(READS) for line in step.text.splitlines())
        deadline = time.monotonic() + (SETTLE_S if reads else 0)
        while True:
            done = run(step, env, tmp_path)
            matches = done.returncode == 0 and (shown is None or prints(shown, done.stdout))
            if matches or time.monotonic() >= deadline:
                break
            time.sleep(1)
        assert done.returncode == 0, f"{step.text}\n{done.stderr}"
        assert matches, f"{step.text}\nprinted:\n{done.stdout}\nthe README shows:\n{shown}"
        checked += shown is not None
    assert checked >= 6


def runbook_commands(stream: str) -> list[str]:
    """Every ``keyq …`` command of the runbook, on ``stream``; each ``ID`` a letter ``pN:1``."""
    text = OPERATIONS.read_text()
    section = text[text.index(RUNBOOK_SECTION) :]
    section = section[: section.index("\n## ", len(RUNBOOK_SECTION))]
    numbers = itertools.count(1)
    commands = []
    for command in RUNBOOK_COMMAND.findall(section):
        filled = DOC_STREAM.sub(stream, command)
        commands.append(re.sub(r"\bID\b", lambda _: f"p{next(numbers)}:1", filled))
    return commands


def test_every_runbook_command_is_pasteable(
    stream: StreamFixture, amqp: pika.BlockingConnection, tmp_path: Path
) -> None:
    """No command of the runbook is refused as bad usage (exit 2), on a stream whose key
    ``order-17`` has dead letters, as a parked key has, and each ``ID`` a letter to act on."""
    commands = runbook_commands(stream.name)
    assert len(commands) >= 15, commands
    ids = [letter for command in commands for letter in re.findall(r"--id p\d+:1", command)]
    record_stream(stream)
    letters = letters_for(stream.name, [("order-17", 1), ("order-17", 2)], producer="p0")
    for number, _ in enumerate(ids, 1):
        letters += letters_for(stream.name, [(f"order-{100 + number}", 1)], f"p{number}")
    dead_letter(amqp, stream.name, letters, reason=REASON)
    (tmp_path / "fixed.json").write_bytes(orjson.dumps(FIXED_PAYLOAD))
    options = {"cwd": tmp_path, "env": environment(load_settings()), "capture_output": True}
    for command in commands:
        assert f"--stream {stream.name}" in command, f"{command}: no --stream"
        done = subprocess.run(
            ["bash", "-c", command], stdin=subprocess.DEVNULL, text=True, timeout=120, **options
        )
        assert done.returncode != USAGE_ERROR, f"{command}: {done.stderr}"
