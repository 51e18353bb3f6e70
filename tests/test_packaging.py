"""keyq as a user installs it: ``pip install`` into a fresh venv outside the repository puts
exactly one top-level import package, ``keyq``, into site-packages, and a user's own
``producer.py`` and ``worker.py`` (names keyq's internals once took) work beside it.

The venv borrows the development venv's third-party packages through a ``.pth`` line (so
the test needs no index), never its keyq: only the fresh install is importable there.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Any

import pytest

from keyq.worker.state_store import StateStore
from tests.workers import FAST, REPO, keyq_environment

# It installs from the repository (the build backend comes from the package index).
pytestmark = [pytest.mark.slow, pytest.mark.services]

USER_PRODUCER = """
import sys

from keyq import Producer

with Producer(sys.argv[1], mode="key") as producer:
    for n in range(1, 4):
        producer.publish("order-1", {"n": n})
    producer.flush()
print("published 3")
"""

USER_PIPELINE = """
def remember(state, event):
    state = state or {"seen": []}
    state["seen"].append(event["n"])
    return state


def pipeline(df, ctx):
    return ctx.state.fold(df, remember)
"""


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with keyq installed from the repository as a user would (not editable)."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # Third-party packages only: a path from a .pth is searched, but its own .pth files
    # (the development venv's editable keyq) are not read.
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            str(REPO),
        ],
        check=True,
        timeout=300,
    )
    return venv


def installed_top_level(venv: Path) -> set[str]:
    """Top-level names the installed distribution put into site-packages (from RECORD)."""
    [record] = venv.glob("lib/python*/site-packages/keyq-*.dist-info/RECORD")
    names = set()
    for line in record.read_text().splitlines():
        first = line.split(",")[0].split("/")[0]
        if first and not first.endswith(".dist-info") and first != "..":
            names.add(first)
    return names


def test_install_puts_one_import_package_into_site_packages(fresh_venv: Path) -> None:
    assert installed_top_level(fresh_venv) == {"keyq"}
    python = str(fresh_venv / "bin" / "python")
    probe = (
        "import keyq, keyq.broker, keyq.producer, keyq.worker, keyq.janitor; print(keyq.__file__)"
    )
    where = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd="/")
    assert where.returncode == 0, where.stderr
    assert where.stdout.startswith(str(fresh_venv)), where.stdout
    for gone in ("broker", "producer", "worker", "janitor"):
        found = subprocess.run(
            [python, "-c", f"import {gone}"], capture_output=True, text=True, cwd="/"
        )
        assert found.returncode != 0, f"a top-level '{gone}' is importable"


def test_a_users_producer_py_and_worker_py_work(
    fresh_venv: Path, stream: Any, tmp_path: Path
) -> None:
    (tmp_path / "producer.py").write_text(textwrap.dedent(USER_PRODUCER))
    (tmp_path / "worker.py").write_text(textwrap.dedent(USER_PIPELINE))
    env = keyq_environment(stream.settings, FAST)
    env.pop("PYTHONPATH")  # nothing of the repository: the user's folder and the install only
    published = subprocess.run(
        [str(fresh_venv / "bin" / "python"), "producer.py", stream.name],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert published.returncode == 0, published.stderr
    assert "published 3" in published.stdout
    # The `keyq` script, from the user's folder, finds the user's worker.py as the pipeline.
    served = subprocess.run(
        [
            str(fresh_venv / "bin" / "keyq"),
            "worker",
            "--stream",
            stream.name,
            "--pipeline",
            "worker:pipeline",
            "--until-idle",
            "3",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=240,
    )
    assert served.returncode == 0, served.stderr[-3000:]
    assert StateStore(stream.redis, stream.name).get("order-1") == {"seen": [1, 2, 3]}
