"""deploy/prometheus's alerting rules, checked by promtool (Debian's ``prometheus``, which
scripts/services.sh installs; missing, it fails these tests in CI and skips them elsewhere):
rules and scrape configuration load, every alert has unit tests showing it firing and quiet
and links its section of docs/alerts.md, whose commands are real ``keyq`` commands; the
Grafana dashboard shows every keyq metric the alerts use, in valid PromQL."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from keyq.broker.settings import Settings
from keyq.cli.root import cli
from keyq.janitor.config import JanitorSettings
from keyq.worker.config import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "keyq-alerts.yml"
RULE_TESTS = PROMETHEUS / "keyq-alerts.test.yml"
SCRAPE_CONFIG = PROMETHEUS / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "keyq-dashboard.json"
ALERTS_DOC = ROOT / "docs" / "alerts.md"
RUNBOOK_PREFIX = "docs/alerts.md#"
SCRAPE_JOBS = {"keyq-worker", "keyq-janitor"}
METRIC_NAME = re.compile(r"\bkeyq_[a-z0-9_]+")
MISSING = (
    "promtool is not installed: it is in Debian's `prometheus` package "
    "(`apt-get install prometheus`), which scripts/services.sh installs as root"
)


@cache
def _promtool() -> str | None:
    return shutil.which("promtool")


@pytest.fixture
def promtool() -> str:
    found = _promtool()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(MISSING)
        pytest.skip(MISSING)
    return found


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), cwd=PROMETHEUS, capture_output=True, text=True, timeout=120, check=False
    )


@cache
def _alerts() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = [rule for group in groups for rule in group["rules"] if "alert" in rule]
    named = {rule["alert"]: rule for rule in alerts}
    assert len(named) == len(alerts), "two alerts share a name"
    return named


@cache
def _rule_tests() -> list[dict[str, Any]]:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    return [case for test in tests for case in test.get("alert_rule_test", [])]


def _slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@cache
def _doc_sections() -> dict[str, str]:
    """Each level-2 section of docs/alerts.md by its anchor: its text."""
    sections: dict[str, str] = {}
    anchor = None
    for line in ALERTS_DOC.read_text().splitlines():
        if line.startswith("## "):
            anchor = _slug(line[3:])
            assert anchor not in sections, f"two sections of docs/alerts.md are #{anchor}"
            sections[anchor] = ""
        elif anchor is not None:
            sections[anchor] += line + "\n"
    return sections


def _dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def test_promtool_checks_the_rules_the_scrape_config_the_alert_tests_and_the_dashboard(
    promtool: str, tmp_path: Path
) -> None:
    """The dashboard's PromQL is checked as recording rules, its variable replaced by what
    "All" stands for."""
    checked = _run(promtool, "check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in checked.stdout, checked.stdout
    checked = _run(promtool, "check", "config", SCRAPE_CONFIG.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert {job["job_name"] for job in config["scrape_configs"]} == SCRAPE_JOBS
    assert config["rule_files"] == [RULES.name]
    tested = _run(promtool, "test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout, tested.stdout
    rules = [
        {"record": f"keyq:dashboard_query_{n}", "expr": expr.replace("$stream", ".*")}
        for n, expr in enumerate(_dashboard_expressions())
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = _run(promtool, "check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_alert_is_unit_tested_described_linked_to_its_section_and_on_the_dashboard() -> None:
    """Every section of docs/alerts.md is an alert's; the dashboard shows every keyq metric
    the alerts use, and the daemons' scrape jobs, which the alerts watch."""
    cases = _rule_tests()
    firing = {case["alertname"] for case in cases if case.get("exp_alerts")}
    quiet = {case["alertname"] for case in cases if not case.get("exp_alerts")}
    assert sorted(set(_alerts()) - firing) == [], "alerts no unit test fires"
    assert sorted(set(_alerts()) - quiet) == [], "alerts no unit test shows quiet"
    assert sorted({case["alertname"] for case in cases} - set(_alerts())) == []
    for name, rule in _alerts().items():
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert rule["annotations"]["summary"], name
        assert rule["annotations"]["description"], name
    expressions = {name: " ".join(rule["expr"].split()) for name, rule in _alerts().items()}
    for job in SCRAPE_JOBS:
        assert any(f'up{{job="{job}"}} == 0' in expr for expr in expressions.values()), job
    absent = [expr for expr in expressions.values() if expr.startswith("absent(")]
    assert "absent(keyq_janitor_passes_total)" in absent
    assert "absent(keyq_worker_queues_held)" in absent
    dead_letters = expressions["KeyqDeadLettersGrowing"]
    assert "min_over_time(keyq_stream_dead_letters[15m])" in dead_letters, dead_letters
    sections = _doc_sections()
    for name, rule in _alerts().items():
        url = rule["annotations"].get("runbook_url", "")
        assert url == RUNBOOK_PREFIX + name.lower(), f"{name}: runbook_url is {url!r}"
        anchor = url.removeprefix(RUNBOOK_PREFIX)
        assert anchor in sections, f"{name}: docs/alerts.md has no section #{anchor}"
        assert "```sh" in sections[anchor], f"{name}: its section has no commands to run"
    assert sorted(set(sections) - {name.lower() for name in _alerts()}) == []
    used = {name for rule in _alerts().values() for name in METRIC_NAME.findall(rule["expr"])}
    shown = {name for expr in _dashboard_expressions() for name in METRIC_NAME.findall(expr)}
    assert "keyq_stream_stranded_keys" in used
    assert sorted(used - shown) == []
    expressions = " ".join(_dashboard_expressions())
    for job in SCRAPE_JOBS:
        assert job in expressions, job


