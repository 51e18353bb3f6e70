"""Fixtures on the real services: RabbitMQ, Redis (and, for worker tests, Spark).

Services come from KEYQ_AMQP_URL / KEYQ_REDIS_URL (started by ``scripts/services.sh``); when
they do not answer and a Docker engine does, the session starts them with testcontainers.
Every test gets its own stream name, and everything of that stream (queues, Redis keys) is
removed afterwards; a shared Redis is never flushed.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import pika
import pika.exceptions
import pytest
import redis

from keyq import Producer
from keyq.broker.errors import KeyqError
from keyq.broker.naming import dead_letter_queue_name
from keyq.broker.redis_keys import KEY_PREFIX, StreamKeys
from keyq.broker.settings import Settings, load_settings

TEST_STREAM_PREFIX = "t-"


def reachable(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    address = (parts.hostname or "localhost", parts.port or default_port)
    try:
        with socket.create_connection(address, 2):
            return True
    except OSError:
        return False


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# ``make test`` runs the suite in two phases: KEYQ_TEST_ALONE=skip, every test but those marked
# ``alone``, in parallel; then KEYQ_TEST_ALONE=only, those, in one process. Run beside the
# others, an ``alone`` test holds every process idle until the longest test in flight ends.
PHASE = os.environ.get("KEYQ_TEST_ALONE", "")


def _keep_the_phase(config: pytest.Config, items: list[pytest.Item]) -> None:
    if PHASE not in ("skip", "only"):
        return
    keep = [i for i in items if (i.get_closest_marker("alone") is not None) == (PHASE == "only")]
    left = [i for i in items if i not in keep]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = keep
        config.stash[_PHASE_DESELECTED] = True


_PHASE_DESELECTED = pytest.StashKey[bool]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A phase the split left empty is no failure; a selection empty before it still is."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and session.config.stash.get(
        _PHASE_DESELECTED, False
    ):
        session.exitstatus = pytest.ExitCode.OK


@pytest.hookimpl(trylast=True)  # after xdist's, which names each test's group
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that needs no service fixture, and is not marked ``services``, is a unit test
    (``make test-fast``). Under ``--dist loadgroup`` a group's tests (sharing a module-scoped
    server) must reach one process; some pytest releases ignore the node-id suffix xdist groups
    by: the run stops then, rather than go several times slower."""
    _keep_the_phase(config, items)
    for item in items:
        uses_services = "services" in getattr(item, "fixturenames", ())
        if not uses_services and item.get_closest_marker("services") is None:
            item.add_marker(pytest.mark.unit)
    if getattr(config.option, "loadgroup", False):
        lost = [
            i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid
        ]
        if lost:
            raise pytest.UsageError(
                f"pytest-xdist did not group {len(lost)} tests (e.g. {lost[0]}) under pytest "
                f"{pytest.__version__}: install the pytest that pyproject.toml's dev extra names"
            )


def _run_lock_folder() -> Path:
    """A folder the processes of one pytest run share (xdist names the run), for its locks."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"single-{os.getpid()}")
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"keyq-tests-{run}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(autouse=True)
def _alone_if_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``alone`` asserts on timing, so it runs while no other test of the run
    does; the others share the run's lock. A turnstile taken first keeps a waiting ``alone``
    test from being starved by the shared holders that keep coming."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield  # one process: every test runs alone already
        return
    folder = _run_lock_folder()
    alone = request.node.get_closest_marker("alone") is not None
    with (folder / "turnstile").open("a") as turnstile, (folder / "run").open("a") as run:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(run, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _services_for_marked_tests(request: pytest.FixtureRequest) -> None:
    """Tests marked ``services`` reach them through keyq's defaults: find or start them too."""
    if request.node.get_closest_marker("services") is not None:
        request.getfixturevalue("services")


@pytest.fixture(scope="session")
def services() -> Iterator[Settings]:
    """The services' settings; containers are started only if nothing answers locally."""
    settings = load_settings()
    amqp_ok = reachable(settings.amqp_url, 5672)
    redis_ok = reachable(settings.redis_url, 6379)
    containers: list[object] = []
    if not (amqp_ok and redis_ok):
        if not _docker_answers():
            pytest.exit(
                "RabbitMQ or Redis is not reachable and no Docker engine answers: run "
                "scripts/services.sh (make test does) or set KEYQ_AMQP_URL / KEYQ_REDIS_URL",
                returncode=2,
            )
        from testcontainers.rabbitmq import RabbitMqContainer
        from testcontainers.redis import RedisContainer

        if not amqp_ok:
            rabbit = RabbitMqContainer("rabbitmq:4-management").start()
            containers.append(rabbit)
            host, port = rabbit.get_container_host_ip(), rabbit.get_exposed_port(5672)
            os.environ["KEYQ_AMQP_URL"] = f"amqp://guest:guest@{host}:{port}/%2F"
        if not redis_ok:
            red = RedisContainer("redis:7").start()
            containers.append(red)
            host, port = red.get_container_host_ip(), red.get_exposed_port(6379)
            os.environ["KEYQ_REDIS_URL"] = f"redis://{host}:{port}/0"
        settings = load_settings()
    yield settings
    for container in containers:
        with suppress(Exception):
            container.stop()  # type: ignore[attr-defined]
    _sweep_leftover_queues(settings)


def _live_marker(stream: str) -> str:
    """A Redis key that says a running test owns ``stream`` (it expires if the test dies)."""
    return f"keyq-tests:live:{stream}"


LIVE_MARKER_TTL_S = 3600


