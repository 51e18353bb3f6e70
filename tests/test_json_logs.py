"""KEYQ_LOG_FORMAT=json: a real janitor's log is one JSON object per line, with the time,
level, logger, message and the stream and worker context; a bad value is a usage error."""

from __future__ import annotations

import orjson

from keyq.broker.settings import Settings
from tests.conftest import StreamFixture
from tests.workers import run_keyq


def test_a_janitor_logs_one_json_object_per_line(settings: Settings, stream: StreamFixture) -> None:
    done = run_keyq(
        settings,
        "janitor",
        "--once",
        "--stream",
        stream.name,
        "--janitor-id",
        "j-json",
        env={"KEYQ_LOG_FORMAT": "json"},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines
    records = [orjson.loads(line) for line in lines]  # every line is JSON, or this raises
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
