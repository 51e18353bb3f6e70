"""docker-compose.yml and the Dockerfile, checked by reading them (no Docker engine runs tests):
real ``keyq`` commands and options, real ``KEYQ_*`` settings, workers that scale and stop."""

from __future__ import annotations

import importlib
import json
import re
import shlex
import tomllib
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import yaml

from keyq.broker.settings import Settings
from keyq.cli.root import cli
from keyq.console.settings import ConsoleSettings
from keyq.janitor.config import JanitorSettings
from keyq.worker.config import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"

INFRASTRUCTURE = ("rabbitmq", "redis")
KEYQ_SERVICES = ("worker", "janitor", "console", "producer")
# Commands the deployment and the operations guide rely on, whether or not a service runs them.
REQUIRED_COMMANDS = ("worker", "janitor", "demo", "produce", "status")
SETTINGS_OF_SERVICE: dict[str, type[Settings]] = dict(
    zip(KEYQ_SERVICES, (WorkerSettings, JanitorSettings, ConsoleSettings, Settings), strict=True)
)
# The folders mapped into the one import package, `keyq` (pyproject's package-dir).
_SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIRS = tuple(sorted({path.split("/")[0] for path in _SETUPTOOLS["package-dir"].values()}))


@cache
def _compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(loaded, dict), "docker-compose.yml is not a mapping"
    return loaded


def _services() -> dict[str, Any]:
    return dict(_compose()["services"])


def _service(name: str) -> dict[str, Any]:
    service = _services()[name]
    assert isinstance(service, dict), f"service {name} is not a mapping"
    return service


def _command(name: str) -> list[str]:
    """A service's command as words (compose splits a string the way a shell would)."""
    command = _service(name).get("command")
    assert command, f"service {name} has no command"
    return shlex.split(command) if isinstance(command, str) else [str(word) for word in command]


def _environment(name: str) -> dict[str, str]:
    environment = _service(name).get("environment") or {}
    if isinstance(environment, list):
        pairs = (str(item).partition("=") for item in environment)
        return {key: value for key, _, value in pairs}
    return {str(key): "" if value is None else str(value) for key, value in environment.items()}


def _keyq_variables() -> list[str]:
    return sorted({v for name in _services() for v in _environment(name) if v.startswith("KEYQ_")})


def _setting_variables() -> set[str]:
    kinds = (Settings, WorkerSettings, JanitorSettings, ConsoleSettings)
    return {f"KEYQ_{field.upper()}" for kind in kinds for field in kind.model_fields}


def _seconds(duration: str | int | float) -> float:
    """A compose duration (``45s``, ``1m30s``, ``1500ms``, ``1h``) in seconds."""
    if isinstance(duration, (int, float)):
        return float(duration)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(a + u for a, u in parts) == duration, f"bad duration {duration!r}"
    return sum(float(amount) * units[unit] for amount, unit in parts)


def test_every_service_and_command_is_there() -> None:
    assert {*INFRASTRUCTURE, *KEYQ_SERVICES} <= set(_services())
    missing = set(REQUIRED_COMMANDS) - set(cli.commands)
    assert not missing, f"keyq has no {sorted(missing)}; it has {sorted(cli.commands)}"


def test_one_service_builds_the_one_image_every_keyq_service_runs() -> None:
    """One service builds the image; the others run it by name and never try to pull it."""
    builders = [name for name in KEYQ_SERVICES if _service(name).get("build")]
    assert builders == ["worker"], f"{builders} build images; one service should"
    build = _service("worker")["build"]
    if isinstance(build, str):
        build = {"context": build}
    context = (COMPOSE.parent / build.get("context", ".")).resolve()
    dockerfile = (context / build.get("dockerfile", "Dockerfile")).resolve()
    assert dockerfile == DOCKERFILE.resolve(), f"the worker builds {dockerfile}"
    images = {_service(name).get("image") for name in KEYQ_SERVICES}
    assert len(images) == 1 and None not in images, f"keyq services run {images}"
    for name in KEYQ_SERVICES:
        if name not in builders:
            assert _service(name).get("pull_policy") == "never", f"{name} would pull"


