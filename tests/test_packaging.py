"""keyq as a user installs it: a fresh venv gets one top-level package, ``keyq``, and a user's own
``producer.py`` and ``worker.py`` work beside it. A plain install without extras has no Spark, yet
publishes and runs the light commands; those needing Spark say in one line what to install."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
import tomllib
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from keyq.worker.batch.state_store import StateStore
from tests.workers import FAST, REPO, keyq_environment

# It installs from the repository (the build backend comes from the package index).
# One process runs the file: its tests share the venvs it builds (module scope).
pytestmark = [pytest.mark.slow, pytest.mark.services, pytest.mark.xdist_group("packaging")]
PIP = (sys.executable, "-m", "pip", "--python")

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
    """A venv with keyq installed from the repository (not editable), borrowing the development
    venv's third-party packages through a ``.pth`` line, never its keyq."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    [site] = venv.glob("lib/python*/site-packages")
    # A path from a .pth is searched, but its own .pth files (the editable keyq) are not read.
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [*PIP, str(venv / "bin" / "python"), "install", "-q", "--no-deps", str(REPO)]
    subprocess.run(install, check=True, timeout=300)
    return venv


def _run(*argv: str, cwd: Path | str = "/", **options: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, **options)


def _user_env(stream: Any) -> dict[str, str]:
    env = keyq_environment(stream.settings, FAST)
    env.pop("PYTHONPATH")  # nothing of the repository: the user's folder and the install only
    return env


def installed_top_level(venv: Path) -> set[str]:
    """Top-level names the installed distribution put into site-packages (from RECORD)."""
    [record] = venv.glob("lib/python*/site-packages/keyq-*.dist-info/RECORD")
    firsts = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines()}
    return {name for name in firsts if name and not name.endswith(".dist-info") and name != ".."}


def test_install_puts_one_import_package_and_a_users_producer_py_and_worker_py_work(
    fresh_venv: Path, stream: Any, tmp_path: Path
) -> None:
    assert installed_top_level(fresh_venv) == {"keyq"}
    python = str(fresh_venv / "bin" / "python")
    probe = "import keyq, keyq.broker, keyq.producer, keyq.worker, keyq.janitor"
    where = _run(python, "-c", f"{probe}; print(keyq.__file__)")
    assert where.returncode == 0, where.stderr
    assert where.stdout.startswith(str(fresh_venv)), where.stdout
    for gone in ("broker", "producer", "worker", "janitor"):
        assert _run(python, "-c", f"import {gone}").returncode != 0, f"a top-level '{gone}'"
    (tmp_path / "producer.py").write_text(textwrap.dedent(USER_PRODUCER))
    (tmp_path / "worker.py").write_text(textwrap.dedent(USER_PIPELINE))
    env = _user_env(stream)
    published = _run(python, "producer.py", stream.name, cwd=tmp_path, env=env, timeout=120)
    assert published.returncode == 0, published.stderr
    assert "published 3" in published.stdout
    # The `keyq` script, from the user's folder, finds the user's worker.py as the pipeline.
    serve = ("worker", "--stream", stream.name, "--pipeline", "worker:pipeline", "--until-idle")
    served = _run(str(fresh_venv / "bin" / "keyq"), *serve, "3", cwd=tmp_path, env=env, timeout=240)
    assert served.returncode == 0, served.stderr[-3000:]
    assert StateStore(stream.redis, stream.name).get("order-1") == {"seen": [1, 2, 3]}


# --------------------------------------------------------------------------- no extras

SPARK_MODULES = ("pyspark", "pyarrow", "pandas", "numpy", "py4j")
WORKER_EXTRA = "pip install 'keyq[worker]'"


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with ``pip install <repository>``: no extras, every dependency from the index."""
    venv = tmp_path_factory.mktemp("light") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run([*PIP, python, "install", "-q", str(REPO)], check=True, timeout=600)
    return venv


def run_light(venv: Path, stream: Any, *args: str, where: Path) -> subprocess.CompletedProcess[str]:
    return _run(
        str(venv / "bin" / args[0]), *args[1:], cwd=where, env=_user_env(stream), timeout=120
    )


def test_the_plain_install_has_no_spark_its_worker_api_says_so_and_its_version_is_right(
    light_venv: Path,
) -> None:
    python = str(light_venv / "bin" / "python")
    probe = (
        "import importlib.util, sys; import keyq, keyq.cli.root; "
        f"print([m for m in {SPARK_MODULES!r} if importlib.util.find_spec(m)])"
    )
    found = _run(python, "-c", probe)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "[]"
    worker = _run(python, "-c", "from keyq import Worker")
    assert worker.returncode == 1
    assert worker.stderr.splitlines()[-1].endswith(WORKER_EXTRA), worker.stderr
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    shown = _run(python, "-c", "import keyq; print(keyq.__version__)")
    assert shown.stdout.strip() == declared, shown.stderr
    cli = _run(str(light_venv / "bin" / "keyq"), "--version", cwd=Path.cwd())
    assert cli.stdout.strip() == f"keyq, version {declared}"


def test_the_plain_install_publishes_and_runs_the_light_commands(
    light_venv: Path, stream: Any, tmp_path: Path
) -> None:
    (tmp_path / "producer.py").write_text(textwrap.dedent(USER_PRODUCER))
    light = partial(run_light, light_venv, stream, where=tmp_path)
    published = light("python", "producer.py", stream.name)
    assert published.returncode == 0, published.stderr
    assert "published 3" in published.stdout
    on_stream = ("--stream", stream.name)
    done = light("keyq", "publish", *on_stream, "--key", "order-2", "--event", '{"n": 1}')
    assert done.returncode == 0, done.stderr
    assert "seq=1" in done.stdout
    for command in (
        ("status", *on_stream),
        ("inspect", *on_stream, "--key", "order-1", "--json"),
        ("dlq", "list", *on_stream),
        ("pause", *on_stream, "--key", "order-1"),
        ("resume", *on_stream, "--key", "order-1"),
        ("stream", "show", *on_stream),
        ("janitor", *on_stream, "--once"),
        ("settings",),
    ):
        ran = light("keyq", *command)
        assert ran.returncode == 0, f"keyq {' '.join(command)}: {ran.stderr[-2000:]}"
    # No worker ran, so the key has no state: the command ran, without Spark, and said so.
    state = light("keyq", "state", *on_stream, "--key", "order-1")
    assert state.returncode == 1, state.stderr
    assert "no state for key 'order-1'" in state.stderr


@pytest.mark.parametrize(
    "command",
    [
        ("worker", "--stream", "orders", "--pipeline", "keyq.demo.orders:pipeline"),
        ("spark-cache",),
        ("demo", "--events", "10"),
    ],
    ids=lambda command: command[0],
)
def test_a_spark_command_without_spark_says_what_to_install(
    light_venv: Path, tmp_path: Path, command: tuple[str, ...]
) -> None:
    ran = _run(str(light_venv / "bin" / "keyq"), *command, cwd=tmp_path, timeout=60)
    assert ran.returncode == 2, ran.stderr
    [line] = ran.stderr.splitlines()
    assert line.startswith(f"keyq: keyq {command[0]} ") and line.endswith(WORKER_EXTRA), line
    assert ran.stdout == ""
