"""Run keyq's compose deployment end to end in a real Docker engine, and check it.

Each run, under a compose project of its own:

1. builds the image (one service builds it), and checks that every keyq container runs it;
2. starts everything and waits for the producer (the demo) to publish;
3. while it publishes, scales the workers up by one, ``docker kill``s one that holds queues
   (an operator's stop: Docker does not restart it, the others take its queues over), and
   kills the worker process inside another with ``kill -9`` (a crash: the restart policy
   brings the container back);
4. waits for the producer's verdict (its exit code: 0 OK, 3 failed, 1 a runtime failure);
5. scrapes every running worker's and the janitor's metrics, from inside its container, and reads
   the console's overview (with its token, and checks the 401 without it);
6. counts the Parquet files and rows the workers wrote into the data volume;
7. tears everything down with its volumes, and checks nothing of the project is left.

Before the runs it builds the Dockerfile's ``slim`` target (``pip install keyq``: no Java, no
Spark) as ``keyq:slim`` and runs ``keyq --version`` and ``keyq settings`` in it.

It fails if the verdict is not OK, any container but the crashed one restarted (a start-up
race would show here) or the crashed one did not, more than one service built an image, a
metrics endpoint did not answer, no Parquet landed, or the slim image failed. A JSON summary
of every run goes to stdout (and to --out), progress to stderr.

    python3 scripts/compose_check.py [--runs 3] [--host-network] [--out FILE]

``--host-network`` layers ``deploy/host-network.yml``: every service on the host's network,
on ports beside a RabbitMQ and Redis already running there. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "keyq:local"
SLIM_IMAGE = "keyq:slim"
KEYQ_SERVICES = ("worker", "janitor", "console", "producer")
METRICS_LINE = re.compile(r"serving metrics on http://[^:/]+:(\d+)/metrics")
SPARK_READY = re.compile(r"spark ready in ([\d.]+)s")
VERDICTS = {0: "OK", 3: "FAILED", 1: "runtime failure", 2: "usage error"}
# The rows of the demo's summary table worth keeping, as printed by `keyq demo`.
TABLE_ROWS = {
    "publish_events_per_s": r"publish rate\W+([\d,]+) events/s",
    "end_to_end_events_per_s": r"end to end\W+([\d,]+) events/s",
    "latency_ms": r"latency p50 / p95 / p99\W+([\d,]+) / ([\d,]+) / ([\d,]+) ms",
    "queues": r"queues created / left\W+([\d,]+) / ([\d,]+)",
}
SCRAPE = (
    "import sys, urllib.request; "
    "print(urllib.request.urlopen(f'http://127.0.0.1:{sys.argv[1]}/metrics', timeout=5)"
    ".read().decode())"
)
CONSOLE_LINE = re.compile(r"keyq console on (http://[^/]+)/")
# From inside the console's container: the overview with the token it was given (none on
# loopback), and, with a token, the 401 without it. Prints the status codes and the page.
CONSOLE_PAGE = (
    "import base64, os, sys, urllib.error, urllib.request\n"
    "token = os.environ.get('KEYQ_CONSOLE_TOKEN')\n"
    "def get(auth):\n"
    "    request = urllib.request.Request(sys.argv[1] + '/')\n"
    "    if auth:\n"
    "        basic = base64.b64encode(f'operator:{token}'.encode()).decode()\n"
    "        request.add_header('Authorization', 'Basic ' + basic)\n"
    "    try:\n"
    "        with urllib.request.urlopen(request, timeout=10) as answer:\n"
    "            return answer.status, answer.read().decode()\n"
    "    except urllib.error.HTTPError as error:\n"
    "        return error.code, ''\n"
    "status, page = get(bool(token))\n"
    "print(get(False)[0] if token else 'open', status, 'stream orders' in page or "
    "'data-stream=\"orders\"' in page)\n"
)
PARQUET_ROWS = (
    "import pathlib, pyarrow.parquet as pq; "
    "files = sorted(pathlib.Path('/data/orders').rglob('*.parquet')); "
    "print(len(files), sum(pq.ParquetFile(f).metadata.num_rows for f in files))"
)


class CheckFailed(Exception):
    """The deployment did not do what it must."""


def say(text: str) -> None:
    print(f"[compose-check {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        args, check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=os.environ
    )
    if check and done.returncode != 0:
        raise CheckFailed(f"{' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
    return done


class Deployment:
    """One compose project: the commands of one run."""

    def __init__(self, files: list[str]) -> None:
        self.project = f"keyq-check-{uuid.uuid4().hex[:6]}"
        self.base = ["docker", "compose", "-p", self.project]
        for name in files:
            self.base += ["-f", name]

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return run(*self.base, *args, timeout=timeout)

    def containers(self, service: str | None = None, *, every: bool = False) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        listed = run("docker", "ps", "-q", *(["-a"] if every else []), *filters).stdout
        return sorted(listed.split())

    def inspect(self, container: str) -> dict[str, Any]:
        found: list[dict[str, Any]] = json.loads(run("docker", "inspect", container).stdout)
        return found[0]

    def logs(self, container: str) -> str:
        done = run("docker", "logs", container, check=False)
        return done.stdout + done.stderr

    def volumes(self) -> list[str]:
        listed = run(
            "docker",
            "volume",
            "ls",
            "-q",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
        ).stdout
        return listed.split()

    def down(self) -> None:
        run(*self.base, "down", "-v", "--remove-orphans", "--timeout", "60", timeout=300)


def check_engine() -> dict[str, str]:
    """The engine and Compose must answer; the legacy builder when BuildKit has no buildx."""
    if run("docker", "info", check=False).returncode != 0:
        raise CheckFailed("no Docker engine answers (`docker info` failed)")
    version = run("docker", "compose", "version", "--short", check=False)
    if version.returncode != 0:
        raise CheckFailed("Compose v2 is missing (`docker compose version` failed)")
    if (
        "DOCKER_BUILDKIT" not in os.environ
        and run("docker", "buildx", "version", check=False).returncode
    ):
        os.environ["DOCKER_BUILDKIT"] = "0"
    return {"compose": version.stdout.strip(), "buildkit": os.environ.get("DOCKER_BUILDKIT", "")}


def build(deployment: Deployment) -> dict[str, Any]:
    started = time.monotonic()
    done = deployment.compose("build", timeout=3600)
    output = done.stdout + done.stderr
    built = sorted(set(re.findall(r"Service (\w[\w-]*)\s+Building", output)))
    if built and built != ["worker"]:
        raise CheckFailed(f"the image was built by {built}; only the worker service builds it")
    size = int(run("docker", "image", "inspect", IMAGE, "--format", "{{.Size}}").stdout)
    return {"seconds": round(time.monotonic() - started, 1), "built_by": built, "bytes": size}


def check_slim(host_network: bool) -> dict[str, Any]:
    """The slim image builds, and its keyq runs (with no network) and has no Spark."""
    started = time.monotonic()
    network = ["--network", "host"] if host_network else []
    run("docker", "build", *network, "--target", "slim", "-t", SLIM_IMAGE, ".", timeout=1800)
    seconds = round(time.monotonic() - started, 1)
    offline = ["docker", "run", "--rm", "--network", "none"]
    version = run(*offline, SLIM_IMAGE, "--version").stdout.strip()
    settings = run(*offline, SLIM_IMAGE, "settings").stdout
    spark = run(*offline, "--entrypoint", "python", SLIM_IMAGE, "-c", "import pyspark", check=False)
    if spark.returncode == 0:
        raise CheckFailed(f"{SLIM_IMAGE} has pyspark: the slim target must not")
    size = int(run("docker", "image", "inspect", SLIM_IMAGE, "--format", "{{.Size}}").stdout)
    return {
        "seconds": seconds,
        "bytes": size,
        "version": version,
        "settings_lines": len(settings.splitlines()),
        "ok": True,
    }


def wait_for(what: str, condition: Any, timeout: float, every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise CheckFailed(f"timed out after {timeout:.0f} s waiting for {what}")


def held_queues(deployment: Deployment, container: str) -> float:
    """How many queues a worker holds, from its own metrics (0 when not serving yet)."""
    try:
        text = scrape(deployment, container)
    except CheckFailed:
        return 0.0
    return metric(text, "keyq_worker_queues_held")


def metrics_port(deployment: Deployment, container: str) -> int | None:
    found = METRICS_LINE.findall(deployment.logs(container))
    return int(found[-1]) if found else None


def scrape(deployment: Deployment, container: str) -> str:
    port = metrics_port(deployment, container)
    if port is None:
        raise CheckFailed(f"{container} logged no metrics endpoint")
    done = run("docker", "exec", container, "python", "-c", SCRAPE, str(port), check=False)
    if done.returncode != 0:
        raise CheckFailed(f"{container}'s metrics on port {port} did not answer")
    return done.stdout


def console_answers(deployment: Deployment) -> dict[str, Any]:
    """The console's overview shows the demo's stream, and asks for its token where it has one."""
    (container,) = deployment.containers("console")
    found = CONSOLE_LINE.findall(deployment.logs(container))
    if not found:
        raise CheckFailed("the console logged no address")
    url = found[-1].replace("0.0.0.0", "127.0.0.1")
    done = run("docker", "exec", container, "python", "-c", CONSOLE_PAGE, url, check=False)
    words = done.stdout.split()
    if done.returncode != 0 or len(words) != 3:
        raise CheckFailed(f"the console at {url} did not answer: {done.stderr[-1000:]}")
    without, status, shows = words
    if status != "200" or shows != "True" or without not in ("open", "401"):
        raise CheckFailed(f"the console at {url}: {without} without a token, {status}, {shows}")
    say(f"console at {url}: the overview shows stream orders ({without} without a token)")
    return {"url": url, "without_token": without, "status": int(status)}


def metric(text: str, family: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((f"{family} ", f"{family}{{"))
    )


def chaos(deployment: Deployment, replicas: int) -> list[dict[str, Any]]:
    """Scale the workers up by one, then kill a worker that holds queues, while the demo
    publishes. Naming the service keeps compose from touching the others (the producer)."""
    actions: list[dict[str, Any]] = []
    deployment.compose(
        "up", "-d", "--no-deps", "--no-recreate", "--scale", f"worker={replicas + 1}", "worker"
    )
    actions.append({"action": "scale", "workers": replicas + 1, "at": time.time()})
    say(f"scaled the workers to {replicas + 1}")
    victim = wait_for(
        "a worker that holds queues",
        lambda: next(
            (c for c in deployment.containers("worker") if held_queues(deployment, c) > 0), None
        ),
        300,
        every=2.0,
    )
    name = deployment.inspect(victim)["Name"].lstrip("/")
    held = held_queues(deployment, victim)
    run("docker", "kill", victim)
    actions.append({"action": "docker kill", "container": name, "held": held, "at": time.time()})
    say(f"docker kill {name}, which held {held:.0f} queues: it stays down")
    # A crash: the worker's process dies inside its container, which the restart policy
    # brings back (a `docker kill` is an operator's stop, which Docker never undoes).
    crashed = wait_for(
        "another worker that holds queues",
        lambda: next(
            (
                c
                for c in deployment.containers("worker")
                if c != victim and held_queues(deployment, c) > 0
            ),
            None,
        ),
        300,
        every=2.0,
    )
    name = deployment.inspect(crashed)["Name"].lstrip("/")
    held = held_queues(deployment, crashed)
    # The worker is the child of the container's init (`init: true`), which carries the same
    # command line and cannot be killed from inside.
    run("docker", "exec", crashed, "sh", "-c", 'kill -9 "$(pgrep -o -P 1 -f "keyq worker")"')
    actions.append({"action": "kill -9", "container": name, "held": held, "at": time.time()})
    say(f"kill -9 of the worker process in {name}, which held {held:.0f} queues")
    wait_for(
        f"{name} to be restarted",
        lambda: (
            deployment.inspect(crashed)["RestartCount"] >= 1
            and deployment.inspect(crashed)["State"]["Running"]
        ),
        120,
    )
    say(f"{name} restarted")
    return actions


def parse_table(text: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, pattern in TABLE_ROWS.items():
        match = re.search(pattern, text)
        if match:
            numbers = [int(group.replace(",", "")) for group in match.groups()]
            found[name] = numbers[0] if len(numbers) == 1 else numbers
    return found


def one_run(files: list[str], replicas: int, timeout: float) -> dict[str, Any]:
    deployment = Deployment(files)
    say(f"project {deployment.project}: building")
    result: dict[str, Any] = {"project": deployment.project}
    try:
        result["image"] = build(deployment)
        say(f"image {IMAGE}: {result['image']['bytes'] / 1e9:.2f} GB")
        started = time.monotonic()
        deployment.compose("up", "-d", timeout=900)
        producer = wait_for("the producer", lambda: deployment.containers("producer"), 300)[0]
        # One image: every keyq container runs keyq:local as built above, whoever built it.
        image_id = run("docker", "image", "inspect", IMAGE, "--format", "{{.Id}}").stdout.strip()
        runs = {
            deployment.inspect(c)["Image"]
            for service in KEYQ_SERVICES
            for c in deployment.containers(service, every=True)
        }
        if runs != {image_id}:
            raise CheckFailed(f"the keyq services run {sorted(runs)}, not {IMAGE} ({image_id})")
        result["image"]["id"] = image_id
        wait_for(
            "the demo to publish",
            lambda: (
                "publishing " in deployment.logs(producer)
                or not deployment.inspect(producer)["State"]["Running"]
            ),
            600,
        )
        result["publishing_after_s"] = round(time.monotonic() - started, 1)
        say(f"the demo publishes ({result['publishing_after_s']} s after up)")
        result["chaos"] = chaos(deployment, replicas)
        state = wait_for(
            "the producer's verdict",
            lambda: (s := deployment.inspect(producer)["State"])["Running"] is False and s,
            timeout,
            every=2.0,
        )
        code = int(state["ExitCode"])
        logs = deployment.logs(producer)
        result["verdict"] = VERDICTS.get(code, f"exit {code}")
        result["demo"] = parse_table(logs)
        result["seconds_to_verdict"] = round(time.monotonic() - started, 1)
        say(f"verdict {result['verdict']} ({result['demo']})")
        result["restarts"] = {
            deployment.inspect(c)["Name"].lstrip("/"): deployment.inspect(c)["RestartCount"]
            for c in deployment.containers(every=True)
        }
        crashed = {a["container"] for a in result["chaos"] if a["action"] == "kill -9"}
        result["spark_ready_s"] = {
            deployment.inspect(c)["Name"].lstrip("/"): [
                float(seconds) for seconds in SPARK_READY.findall(deployment.logs(c))
            ]
            for c in deployment.containers("worker", every=True)
        }
        result["metrics"] = {}
        for service in ("worker", "janitor"):
            for container in deployment.containers(service):
                name = deployment.inspect(container)["Name"].lstrip("/")
                text = scrape(deployment, container)
                family = (
                    "keyq_worker_events_processed_total"
                    if service == "worker"
                    else "keyq_janitor_passes_total"
                )
                if f"# TYPE {family} counter" not in text:
                    raise CheckFailed(f"{name}'s metrics have no {family}")
                result["metrics"][name] = {
                    "port": metrics_port(deployment, container),
                    family: metric(text, family),
                }
        result["console"] = console_answers(deployment)
        workers = deployment.containers("worker")
        counted = run("docker", "exec", workers[0], "python", "-c", PARQUET_ROWS).stdout.split()
        result["parquet"] = {"files": int(counted[0]), "rows": int(counted[1])}
        say(f"metrics from {len(result['metrics'])} daemons; parquet {result['parquet']}")
        problems: list[str] = []
        if code != 0:
            problems.append(f"the verdict is {result['verdict']}:\n{logs[-3000:]}")
        expected = {name: int(name in crashed) for name in result["restarts"]}
        if result["restarts"] != expected:
            problems.append(f"restarts {result['restarts']}, expected {expected}")
        if not result["parquet"]["files"] or not result["parquet"]["rows"]:
            problems.append("no Parquet rows landed in the data volume")
        if problems:
            raise CheckFailed("; ".join(problems))
        result["ok"] = True
        return result
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        result["ok"] = False
        result["failure"] = str(exc)
        for container in deployment.containers(every=True):
            name = deployment.inspect(container)["Name"].lstrip("/")
            say(f"--- last lines of {name}:\n{deployment.logs(container)[-1500:]}")
        return result
    finally:
        say("tearing down")
        deployment.down()
        left = deployment.containers(every=True) + deployment.volumes()
        result["left_behind"] = left
        if left:
            result["ok"] = False
            result.setdefault("failure", f"left behind: {left}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="runs in a row (default 1)")
    parser.add_argument("--host-network", action="store_true", help="layer deploy/host-network.yml")
    parser.add_argument("--workers", type=int, default=3, help="the compose file's replicas")
    parser.add_argument("--timeout", type=float, default=900, help="s to wait for a verdict")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    options = parser.parse_args()
    files = ["docker-compose.yml"] + (["deploy/host-network.yml"] if options.host_network else [])
    try:
        engine = check_engine()
    except CheckFailed as exc:
        say(str(exc))
        return 2
    say(f"building {SLIM_IMAGE}")
    try:
        slim = check_slim(options.host_network)
        say(f"{SLIM_IMAGE}: {slim['version']}, {slim['bytes'] / 1e9:.2f} GB")
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        slim = {"ok": False, "failure": str(exc)}
        say(f"{SLIM_IMAGE} FAILED: {exc}")
    runs = []
    for number in range(1, options.runs + 1):
        say(f"run {number} of {options.runs}")
        runs.append(one_run(files, options.workers, options.timeout))
        if not runs[-1]["ok"]:
            say(f"run {number} FAILED: {runs[-1].get('failure')}")
            break
    summary = {"engine": engine, "files": files, "slim": slim, "runs": runs}
    summary["ok"] = slim["ok"] and len(runs) == options.runs and all(r["ok"] for r in runs)
    text = json.dumps(summary, indent=2)
    print(text)
    if options.out:
        options.out.write_text(text + "\n")
    say("PASSED" if summary["ok"] else "FAILED")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
