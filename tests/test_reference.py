"""docs/reference.md says what the code says: regenerated here and compared byte for byte."""

from __future__ import annotations

import difflib
import socket
from pathlib import Path

import pytest

from keyq.cli.reference import REGENERATE, _symbolic, render

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"


def test_the_reference_is_what_the_code_generates() -> None:
    written = REFERENCE.read_text(encoding="utf-8")
    generated = render()
    if written != generated:
        lines = written.splitlines(), generated.splitlines()
        diff = difflib.unified_diff(*lines, "docs/reference.md", "generated", n=1, lineterm="")
        shown = "\n".join(list(diff)[:40])
        pytest.fail(f"docs/reference.md is stale: run `{REGENERATE}`\n{shown}", pytrace=False)


def test_the_reference_depends_on_nothing_but_the_code(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("KEYQ_TICK_MS=300\n")
    monkeypatch.setenv("KEYQ_METRICS_PORT", "9999")
    assert render() == REFERENCE.read_text(encoding="utf-8")


def test_defaults_of_this_machine_are_written_as_what_they_stand_for() -> None:
    assert _symbolic(str(Path.home() / ".cache" / "keyq")) == "~/.cache/keyq"
    assert _symbolic(socket.gethostname()) == "<host>"
    assert _symbolic("redis://localhost:6379/0") == "redis://localhost:6379/0"