def _sweep_leftover_queues(settings: Settings) -> None:
    """Clean up after tests a killed session never finished: test streams registered in Redis
    whose owner's marker is gone (found through Redis, never by listing the broker)."""
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        pattern = f"{KEY_PREFIX}:{{{TEST_STREAM_PREFIX}*}}:*"
        names = {key.split("{", 1)[1].split("}", 1)[0] for key in client.scan_iter(pattern, 1000)}
        for name in sorted(names):
            if not client.exists(_live_marker(name)):
                StreamFixture(name=name, settings=settings, redis=client).cleanup()
    except (redis.exceptions.RedisError, pika.exceptions.AMQPError, OSError):
        pass  # a best effort: the services may be gone at the end of the session
    finally:
        client.close()


def delete_queues(settings: Settings, queues: list[str]) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    try:
        channel = connection.channel()
        for queue in queues:
            try:
                channel.queue_delete(queue)
            except pika.exceptions.ChannelClosedByBroker:
                channel = connection.channel()
    finally:
        with suppress(Exception):
            connection.close()


@dataclass
class StreamFixture:
    """A stream name of the test's own, with what to clean up after it."""

    name: str
    settings: Settings
    redis: redis.Redis
    extra_queues: set[str] = field(default_factory=set)

    @property
    def keys(self) -> StreamKeys:
        return StreamKeys(self.name)

    def track(self, *queues: str) -> None:
        self.extra_queues.update(queues)

    def own(self) -> StreamFixture:
        """Mark the stream as a running test's, which another session's sweep leaves alone."""
        self.redis.set(_live_marker(self.name), os.getpid(), ex=LIVE_MARKER_TTL_S)
        return self

    def cleanup(self) -> None:
        registered = [str(q) for q in self.redis.zrange(self.keys.registry, 0, -1)]
        queues = set(registered) | self.extra_queues | {dead_letter_queue_name(self.name)}
        for raw in self.redis.hvals(self.keys.aside):  # queues keys' events waited in aside
            queues.update(orjson.loads(raw))
        queues.update(str(q) for q in self.redis.hkeys(self.keys.redrives))
        delete_queues(self.settings, sorted(queues))
        for pattern in self.keys.all_patterns():
            for key in self.redis.scan_iter(match=pattern, count=1000):
                self.redis.delete(key)
        self.redis.delete(_live_marker(self.name))


@pytest.fixture
def settings(services: Settings) -> Settings:
    return load_settings()


@pytest.fixture
def redis_client(settings: Settings) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def stream(settings: Settings, redis_client: redis.Redis) -> Iterator[StreamFixture]:
    fixture = StreamFixture(
        name=f"{TEST_STREAM_PREFIX}{uuid.uuid4().hex[:12]}", settings=settings, redis=redis_client
    ).own()
    yield fixture
    fixture.cleanup()


@pytest.fixture
def producer(stream: StreamFixture) -> Iterator[Producer]:
    """A key-mode producer on the test's stream, closed (without raising) at the end."""
    made = Producer(stream.name, mode="key", settings=stream.settings, publish_timeout=10)
    try:
        yield made
    finally:
        with suppress(KeyqError):
            made.close(timeout=5)


@pytest.fixture
def amqp(settings: Settings) -> Iterator[pika.BlockingConnection]:
    """A plain pika connection for looking at what really landed. It asks for no heartbeats: a
    blocking connection left idle sends none, and the broker would close it under a long test."""
    parameters = pika.URLParameters(settings.amqp_url)
    parameters.heartbeat = 0
    connection = pika.BlockingConnection(parameters)
    yield connection
    with suppress(Exception):
        connection.close()


@pytest.fixture
def workers(
    settings: Settings,
    tmp_path_factory: pytest.TempPathFactory,
    spark_class_archive: Path | None,
) -> Iterator[Any]:
    """Start worker processes with ``workers(stream, **options)``; all killed at the end."""
    from tests.workers import WorkerProcess

    started: list[WorkerProcess] = []
    log_dir = tmp_path_factory.mktemp("worker-logs")

    def start(stream_name: str, **options: Any) -> WorkerProcess:
        process = WorkerProcess(settings, stream_name, log_dir, **options)
        started.append(process)
        return process

    yield start
    for process in started:
        process.close()


@pytest.fixture(scope="session")
def spark_class_archive() -> Path | None:
    """The class-data archive local Sparks start from in half the time, built once if missing."""
    from keyq.worker.config import WorkerSettings
    from keyq.worker.spark.classes import build_archive

    return build_archive(load_settings(WorkerSettings))


@pytest.fixture(scope="session")
def spark_engine(services: Settings, spark_class_archive: Path | None) -> Iterator[Any]:
    """One in-process SparkSession for tests that run a Worker in the test process."""
    from keyq.worker.config import WorkerSettings
    from keyq.worker.spark.engine import SparkEngine

    engine = SparkEngine(load_settings(WorkerSettings, spark_master="local[2]"), "keyq-tests")
    engine.start()
    yield engine
    engine.stop()


PRIVATE_RABBIT_NOFILE = 512


@pytest.fixture(scope="session")
def private_rabbit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A RabbitMQ node of the tests' own, for what must not be done to a shared node."""
    from tests.servers import PrivateRabbit, private_servers_available

    missing = private_servers_available()
    if missing:
        pytest.skip(missing)
    folder = tmp_path_factory.mktemp("private-rabbit")
    rabbit = PrivateRabbit(folder, management=True, prometheus=True, nofile=PRIVATE_RABBIT_NOFILE)
    rabbit.start()
    try:
        yield rabbit
    finally:
        rabbit.stop()