@pytest.mark.parametrize("name", KEYQ_SERVICES)
def test_a_keyq_service_runs_a_real_command_with_real_settings(name: str) -> None:
    command, *args = _command(name)
    assert command in cli.commands, f"service {name} runs `keyq {command}`, which does not exist"
    subcommand = cli.commands[command]
    options = [p for p in subcommand.params if isinstance(p, click.Option)]
    known = {opt for param in options for opt in (*param.opts, *param.secondary_opts)}
    used = {arg.partition("=")[0] for arg in args if arg.startswith("--")}
    assert used <= known, f"service {name}: `keyq {command}` has no {sorted(used - known)}"
    # Parse it as click would (types, required options, choices), without running anything.
    try:
        subcommand.make_context(command, list(args))
    except click.ClickException as exc:
        pytest.fail(f"service {name}: `keyq {' '.join(_command(name))}`: {exc.format_message()}")
    for index, arg in enumerate(args):  # a pipeline it names exists
        if arg == "--pipeline" or arg.startswith("--pipeline="):
            spec = arg.partition("=")[2] or args[index + 1]
            module, _, function = spec.partition(":")
            assert callable(getattr(importlib.import_module(module), function, None)), spec
    values: dict[str, Any] = {
        variable.removeprefix("KEYQ_").lower(): value
        for variable, value in _environment(name).items()
        if variable.startswith("KEYQ_")
    }
    SETTINGS_OF_SERVICE[name](**values)
    depends_on = _service(name).get("depends_on")
    assert isinstance(depends_on, dict), f"{name}: depends_on needs conditions"
    for dependency in INFRASTRUCTURE:
        condition = depends_on.get(dependency, {}).get("condition")
        assert condition == "service_healthy", f"{name} must wait for {dependency} to be healthy"


@pytest.mark.parametrize("variable", _keyq_variables())
def test_compose_variables_are_keyq_settings(variable: str) -> None:
    assert variable in _setting_variables(), (
        f"{variable} is set in docker-compose.yml but is not a field of Settings, "
        "WorkerSettings, JanitorSettings or ConsoleSettings"
    )


def test_workers_scale_share_their_sink_and_stop_cleanly() -> None:
    """`docker compose up --scale worker=N` needs replicas that do not collide; Docker must not
    SIGKILL a worker still finishing its batch after SIGTERM."""
    worker = _service("worker")
    assert "container_name" not in worker, "a fixed container name stops --scale"
    replicas = int(worker.get("deploy", {}).get("replicas", 1))
    assert replicas >= 2
    assert int(_environment("worker").get("KEYQ_METRICS_PORT_SPAN", "1")) > replicas, (
        "under host networking the replicas share ports: give them a span"
    )
    for name in ("worker", "janitor"):
        assert _environment(name).get("KEYQ_METRICS_PORT"), f"{name} has no metrics port"
        assert not _service(name).get("ports"), f"{name} publishes a port on the host"
    args = _command("worker")
    sink = args[args.index("--sink") + 1]
    kind, _, folder = sink.partition(":")
    assert kind == "parquet"
    top_volumes = _compose().get("volumes") or {}
    mounts = [str(v).split(":") for v in _service("worker").get("volumes", [])]
    shared = [target for source, target, *_ in mounts if source in top_volumes]
    assert any(folder == t or folder.startswith(t.rstrip("/") + "/") for t in shared), (
        f"the worker's sink {folder} is not on a named volume its replicas share"
    )
    configured = _environment("worker").get("KEYQ_SHUTDOWN_TIMEOUT")
    timeout = float(configured or WorkerSettings.model_fields["shutdown_timeout"].default)
    grace = worker.get("stop_grace_period")
    assert grace is not None, "without stop_grace_period Docker kills workers after 10 s"
    assert _seconds(grace) > timeout, f"stop_grace_period {grace} <= shutdown timeout {timeout}"


