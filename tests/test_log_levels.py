"""``--log-level`` through the real command: an unknown level is a usage error (exit 2) that
names the levels, before any service is touched; a known one is accepted in any case. And
KEYQ_LOG_FORMAT=json: a real janitor's log is one JSON object per line, with the time, level,
logger, message and the stream and worker context; a bad value is a usage error."""

from __future__ import annotations

import os
import subprocess
import sys

import orjson
import pytest

from keyq.broker.settings import Settings
from keyq.cli.root import LOG_LEVELS
from tests.conftest import StreamFixture
from tests.workers import REPO, run_keyq

# Closed ports: a command that gets past its options fails fast, and reaches nothing.
NOWHERE = {
    "KEYQ_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/%2F",
    "KEYQ_REDIS_URL": "redis://127.0.0.1:1/0",
}
DAEMONS = {
    "worker": ["--stream", "levels", "--pipeline", "keyq.demo.orders:pipeline"],
    "janitor": ["--once"],
}


def _keyq(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {name: value for name, value in os.environ.items() if not name.endswith("LOG_LEVEL")}
    return subprocess.run(
        [sys.executable, "-m", "keyq", *args],
        capture_output=True,
        text=True,
        env={**clean, **NOWHERE, **(env or {})},
        cwd=REPO,
        timeout=60,
    )


def _assert_usage_error(done: subprocess.CompletedProcess[str], level: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("keyq: "), done.stderr
    assert "--log-level" in errors[0] and repr(level) in errors[0], errors[0]
    assert all(repr(name) in errors[0] for name in LOG_LEVELS), errors[0]


@pytest.mark.parametrize("command", sorted(DAEMONS))
@pytest.mark.parametrize("level", ["LOUD", "loud", "10", ""])
def test_an_unknown_level_is_a_usage_error_naming_the_levels(command: str, level: str) -> None:
    _assert_usage_error(_keyq(command, *DAEMONS[command], "--log-level", level), level)


@pytest.mark.parametrize("command", sorted(DAEMONS))
def test_an_unknown_level_from_the_environment_is_a_usage_error(command: str) -> None:
    variable = f"KEYQ_{command.upper()}_LOG_LEVEL"
    _assert_usage_error(_keyq(command, *DAEMONS[command], env={variable: "LOUD"}), "LOUD")


@pytest.mark.parametrize("level", ["warning", "WARNING", "Debug"])
def test_a_known_level_is_accepted_in_any_case(level: str) -> None:
    # Past its options, one janitor pass fails on the closed ports: a runtime failure (1) in
    # one line, not a usage error.
    done = _keyq("janitor", "--once", "--log-level", level)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith("keyq: cannot reach"), done.stderr


def test_the_help_lists_the_levels() -> None:
    done = _keyq("worker", "--help")
    assert done.returncode == 0, done.stderr
    assert "[debug|info|warning|error|critical]" in done.stdout


def test_a_janitor_logs_one_json_object_per_line(settings: Settings, stream: StreamFixture) -> None:
    done = run_keyq(
        settings,
        *("janitor", "--once", "--stream", stream.name, "--janitor-id", "j-json"),
        env={"KEYQ_LOG_FORMAT": "json"},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    records = [orjson.loads(line) for line in done.stderr.splitlines() if line.strip()]
    assert records  # every line is JSON, or the line above raises
    for record in records:
        assert {"time", "level", "logger", "message", "stream", "worker", "queue"} <= set(record)
        assert record["time"].endswith("+00:00")
        assert record["worker"] == "j-json" and record["stream"] == stream.name
    assert any(record["logger"] == "keyq.janitor" for record in records)
    assert "guest:guest" not in done.stderr


def test_an_unknown_log_format_is_a_usage_error(settings: Settings) -> None:
    done = run_keyq(settings, "janitor", "--once", env={"KEYQ_LOG_FORMAT": "xml"}, timeout=60)
    assert done.returncode == 2
    assert "KEYQ_LOG_FORMAT" in done.stderr and len(done.stderr.strip().splitlines()) == 1
