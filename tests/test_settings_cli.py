"""``keyq settings`` from the shell: every component's settings with where each came from
(env, .env, default), passwords hidden; a bad setting is one line naming its variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from keyq.broker.errors import ConfigurationError
from keyq.broker.settings import Settings, load_settings
from keyq.console.settings import ConsoleSettings
from keyq.janitor.config import JanitorSettings
from keyq.worker.config import WorkerSettings

EXIT_USAGE = 2


def keyq(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``keyq`` in ``cwd`` with no KEYQ_* variable but ``env``'s."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith("KEYQ_")}
    return subprocess.run(
        [sys.executable, "-m", "keyq", *args],
        cwd=cwd,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def shown(cwd: Path, **env: str) -> dict[str, Any]:
    done = keyq(cwd, "settings", "--json", **env)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = orjson.loads(done.stdout)
    return result


def test_each_value_says_whether_it_came_from_env_dotenv_or_default(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text(
        "KEYQ_AMQP_URL=amqp://u:s3cret@mq:5672/%2F\nKEYQ_IDLE_TTL_S=12\nKEYQ_CONFIRM_WINDOW=7\n"
    )
    settings = shown(tmp_path, KEYQ_TICK_MS="300", KEYQ_CONFIRM_WINDOW="500")
    assert settings["worker"]["tick_ms"] == {
        "variable": "KEYQ_TICK_MS",
        "value": 300,
        "source": "env",
    }
    assert settings["janitor"]["idle_ttl_s"]["value"] == 12.0
    assert settings["janitor"]["idle_ttl_s"]["source"] == ".env"
    assert settings["shared"]["confirm_window"]["value"] == 500  # the environment wins
    assert settings["shared"]["confirm_window"]["source"] == "env"
    assert settings["shared"]["amqp_url"] == {
        "variable": "KEYQ_AMQP_URL",
        "value": "amqp://u:***@mq:5672/%2F",
        "source": ".env",
    }
    assert settings["shared"]["lock_ttl_ms"]["source"] == "default"

    table = keyq(tmp_path, "settings", KEYQ_TICK_MS="300").stdout
    assert "s3cret" not in table
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines() if line[:1] == " "}
    assert rows["KEYQ_TICK_MS"] == ["300", "env"]
    assert rows["KEYQ_IDLE_TTL_S"] == ["12.0", ".env"]
    assert rows["KEYQ_AMQP_URL"] == ["amqp://u:***@mq:5672/%2F", ".env"]
    assert rows["KEYQ_MAX_HELD_QUEUES"] == ["unset", "default"]


def test_every_component_shows_every_setting_once_and_never_the_console_token(
    tmp_path: Path,
) -> None:
    settings = shown(tmp_path, KEYQ_CONSOLE_TOKEN="s3cret-token")
    assert settings["console"]["console_token"]["source"] == "env"
    assert "s3cret-token" not in str(settings)
    shared = set(Settings.model_fields)
    assert set(settings) == {"shared", "worker", "janitor", "console"}
    assert set(settings["shared"]) == shared
    assert set(settings["worker"]) == set(WorkerSettings.model_fields) - shared
    assert set(settings["janitor"]) == set(JanitorSettings.model_fields) - shared
    assert set(settings["console"]) == set(ConsoleSettings.model_fields) - shared


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("KEYQ_METRICS_PORT", "abc", "Input should be a valid integer"),
        ("KEYQ_TICK_MS", "often", "Input should be a valid integer"),
        ("KEYQ_JANITOR_BATCH", "0", "Input should be greater than or equal to 1"),
    ],
    ids=["shared", "worker", "janitor"],
)
def test_a_bad_setting_is_one_line_naming_its_variable(
    tmp_path: Path, variable: str, value: str, message: str
) -> None:
    for done in (
        keyq(tmp_path, "settings", **{variable: value}),
        keyq(tmp_path, "settings", "--json", **{variable: value}),
    ):
        assert done.returncode == EXIT_USAGE
        assert done.stderr.startswith(f"keyq: {variable}: {message}"), done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
    (tmp_path / ".env").write_text(f"{variable}={value}\n")
    assert keyq(tmp_path, "settings").stderr.startswith(f"keyq: {variable}: {message}")


def test_the_daemons_name_the_variable_too(tmp_path: Path) -> None:
    janitor = keyq(tmp_path, "janitor", "--once", KEYQ_IDLE_TTL_S="soon")
    assert janitor.returncode == EXIT_USAGE
    assert janitor.stderr == (
        "keyq: KEYQ_IDLE_TTL_S: Input should be a valid number, unable to parse string as a "
        "number\n"
    )
    (tmp_path / ".env").write_text("KEYQ_MAX_ATTEMPTS=0\n")
    worker = keyq(tmp_path, "worker", "--stream", "s", "--pipeline", "keyq.demo.orders:pipeline")
    assert worker.returncode == EXIT_USAGE
    assert worker.stderr.startswith("keyq: KEYQ_MAX_ATTEMPTS: Input should be greater than or")


def test_a_rule_between_settings_and_an_unreadable_env_file_are_one_line(tmp_path: Path) -> None:
    done = keyq(tmp_path, "settings", KEYQ_TICK_MS="2000")
    assert done.returncode == EXIT_USAGE
    assert done.stderr.startswith("keyq: KEYQ_TICK_MS must be at most a third of KEYQ_LOCK_TTL_MS")
    (tmp_path / ".env").write_bytes(b"APP_NAME=caf\xe9\n")  # another application's, not UTF-8
    done = keyq(tmp_path, "settings")
    assert done.returncode == EXIT_USAGE
    assert done.stderr.startswith("keyq: cannot read the settings file .env"), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


def test_a_value_given_in_code_is_named_as_in_code() -> None:
    with pytest.raises(ConfigurationError, match=r"^confirm_window: Input should be greater"):
        load_settings(Settings, confirm_window=0)