def test_services_restart_and_are_healthy_once_they_accept_connections() -> None:
    """`rabbitmq-diagnostics ping` passes while AMQP still refuses connections: services
    that waited for it started too early and failed (the start-up race)."""
    for name in (*INFRASTRUCTURE, "worker", "janitor"):
        assert _service(name).get("restart") in ("unless-stopped", "always", "on-failure"), name
    rabbit = _service("rabbitmq")["healthcheck"]["test"]
    redis = _service("redis")["healthcheck"]["test"]
    assert rabbit[0] in ("CMD", "CMD-SHELL") and "rabbitmq-diagnostics" in " ".join(rabbit)
    assert redis[0] in ("CMD", "CMD-SHELL") and "redis-cli ping" in " ".join(redis)
    words = " ".join(rabbit[1:]).split()
    checks = [word for word in words if word.startswith(("check_", "ping", "status"))]
    assert checks, f"no diagnostics check in {words}"
    assert "ping" not in checks, "ping passes before RabbitMQ accepts AMQP connections"
    assert set(checks) & {"check_port_connectivity", "check_port_listener"}, checks


def test_the_demo_waits_for_its_services_and_runs_once() -> None:
    producer = _service("producer")
    assert str(producer.get("restart", "no")) == "no", "a restarted producer is a second demo"
    args = _command("producer")
    assert args[0] == "demo"
    if "--wait-for-services" in args:
        assert float(args[args.index("--wait-for-services") + 1]) >= 30
    default = next(p for p in cli.commands["demo"].params if p.name == "wait_for_services")
    assert isinstance(default.default, float) and default.default >= 30


def test_infrastructure_images_ports_and_open_files() -> None:
    """RabbitMQ may keep 65,536 files open by default, as key mode needs; KEYQ_RABBITMQ_NOFILE
    lowers it for an engine with a lower ceiling."""
    rabbit, redis = _service("rabbitmq"), _service("redis")
    found = re.fullmatch(r"rabbitmq:(\d+)(?:\.\d+){0,2}-management(?:-alpine)?", rabbit["image"])
    assert found, f"{rabbit['image']} is not an official RabbitMQ image with the management UI"
    assert int(found.group(1)) >= 4, "RabbitMQ 3.x is out of community support"
    assert re.fullmatch(r"redis:(\d+)(?:\.\d+){0,2}(?:-\w+)?", redis["image"])
    assert int(redis["image"].split(":")[1].split(".")[0]) >= 7
    assert {"5672:5672", "15672:15672"} <= {str(port) for port in rabbit["ports"]}
    nofile = rabbit["ulimits"]["nofile"]
    for bound in ("soft", "hard"):
        value = str(nofile[bound])
        found = re.fullmatch(r"\$\{KEYQ_RABBITMQ_NOFILE:-(\d+)\}", value)
        assert found, f"nofile {bound} is {value}: give it a default an engine can override"
        assert int(found.group(1)) >= 65536


def test_the_host_network_variant_leaves_the_default_ports_alone() -> None:
    """deploy/host-network.yml runs beside a RabbitMQ and Redis on the default ports: real
    services and settings, and nothing it binds is 5672, 15672 or 6379."""

    class ComposeLoader(yaml.SafeLoader):
        """Compose's `!reset` (drop what the base file set) reads as None here."""

    ComposeLoader.add_constructor("!reset", lambda loader, node: None)
    text = (ROOT / "deploy" / "host-network.yml").read_text()
    override = yaml.load(text, Loader=ComposeLoader)
    services = override["services"]
    assert set(services) <= set(_services()), set(services) - set(_services())
    for name in KEYQ_SERVICES:
        environment = services[name]["environment"]
        unknown = {v for v in environment if v.startswith("KEYQ_")} - _setting_variables()
        assert not unknown, f"{name}: {unknown} are not settings"
        for variable in ("KEYQ_AMQP_URL", "KEYQ_REDIS_URL", "KEYQ_MANAGEMENT_URL"):
            port = urlsplit(environment[variable]).port
            assert port not in (5672, 15672, 6379), f"{name}: {variable} is on {port}"
        assert services[name]["network_mode"] == "host"
    assert services["worker"]["build"] == {"network": "host"}, "only the worker builds"
    conf = ROOT / "deploy" / "host-network-rabbitmq.conf"
    assert "127.0.0.1:5673" in conf.read_text()
    mounts = " ".join(services["rabbitmq"]["volumes"])
    assert f"./deploy/{conf.name}:/etc/rabbitmq/rabbitmq.conf" in mounts
    redis_command = services["redis"]["command"]
    assert redis_command[redis_command.index("--port") + 1] == "6380"