def _keyq_command_lines() -> list[str]:
    lines = []
    in_block = False
    for line in ALERTS_DOC.read_text().splitlines():
        if line.startswith("```"):
            in_block = not in_block
        elif in_block and line.startswith("keyq "):
            lines.append(line.split("  #")[0].strip())
    return lines


def _command_of(words: list[str]) -> tuple[click.Command, list[str]]:
    command: click.Command = cli
    rest = words
    while isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
        found = command.commands.get(rest[0])
        assert found is not None, f"keyq has no command {' '.join(words)}"
        command, rest = found, rest[1:]
    assert not isinstance(command, click.Group), f"`keyq {' '.join(words)}` names a group"
    return command, rest


def test_the_alerts_doc_runs_real_commands_names_real_settings_and_links_real_anchors() -> None:
    lines = _keyq_command_lines()
    assert len(lines) >= 20, lines
    for line in lines:
        words = shlex.split(line)[1:]
        command, rest = _command_of(words)
        options = {
            opt
            for param in command.params
            if isinstance(param, click.Option)
            for opt in (*param.opts, *param.secondary_opts)
        }
        for word in rest:
            if word.startswith("--"):
                assert word in options, f"`{line}`: keyq {command.name} has no {word}"
        if "--stream" in options and command.name != "janitor":
            assert "--stream" in rest, f"`{line}` names no stream"
    settings = {
        f"KEYQ_{field.upper()}"
        for kind in (Settings, WorkerSettings, JanitorSettings)
        for field in kind.model_fields
    }
    text = ALERTS_DOC.read_text() + RULES.read_text()
    named = set(re.findall(r"\bKEYQ_[A-Z0-9_]+", text))
    assert named, "no setting named"
    assert sorted(named - settings) == []
    docs = ALERTS_DOC.parent
    links = re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", ALERTS_DOC.read_text())
    assert links
    for target, anchor in links:
        text = (docs / target).read_text() if target else ALERTS_DOC.read_text()
        anchors = {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
        assert anchor in anchors, f"docs/alerts.md links {target}#{anchor}, which does not exist"
