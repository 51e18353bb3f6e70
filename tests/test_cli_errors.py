"""Every ``keyq`` error is one line ``keyq: ...`` on stderr, with the exit code scripts rely on.

Each row runs the installed ``keyq`` with RabbitMQ and Redis on a closed port: bad input exits 2
(refused before connecting), valid input exits 1 naming the service; never a traceback or password.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

KEYQ = str(Path(sys.executable).with_name("keyq"))
PASSWORD = "s3cret"
CLOSED_PORTS = {
    "KEYQ_AMQP_URL": f"amqp://u:{PASSWORD}@127.0.0.1:1/%2F",
    "KEYQ_REDIS_URL": f"redis://:{PASSWORD}@127.0.0.1:1/0",
}
RUN_TIMEOUT_S = 60  # a command that connects to a closed port waits for it, and fails the row
# One process runs the file: the rows are run once, together, for the whole module.
pytestmark = pytest.mark.xdist_group("cli-errors")

USAGE = 2
FAILURE = 1

PIPELINES = {
    "kq_syntax_pipe": "def run(df, ctx):\n    return df\nx = (\n",
    "kq_raising_pipe": "import os\nraise RuntimeError('cannot start\\nat all')\n",
    "kq_constant_pipe": "run = 5\n",
    "kq_missing_dep_pipe": "import kq_no_such_dependency\n",
}


@dataclass(frozen=True)
class Row:
    args: tuple[str, ...]
    code: int
    says: str = ""  # text the line must hold


def row(code: int, *args: str, says: str = "") -> Row:
    return Row(args, code, says)


STREAM = ("--stream", "s")
EVENT = ("publish", *STREAM, "--key", "a", "--event")  # then the event
PIPELINE = ("worker", *STREAM, "--pipeline")  # then the pipeline
DEMO_WORKER = (*PIPELINE, "keyq.demo.orders:pipeline")
DEMO_EXTERNAL = ("demo", "--external-workers", "--wait-for-services", "0")

ROWS: dict[str, Row] = {
    # click's own usage errors, at every level
    "unknown command": row(USAGE, "bogus", says="No such command"),
    "unknown root option": row(USAGE, "--bogus", says="--bogus"),
    "unknown subcommand of dlq": row(USAGE, "dlq", "bogus", says="No such command"),
    "unknown subcommand of stream": row(USAGE, "stream", "bogus", says="No such command"),
    "unknown option of stream show": row(USAGE, "stream", "show", "--bogus", says="--bogus"),
    "unknown option of settings": row(USAGE, "settings", "--bogus", says="--bogus"),
    "missing --stream of dlq list": row(USAGE, "dlq", "list", says="--stream"),
    "missing --event": row(USAGE, "publish", *STREAM, "--key", "a", says="--event"),
    "bad int": row(USAGE, *EVENT, "{}", "--buckets", "x"),
    "bad choice": row(USAGE, *EVENT, "{}", "--mode", "q"),
    "bad log level": row(USAGE, "janitor", "--log-level", "loud", says="--log-level"),
    # publish
    "event not an object": row(USAGE, *EVENT, "[1,2]", says="JSON object"),
    "event int past 64 bits": row(USAGE, *EVENT, '{"a": 18446744073709551616}', says="64-bit"),
    "event NaN": row(USAGE, *EVENT, '{"a": NaN}', says="NaN"),
    "event not JSON": row(USAGE, *EVENT, '{"a":', says="JSON"),
    "empty key": row(USAGE, "publish", *STREAM, "--key", "", "--event", "{}", says="empty"),
    "bad stream name": row(
        USAGE, "publish", "--stream", "no such", "--key", "a", "--event", "{}", says="stream name"
    ),
    "buckets in key mode": row(USAGE, *EVENT, "{}", "--mode", "key", "--buckets", "4"),
    # produce
    "negative rate": row(USAGE, "produce", *STREAM, "--rate", "-1", says="--rate"),
    "rate nan": row(USAGE, "produce", *STREAM, "--rate", "nan", says="--rate"),
    "negative skew": row(USAGE, "produce", *STREAM, "--skew", "-2", says="--skew"),
    "no keys": row(USAGE, "produce", *STREAM, "--keys", "0", says="--keys"),
    "no events": row(USAGE, "produce", *STREAM, "--events", "0", says="--events"),
    "zero buckets": row(USAGE, "produce", *STREAM, "--mode", "bucket", "--buckets", "0"),
    # state, inspect, pause, resume
    "state of an empty key": row(USAGE, "state", *STREAM, "--key", "", says="empty"),
    "inspect an empty key": row(USAGE, "inspect", *STREAM, "--key", "", says="empty"),
    "inspect negative wait": row(USAGE, "inspect", *STREAM, "--key", "a", "--wait", "-1"),
    "pause nothing": row(USAGE, "pause", *STREAM, says="--all"),
    "pause an empty key": row(USAGE, "pause", *STREAM, "--key", "", says="empty"),
    "resume a missing keys file": row(
        USAGE, "resume", *STREAM, "--keys-file", "/nonexistent/keys", says="keys file"
    ),
    # stream set / show
    "stream set nothing": row(USAGE, "stream", "set", *STREAM, says="nothing to set"),
    "bad poison policy": row(USAGE, "stream", "set", *STREAM, "--poison-policy", "nope"),
    "bad rate limit": row(USAGE, "stream", "set", *STREAM, "--rate-limit", "fast"),
    "short dedupe window": row(USAGE, "stream", "set", *STREAM, "--dedupe-window", "1"),
    "stream show bad name": row(USAGE, "stream", "show", "--stream", "-x", says="stream name"),
    # dlq
    "dlq list zero limit": row(USAGE, "dlq", "list", *STREAM, "--limit", "0", says="--limit"),
    "dlq show without id": row(USAGE, "dlq", "show", *STREAM, says="--id"),
    "dlq show blank id": row(USAGE, "dlq", "show", *STREAM, "--id", " x", says="--id"),
    "dlq redrive nothing": row(USAGE, "dlq", "redrive", *STREAM, says="redrive needs"),
    "dlq redrive to-key alone": row(USAGE, "dlq", "redrive", *STREAM, "--to-key", "b"),
    "dlq redrive all with key": row(USAGE, "dlq", "redrive", *STREAM, "--all", "--key", "a"),
    "dlq redrive missing payload file": row(
        USAGE, "dlq", "redrive", *STREAM, "--id", "p:1", "--payload-file", "/nonexistent/p"
    ),
    "dlq drop nothing": row(USAGE, "dlq", "drop", *STREAM, says="--key or --id"),
    "dlq drop empty key": row(USAGE, "dlq", "drop", *STREAM, "--key", "", says="empty"),
    "dlq reindex negative wait": row(USAGE, "dlq", "reindex", *STREAM, "--wait", "-1"),
    # status
    "status bad stream name": row(USAGE, "status", "--stream", "a b", says="stream name"),
    "status zero watch": row(USAGE, "status", *STREAM, "--watch", "0", says="--watch"),
    # worker (the pipeline rows below are the worker's too)
    "worker negative until-idle": row(USAGE, *DEMO_WORKER, "--until-idle", "-1"),
    "worker zero buckets": row(USAGE, *DEMO_WORKER, "--buckets", "0"),
    "worker bad sink": row(USAGE, *DEMO_WORKER, "--sink", "ftp:x"),
    "worker bad id": row(USAGE, *DEMO_WORKER, "--worker-id", "a|b"),
    # janitor
    "janitor negative idle ttl": row(USAGE, "janitor", "--once", "--idle-ttl", "-1"),
    "janitor bad stream name": row(USAGE, "janitor", "--once", "--stream", "a b"),
    # demo
    "demo no orders": row(USAGE, "demo", "--orders", "0", says="--orders"),
    "demo fewer events than orders": row(USAGE, "demo", "--orders", "10", "--events", "5"),
    "demo bad stream name": row(USAGE, "demo", "--stream", "x y", says="stream name"),
    "demo buckets in key mode": row(USAGE, "demo", "--mode", "key", "--buckets", "3"),
    "demo too many workers": row(USAGE, "demo", "--workers", "99", says="--workers"),
    "demo zero timeout": row(USAGE, "demo", "--timeout", "0", says="--timeout"),
    # pipelines that cannot be imported
    "pipeline with a syntax error": row(
        USAGE, *PIPELINE, "kq_syntax_pipe:run", says="kq_syntax_pipe.py:3"
    ),
    "pipeline raising at import": row(
        USAGE, *PIPELINE, "kq_raising_pipe:run", says="kq_raising_pipe.py:2"
    ),
    "pipeline not callable": row(USAGE, *PIPELINE, "kq_constant_pipe:run", says="not a function"),
    "pipeline attribute missing": row(USAGE, *PIPELINE, "kq_constant_pipe:nope", says="'nope'"),
    "pipeline module missing": row(USAGE, *PIPELINE, "kq_no_such_pipe:run", says="kq_no_such_pipe"),
    "pipeline dependency missing": row(
        USAGE, *PIPELINE, "kq_missing_dep_pipe:run", says="kq_missing_dep_pipe.py:1"
    ),
    "pipeline spec without function": row(
        USAGE, *PIPELINE, "kq_constant_pipe:", says="module:function"
    ),
    # valid input, services unreachable
    "publish, Redis down": row(FAILURE, *EVENT, "{}", says="Redis"),
    "produce, Redis down": row(FAILURE, "produce", *STREAM, "--events", "1", says="Redis"),
    "state, Redis down": row(FAILURE, "state", *STREAM, "--key", "a", says="Redis"),
    "inspect, Redis down": row(FAILURE, "inspect", *STREAM, "--key", "a", says="Redis"),
    "pause, Redis down": row(FAILURE, "pause", *STREAM, "--all", says="Redis"),
    "stream show, Redis down": row(FAILURE, "stream", "show", *STREAM, says="Redis"),
    "dlq list, Redis down": row(FAILURE, "dlq", "list", *STREAM, says="Redis"),
    "status, Redis down": row(FAILURE, "status", *STREAM, says="Redis"),
    "demo, RabbitMQ down": row(
        FAILURE, *DEMO_EXTERNAL, "--orders", "2", "--events", "4", says="RabbitMQ"
    ),
}


@dataclass(frozen=True)
class Outcome:
    code: int | None  # None: it did not finish in time
    stdout: str
    stderr: str


def _run(args: tuple[str, ...], cwd: Path) -> Outcome:
    env = {name: value for name, value in os.environ.items() if not name.startswith("KEYQ_")}
    env |= CLOSED_PORTS
    try:
        done = subprocess.run(
            [KEYQ, *args],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        return Outcome(None, str(exc.stdout or ""), str(exc.stderr or ""))
    return Outcome(done.returncode, done.stdout, done.stderr)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Outcome]]:
    folder = tmp_path_factory.mktemp("pipelines")
    for name, text in PIPELINES.items():
        (folder / f"{name}.py").write_text(text)
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(_run, spec.args, folder) for name, spec in ROWS.items()}
        yield {name: future.result() for name, future in futures.items()}


def test_there_are_enough_rows() -> None:
    assert sum(spec.code == USAGE for spec in ROWS.values()) >= 30


@pytest.mark.parametrize("name", list(ROWS))
def test_an_error_is_one_line_with_its_exit_code(name: str, outcomes: dict[str, Outcome]) -> None:
    spec, outcome = ROWS[name], outcomes[name]
    shown = f"keyq {' '.join(spec.args)}\nstdout: {outcome.stdout!r}\nstderr: {outcome.stderr!r}"
    assert outcome.code is not None, f"did not exit within {RUN_TIMEOUT_S} s: {shown}"
    lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, shown
    assert lines[0].startswith("keyq: "), shown
    assert "Traceback" not in outcome.stderr + outcome.stdout, shown
    assert PASSWORD not in outcome.stderr + outcome.stdout, shown
    assert spec.says in lines[0], shown
    assert outcome.code == spec.code, shown