@cache
def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or not (pending or line):
            continue  # Docker drops comment lines inside a continuation too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).partition(" ")
        pending = ""
        instructions.append((keyword.upper(), arguments.strip()))
    assert not pending, "the Dockerfile ends inside a continuation line"
    return instructions


def _arguments(keyword: str) -> list[str]:
    return [arguments for instruction, arguments in _instructions() if instruction == keyword]


def _env() -> dict[str, str]:
    variables: dict[str, str] = {}
    for arguments in _arguments("ENV"):
        words = shlex.split(arguments)
        if "=" in words[0]:
            variables.update(word.partition("=")[::2] for word in words)
        else:
            variables[words[0]] = " ".join(words[1:])
    return variables


def test_dockerfile_uses_python_3_11_or_newer_and_java_17() -> None:
    froms = _arguments("FROM")
    assert froms, "the Dockerfile has no FROM"
    base = shlex.split(froms[-1])[0].removeprefix("docker.io/library/")
    found = re.fullmatch(r"python:(\d+)\.(\d+)(?:\.\d+)?-slim(?:-(\w+))?", base)
    assert found, f"base image {base} is not an official python:X.Y-slim image"
    assert (int(found.group(1)), int(found.group(2))) >= (3, 11)
    runs = " ".join(_arguments("RUN"))
    assert re.search(r"apt-get install\b[^;&]*\bopenjdk-17-(jre|jdk)-headless\b", runs)
    # Debian 13 (trixie), which unpinned python:*-slim tags follow, has no openjdk-17.
    assert base.endswith("-bookworm"), "openjdk-17 needs a Debian 12 (bookworm) base"
    assert "java-17" in _env().get("JAVA_HOME", ""), "JAVA_HOME must point at Java 17"


def _build_context() -> set[str]:
    """What `.dockerignore` lets into the build: everything out (``*``), names back in (``!``)."""
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    rules = [line for line in lines if line and not line.startswith("#")]
    assert rules[0] == "*", ".dockerignore should leave everything out first"
    return {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}


def test_dockerfile_installs_keyq() -> None:
    assert PACKAGE_DIRS == ("broker", "janitor", "producer", "src", "worker")
    sent = _build_context()
    copied = " ".join(_arguments("COPY"))
    for needed in ("pyproject.toml", "README.md", *PACKAGE_DIRS):
        assert needed in sent, f"{needed} is left out of the build context"
        assert re.search(rf"(^|\s)({re.escape(needed)}/?|\.)(\s|$)", copied), f"{needed} not copied"
    assert any(re.search(r"pip install\b.*\s\.(;|\s|$)", run) for run in _arguments("RUN"))


def test_dockerfile_runs_keyq_unprivileged_and_needs_no_registry_frontend() -> None:
    # `# syntax=` makes BuildKit pull a frontend image first: no build without a registry.
    first = DOCKERFILE.read_text().lstrip().splitlines()[0]
    assert not re.match(r"#\s*syntax\s*=", first, re.IGNORECASE), first
    users = _arguments("USER")
    assert users, "the image runs as root"
    assert users[-1].split(":")[0] not in ("root", "0"), f"the image runs as {users[-1]}"
    entrypoint = _arguments("ENTRYPOINT")
    # The exec form (JSON): a shell form would not pass SIGTERM on to keyq.
    assert entrypoint and json.loads(entrypoint[-1]) == ["keyq"]
    command = _arguments("CMD")
    assert command and json.loads(command[-1]) == ["--help"]
    assert _env().get("PYSPARK_PYTHON", "").startswith("/usr/local/bin/python")
