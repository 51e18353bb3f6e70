"""Operating limits keyq warns about: the broker's file descriptors (``keyq status`` and the
janitor), on a private node with a low ``nofile`` filled with key-mode queues until it nears
its limit (the shared node is never pushed), and a Redis that would forget keyq's commits."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from keyq import Producer
from keyq.broker.connections import open_redis
from keyq.broker.errors import ConfigurationError
from keyq.broker.fd_usage import NO_FIGURES, NOT_SET, FdUsage, near_limit, read_fd_usage
from keyq.broker.settings import Settings, load_settings
from keyq.cli.status import render_table
from keyq.janitor.config import JanitorSettings
from keyq.janitor.fd_watch import FdWatch
from keyq.janitor.janitor import Janitor
from keyq.janitor.metrics import JanitorMetrics
from keyq.ops.status import collect_status
from keyq.worker.redis_persistence import Persistence, judge, log_redis_persistence
from tests.conftest import PRIVATE_RABBIT_NOFILE, StreamFixture
from tests.servers import PrivateRabbit, PrivateRedis, free_port, private_servers_available
from tests.workers import WorkerProcess, run_keyq, wait_until

NOFILE = PRIVATE_RABBIT_NOFILE
WARN_RATIO = 0.5  # of 512: 256 fds; the node opens about 40 at rest, one per queue with messages
KEYS = 300  # 340 fds or so: above the warning, below what RabbitMQ's handle cache allows
NO_PERSISTENCE = "Redis keeps nothing on disk"


def _levels(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    found = [(record.levelname, record.getMessage()) for record in caplog.records]
    caplog.clear()
    return found


def test_the_warning_starts_at_the_ratio_and_the_janitor_says_it_then_rarely_and_when_clear(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert not near_limit(819, 1024, 0.8)
    assert near_limit(820, 1024, 0.8)
    assert near_limit(1024, 1024, 0.8)
    assert not near_limit(5, 0, 0.8)  # a limit of 0 is no limit we know
    assert FdUsage(0.8, used=900, limit=1024, node="n").near_limit
    assert not FdUsage(0.8, unknown_reason="not set").near_limit
    warning = FdUsage(0.8, used=900, limit=1024, node="rabbit@a").warning()
    assert warning is not None and "900 of its 1024" in warning and "rabbit@a" in warning
    assert FdUsage(0.8, used=100, limit=1024, node="n").warning() is None
    caplog.set_level(logging.INFO, logger="keyq.janitor")
    watch = FdWatch(load_settings(), repeat_s=600)

    def at(used: int, now: float) -> list[tuple[str, str]]:
        watch.observe(FdUsage(0.8, used=used, limit=1000, node="rabbit@a"), now)
        return _levels(caplog)

    assert at(500, 0) == []
    [(level, message)] = at(850, 60)
    assert level == "WARNING" and "850 of its 1000" in message
    assert at(900, 120) == []  # still near the limit: not every pass
    assert at(950, 599) == []
    [(level, message)] = at(950, 660)  # repeat_s later: said again
    assert level == "WARNING" and "950 of its 1000" in message
    [(level, message)] = at(400, 720)
    assert level == "INFO" and "back below" in message
    assert at(300, 780) == []


def test_an_unknown_figure_is_mentioned_once_at_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="keyq.janitor")
    calls: list[int] = []

    def read(_settings: Settings) -> FdUsage:
        calls.append(1)
        return FdUsage(0.8, unknown_reason="KEYQ_MANAGEMENT_URL is not set")

    clock = iter(range(0, 10_000, 30))
    watch = FdWatch(load_settings(), 600, check_every_s=60, read=read, clock=lambda: next(clock))
    for _ in range(10):
        watch.poll()
    assert len(calls) == 5  # every other poll: a check is due every 60 s, polls come every 30
    assert _levels(caplog) == [
        ("INFO", "not watching the broker's file descriptors: KEYQ_MANAGEMENT_URL is not set")
    ]


def test_without_a_reachable_api_the_figure_is_unknown_and_the_url_is_checked_and_never_shown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    unset = load_settings(management_url="", prometheus_url="")
    assert read_fd_usage(unset).unknown_reason == NOT_SET
    closed = f"http://keyq:s3cret-pw@127.0.0.1:{free_port()}"  # nothing listens there
    usage = read_fd_usage(load_settings(management_url=closed, prometheus_url=""))
    assert not usage.known and not usage.near_limit
    assert usage.unknown_reason is not None and "did not answer" in usage.unknown_reason
    shown = str(usage.as_dict()) + usage.summary() + caplog.text
    assert "s3cret-pw" not in shown and "keyq:***@" in shown
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    settings = load_settings(JanitorSettings, management_url="http://keyq:s3cret-pw@mq:15672")
    assert settings.describe()["management_url"] == "http://keyq:***@mq:15672"
    assert "s3cret-pw" not in repr(settings)
    with pytest.raises(ConfigurationError, match="KEYQ_MANAGEMENT_URL") as raised:
        load_settings(management_url="amqp://keyq:s3cret-pw@mq:5672")
    assert "s3cret-pw" not in str(raised.value)
    # Given in code, it is named as in code; from the environment, by its variable.
    with pytest.raises(ConfigurationError, match=r"^fd_warn_ratio: "):
        load_settings(fd_warn_ratio=1.5)


def test_status_says_unknown_without_the_api(stream: StreamFixture, producer: Producer) -> None:
    producer.publish("k", {"n": 1})
    producer.flush()
    settings = stream.settings.model_copy(update={"management_url": None, "prometheus_url": None})
    status = collect_status(settings, stream.name)
    assert status["broker"]["fd_used"] is None
    assert status["broker"]["unknown_reason"] == NOT_SET
    assert status["broker"]["source"] is None
    text = render_table(status)
    assert f"broker file descriptors unknown ({NOT_SET})" in text
    assert "WARNING" not in text


def _node_settings(rabbit: PrivateRabbit, kind: type[Settings] = Settings, **extra: Any) -> Any:
    """Settings for the private node: its rabbitmq_prometheus and its management API (the
    figures come from the first; on 4.x the second has none)."""
    urls = {"prometheus_url": rabbit.prometheus_url, "management_url": rabbit.management_url}
    options = {"fd_warn_ratio": WARN_RATIO, **urls, **extra}
    return load_settings(kind, amqp_url=rabbit.url, **options)


def _reported(settings: Settings, check: Any, what: str) -> FdUsage:
    """The usage once the API reports figures that pass ``check`` (stats lag a second)."""

    def read() -> FdUsage | None:
        usage = read_fd_usage(settings)
        return usage if usage.known and check(usage) else None

    found: FdUsage = wait_until(read, 30, what, every=0.5)
    return found


@pytest.mark.broker_versions
@pytest.mark.parametrize("source", ["prometheus", "management"])
def test_the_figures_are_the_nodes_own(source: str, private_rabbit: PrivateRabbit) -> None:
    """From rabbitmq_prometheus, or the management API; on RabbitMQ 4.x, whose management
    metrics collection is off here, the API has none, and says what to set instead."""
    other = "management_url" if source == "prometheus" else "prometheus_url"
    settings = _node_settings(private_rabbit, **{other: ""})
    if source == "management" and private_rabbit.release.rabbitmq_major >= 4:
        usage = read_fd_usage(settings)
        assert not usage.known and usage.unknown_reason == NO_FIGURES
        assert "KEYQ_PROMETHEUS_URL" in NO_FIGURES
        return
    usage = _reported(settings, lambda u: True, "fd figures")
    pid = int((private_rabbit.folder / "pid").read_text())
    open_now = len(os.listdir(f"/proc/{pid}/fd"))
    assert usage.source == source
    assert usage.node == private_rabbit.node
    assert usage.limit == NOFILE
    assert usage.used is not None and abs(usage.used - open_now) <= 10
    # The node is shared by the process's tests, which may have left many fds open: the
    # warning is asked for 40 fds above and below what it has open now.
    for margin, near in ((40, False), (-40, True)):
        ratio = min(max(open_now + margin, 1), NOFILE) / NOFILE
        measured = read_fd_usage(_node_settings(private_rabbit, fd_warn_ratio=ratio, **{other: ""}))
        assert (measured.warn_ratio, measured.near_limit) == (ratio, near), (open_now, measured)


@pytest.mark.broker_versions
def test_many_keys_bring_the_warning_to_status_and_the_janitor(
    private_rabbit: PrivateRabbit, stream: StreamFixture, caplog: pytest.LogCaptureFixture
) -> None:
    settings = _node_settings(private_rabbit, redis_url=stream.settings.redis_url)
    with Producer(stream.name, mode="key", settings=settings, publish_timeout=30) as producer:
        for n in range(KEYS):
            producer.publish(f"key-{n}", {"n": n})
        producer.flush()
    usage = _reported(settings, lambda u: u.near_limit, "fd use to pass the warning ratio")
    env = {
        "KEYQ_PROMETHEUS_URL": settings.prometheus_url or "",
        "KEYQ_MANAGEMENT_URL": settings.management_url or "",
        "KEYQ_FD_WARN_RATIO": str(settings.fd_warn_ratio),
    }
    assert usage.used is not None and usage.used >= WARN_RATIO * NOFILE

    shown = run_keyq(settings, "status", "--stream", stream.name, "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    broker = orjson.loads(shown.stdout)["broker"]
    assert broker["near_limit"] is True
    assert broker["fd_limit"] == NOFILE
    assert broker["fd_used"] >= WARN_RATIO * NOFILE
    assert broker["node"] == private_rabbit.node
    assert broker["unknown_reason"] is None
    assert broker["source"] == "prometheus"
    table = run_keyq(settings, "status", "--stream", stream.name, env=env)
    assert table.returncode == 0, table.stderr
    [warning] = [line for line in table.stdout.splitlines() if line.startswith("WARNING")]
    assert f"RabbitMQ node {private_rabbit.node} has" in warning and f"of its {NOFILE}" in warning
    assert "guest:guest" not in table.stdout + shown.stdout + table.stderr

    caplog.set_level(logging.INFO, logger="keyq.janitor")
    janitor = Janitor([stream.name], settings=_node_settings(private_rabbit, JanitorSettings))
    janitor.run(once=True)
    janitor.run(once=True)  # a second pass within the minute: no second warning
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "file descriptors open" in warnings[0], warnings
    assert janitor.stats["adopted"] == 0  # listed by the same rabbitmq_prometheus, registered
    registry = JanitorMetrics(janitor).registry
    families = {metric.name: metric for metric in registry.collect()}
    [sample] = families["keyq_janitor_broker_fd_used"].samples
    assert sample.labels["node"] == private_rabbit.node and sample.value >= WARN_RATIO * NOFILE
    assert families["keyq_janitor_broker_fd_limit"].samples[0].value == NOFILE


def test_what_a_worker_says_about_each_redis_persistence() -> None:
    level, message = judge(Persistence(aof=False, save_points="", appendfsync="everysec"))
    assert level == logging.WARNING and NO_PERSISTENCE in message and "appendonly yes" in message
    level, message = judge(Persistence(aof=False, save_points="3600 1", appendfsync="everysec"))
    assert level == logging.WARNING and "RDB snapshots only" in message
    level, message = judge(Persistence(aof=False, save_points=None, appendfsync=None))
    assert level == logging.INFO and "could not be read" in message
    level, message = judge(Persistence(aof=True, save_points="", appendfsync="always"))
    assert level == logging.INFO and "AOF, appendfsync always" in message


def _shared_redis_is_volatile(settings: Settings) -> bool:
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        aof = client.info("persistence")["aof_enabled"]
        return bool(aof == 0 and client.config_get("save").get("save") == "")
    finally:
        client.close()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if private_servers_available():
        pytest.skip(str(private_servers_available()))
    server = PrivateRedis(tmp_path / "redis").start()
    yield server
    server.stop()


def test_a_worker_warns_once_at_start_on_a_redis_without_persistence_or_rdb_only_not_aof(
    settings: Settings,
    stream: StreamFixture,
    private_redis: PrivateRedis,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Real ``keyq worker`` processes: on the shared Redis (no persistence, here) and on one
    with AOF. The line comes before Spark starts, so each is stopped once it has spoken. Then
    in-process: the shared Redis, and the private one with AOF, then with RDB only."""
    volatile = _shared_redis_is_volatile(settings)
    lines = ("Redis persistence:", NO_PERSISTENCE, "RDB snapshots only", "could not read")
    shared = WorkerProcess(settings, stream.name, tmp_path, mode="key")
    durable = WorkerProcess(
        settings,
        stream.name,
        tmp_path,
        mode="key",
        env={"KEYQ_REDIS_URL": private_redis.url},
    )
    try:
        wait_until(
            lambda: any(line in shared.log() for line in lines), 60, "the shared Redis's line"
        )
        wait_until(lambda: "Redis persistence: AOF" in durable.log(), 60, "the AOF line")
    finally:
        shared.close()
        durable.close()
    warned = [line for line in shared.log().splitlines() if NO_PERSISTENCE in line]
    assert len(warned) == (1 if volatile else 0)
    assert all(" WARNING keyq.worker " in line for line in warned)
    assert NO_PERSISTENCE not in durable.log()
    assert "RDB snapshots only" not in durable.log()

    caplog.set_level(logging.INFO, logger="keyq.worker")
    for redis_settings in (settings, load_settings(redis_url=private_redis.url)):
        client = open_redis(redis_settings)
        try:
            log_redis_persistence(client, logging.getLogger("keyq.worker"))
        finally:
            client.close()
    shared_said, private_said = _levels(caplog)
    if volatile:
        assert shared_said[0] == "WARNING" and NO_PERSISTENCE in shared_said[1], shared_said
    assert private_said == ("INFO", "Redis persistence: AOF, appendfsync always")
    client = open_redis(load_settings(redis_url=private_redis.url))
    try:
        client.config_set("appendonly", "no")  # the private server, not the shared one
        client.config_set("save", "900 1")
        log_redis_persistence(client, logging.getLogger("keyq.worker"))
        [(level, message)] = _levels(caplog)
        assert level == "WARNING" and "RDB snapshots only (save '900 1')" in message
    finally:
        client.close()
