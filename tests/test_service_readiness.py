"""``wait_for_services`` and ``keyq demo --wait-for-services`` with RabbitMQ or Redis behind a
proxy that refuses connections (as a server not yet listening does) until the test lets them."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import orjson
import pytest

from keyq.broker.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    ConfigurationError,
    RedisUnavailable,
)
from keyq.broker.settings import Settings
from keyq.ops.readiness import wait_for_services
from tests.conftest import StreamFixture
from tests.faults import FaultProxy
from tests.workers import FAST, REPO, keyq_environment, run_keyq, wait_until

PASSWORD = "guest"


def _proxy(url: str) -> FaultProxy:
    parts = urlsplit(url)
    return FaultProxy(parts.hostname or "127.0.0.1", parts.port or 5672)


@pytest.fixture
def late_broker(settings: Settings) -> Iterator[FaultProxy]:
    """RabbitMQ behind a proxy that refuses every connection until ``refuse(False)``."""
    with _proxy(settings.amqp_url) as proxy:
        proxy.refuse(True)
        yield proxy


@pytest.mark.parametrize(
    ("url", "service", "after"), [("amqp_url", "RabbitMQ", 2.0), ("redis_url", "Redis", 1.5)]
)
def test_waits_for_a_service_that_comes_up_late(
    settings: Settings, url: str, service: str, after: float
) -> None:
    with _proxy(getattr(settings, url)) as proxy:
        proxy.refuse(True)
        late = settings.model_copy(update={url: proxy.url_for(getattr(settings, url))})
        said: list[str] = []
        threading.Timer(after, proxy.refuse, args=(False,)).start()
        waited = wait_for_services(late, 30, say=said.append)
    assert after - 0.2 <= waited < 15, waited
    assert len(said) == 1, said
    assert said[0].startswith(f"waiting up to 30 s for {service}: cannot reach {service}"), said
    assert f":{PASSWORD}@" not in said[0]


def test_a_broker_still_down_when_the_time_is_up_fails_naming_the_wait(
    settings: Settings, late_broker: FaultProxy
) -> None:
    late = settings.model_copy(update={"amqp_url": late_broker.url_for(settings.amqp_url)})
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable, match=r"cannot reach RabbitMQ .*\(waited 2 s\)"):
        wait_for_services(late, 2)
    assert 1.9 <= time.monotonic() - started < 10
    with pytest.raises(RedisUnavailable):  # 0: the first failure is final
        wait_for_services(settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"}), 0)


def test_refused_credentials_and_a_wait_that_is_no_duration_are_not_waited_out(
    settings: Settings,
) -> None:
    for timeout in (float("nan"), -1.0):
        with pytest.raises(ConfigurationError, match="0 s or more"):
            wait_for_services(settings, timeout)
    wrong = settings.amqp_url.replace(f"guest:{PASSWORD}@", "guest:not-the-password@")
    assert wrong != settings.amqp_url
    started = time.monotonic()
    with pytest.raises(AuthenticationFailed) as failure:
        wait_for_services(settings.model_copy(update={"amqp_url": wrong}), 60)
    assert time.monotonic() - started < 10
    assert "not-the-password" not in str(failure.value)


def test_the_demo_fails_clearly_when_the_broker_never_comes(
    settings: Settings, late_broker: FaultProxy
) -> None:
    started = time.monotonic()
    done = run_keyq(
        settings,
        *("demo", "--external-workers", "--wait-for-services", "2"),
        env={"KEYQ_AMQP_URL": late_broker.url_for(settings.amqp_url)},
        timeout=60,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert 1.9 <= time.monotonic() - started < 30
    assert "waiting up to 2 s for RabbitMQ" in done.stderr
    assert "cannot reach RabbitMQ" in done.stderr and "(waited 2 s)" in done.stderr
    assert "Traceback" not in done.stderr
    assert f":{PASSWORD}@" not in done.stderr + done.stdout


@pytest.mark.slow
def test_the_demo_waits_for_a_broker_that_comes_up_late_and_then_runs_clean(
    stream: StreamFixture, late_broker: FaultProxy, tmp_path: Path
) -> None:
    """The compose start-up race: the demo starts before RabbitMQ accepts connections (its
    workers and janitor, started after the wait, go through the proxy too)."""
    environment = keyq_environment(stream.settings, FAST)
    environment["KEYQ_AMQP_URL"] = late_broker.url_for(stream.settings.amqp_url)
    errors = tmp_path / "demo.err"
    with errors.open("w") as stderr:
        demo = subprocess.Popen(
            [
                *(sys.executable, "-m", "keyq", "demo", "--stream", stream.name),
                *("--workers", "1", "--orders", "20", "--events", "300"),
                *("--wait-for-services", "60", "--timeout", "120", "--json"),
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=environment,
            cwd=REPO,
        )
        try:
            wait_until(lambda: "waiting up to 60 s for RabbitMQ" in errors.read_text(), 30, "wait")
            time.sleep(3)  # still refused: the demo keeps waiting, it does not exit
            assert demo.poll() is None, errors.read_text()[-2000:]
            late_broker.refuse(False)
            out, _ = demo.communicate(timeout=240)
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.wait()
    assert demo.returncode == 0, errors.read_text()[-3000:]
    summary = orjson.loads(out)
    assert summary["verdict"]["ok"] is True
    assert summary["events"] == 300
    assert "RabbitMQ and Redis accept connections (waited" in errors.read_text()
