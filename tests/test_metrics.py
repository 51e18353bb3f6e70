"""The Prometheus endpoint: the HTTP server (scraped over real HTTP, read back with
prometheus_client's parser), and real scrapes of a janitor and a worker on the real
services."""

from __future__ import annotations

import errno
import logging
import socket
import threading
import urllib.error
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from keyq import Producer
from keyq.broker.metrics import Health, MetricsServer, start_first_free
from keyq.broker.settings import load_settings
from keyq.janitor.config import JanitorSettings
from keyq.janitor.janitor import Janitor
from keyq.janitor.metrics import JanitorMetrics
from keyq.worker.config import WorkerSettings
from keyq.worker.daemon import Worker
from keyq.worker.metrics import WorkerMetrics
from tests.conftest import StreamFixture
from tests.helpers import queue_depth
from tests.scrapes import Family, scrape, scrape_families
from tests.workers import wait_until

EMPTY = CollectorRegistry()

# ---- the server -----------------------------------------------------------------------------


class _Counting(Collector):
    """A collector counting its scrapes, or failing when told to."""

    def __init__(self) -> None:
        self.calls = 0
        self.broken = threading.Event()

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self.broken.is_set():
            raise RuntimeError("collector broke")
        self.calls += 1
        family = CounterMetricFamily("keyq_scrapes", "Scrapes.", labels=["n"])
        family.add_metric(["x"], self.calls)
        yield family


def test_server_serves_metrics_and_health_over_http() -> None:
    counting = _Counting()
    registry = CollectorRegistry()
    registry.register(counting)
    live, ready = threading.Event(), threading.Event()
    live.set()
    health = Health(live=live.is_set, ready=ready.is_set)
    server = MetricsServer(0, "127.0.0.1", registry=registry, health=health)
    assert server.port == 0
    with server:
        port = server.port
        assert port > 0
        assert scrape_families(port)["keyq_scrapes_total"].value(n="x") == 1
        assert scrape_families(port)["keyq_scrapes_total"].value(n="x") == 2
        assert scrape(port, "/metrics?name[]=x")[0] == 200
        assert scrape(port, "/healthz")[::2] == (200, "live\n")
        assert scrape(port, "/livez")[0] == 200
        assert scrape(port, "/readyz")[0] == 503
        ready.set()
        assert scrape(port, "/readyz")[::2] == (200, "ready\n")
        live.clear()
        assert scrape(port, "/livez")[0] == 503 and scrape(port, "/healthz")[0] == 503
        assert scrape(port, "/nothing")[0] == 404
        counting.broken.set()
        status, _type, body = scrape(port)
        assert status == 500 and "failed" in body
        counting.broken.clear()
        assert scrape(port)[0] == 200  # still serving
        with pytest.raises(RuntimeError, match="already started"):
            server.start()
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    server.stop()  # twice is fine


def test_a_taken_port_fails_at_start() -> None:
    with MetricsServer(0, "127.0.0.1", registry=EMPTY) as first, pytest.raises(OSError):
        MetricsServer(first.port, "127.0.0.1", registry=EMPTY).start()


def _listening(port: int) -> socket.socket | None:
    """A socket listening on 127.0.0.1:port, or None if something else has the port."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(1)
    except OSError:
        sock.close()
        return None
    return sock


def test_a_taken_port_moves_to_the_next_free_one_of_its_span(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with MetricsServer(0, "127.0.0.1", registry=EMPTY) as first:
        caplog.set_level(logging.WARNING, logger="keyq.metrics")
        second = start_first_free(first.port, 4, "127.0.0.1", registry=EMPTY)
        try:
            assert first.port < second.port < first.port + 4
            assert scrape(second.port, "/healthz")[::2] == (200, "live\n")
            assert f"metrics port {first.port} is taken; serving on {second.port}" in caplog.text
        finally:
            second.stop()


def test_a_span_with_every_port_taken_fails_naming_the_span() -> None:
    with MetricsServer(0, "127.0.0.1", registry=EMPTY) as first:
        # The next port is taken by this test, or by someone else: taken either way.
        blocker = _listening(first.port + 1)
        try:
            with pytest.raises(OSError, match=rf"ports {first.port}-{first.port + 1} are all"):
                start_first_free(first.port, 2, "127.0.0.1", registry=EMPTY)
            with pytest.raises(OSError, match=rf"port {first.port} is taken"):
                start_first_free(first.port, 1, "127.0.0.1", registry=EMPTY)
        finally:
            if blocker is not None:
                blocker.close()


def test_a_bind_failure_that_is_no_clash_is_not_passed_over() -> None:
    # An address this machine does not have: no port of the span could ever be bound.
    with pytest.raises(OSError) as failure:
        start_first_free(47_000, 5, "192.0.2.123", registry=EMPTY)
    assert failure.value.errno == errno.EADDRNOTAVAIL


# ---- real daemons ---------------------------------------------------------------------------

LEASE_MS = 200
GRACE_MS = 500


def test_a_janitor_scrape_counts_its_deletions(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    fast = load_settings(publish_lease_ms=LEASE_MS, retire_grace_ms=GRACE_MS)
    with Producer(stream.name, mode="key", settings=fast) as producer:
        queues = sorted({producer.publish(k, {"n": 1}).queue for k in ("a", "b", "c")})
        producer.flush(30)
    channel = amqp.channel()
    for queue in queues:
        channel.queue_purge(queue)
    channel.close()

    janitor = Janitor(
        [stream.name],
        settings=load_settings(
            JanitorSettings, idle_ttl_s=0, publish_lease_ms=LEASE_MS, retire_grace_ms=GRACE_MS
        ),
    )
    registry = JanitorMetrics(janitor).registry
    with MetricsServer(0, "127.0.0.1", registry=registry) as server:
        before = scrape_families(server.port)
        assert before["keyq_janitor_deletions_total"].value(janitor=janitor.janitor_id) == 0
        janitor.run(once=True)
        deleted = [queue for queue in queues if queue_depth(amqp, queue) is None]
        families = scrape_families(server.port)

    assert len(deleted) == 3
    labels = {"janitor": janitor.janitor_id}
    assert families["keyq_janitor_deletions_total"].value(**labels) == len(deleted)
    assert families["keyq_janitor_passes_total"].value(**labels) == 1
    skipped = families["keyq_janitor_skipped_total"]
    assert {s[1]["reason"] for s in skipped.samples} == {
        "held",
        "not_empty",
        "in_use",
        "unreachable",
        "mark_lapsed",
        "aside",
    }
    assert all(s[1]["janitor"] == janitor.janitor_id and s[2] == 0 for s in skipped.samples)
    for name in (
        "keyq_janitor_adopted_total",
        "keyq_janitor_members_pruned_total",
        "keyq_janitor_errors_total",
    ):
        assert families[name].kind == "counter"
        assert families[name].value(**labels) == 0


WORKER_COUNTERS = (
    "keyq_worker_events_processed_total",
    "keyq_worker_events_skipped_total",
    "keyq_worker_batches_total",
    "keyq_worker_spark_seconds_total",
    "keyq_worker_claims_total",
    "keyq_worker_releases_total",
    "keyq_worker_queues_lost_total",
    "keyq_worker_dead_lettered_total",
    "keyq_worker_commits_refused_total",
    "keyq_worker_peers_reaped_total",
)


def test_a_worker_scrape_counts_its_events(stream: StreamFixture, spark_engine: Any) -> None:
    with Producer(stream.name, mode="key", settings=stream.settings) as producer:
        for n in range(1, 11):
            for key in ("sensor-1", "sensor-2"):
                producer.publish(key, {"n": n, "producer": "p"})
        producer.flush(30)
    worker = Worker(
        stream.name,
        "tests.pipelines:audit",
        settings=load_settings(WorkerSettings),
        engine=spark_engine,
    )
    labels = {"stream": stream.name, "worker": worker.worker_id}

    def events(families: dict[str, Family]) -> float:
        return families["keyq_worker_events_processed_total"].value(**labels)

    runner = threading.Thread(target=worker.run, kwargs={"until_idle": 2}, daemon=True)
    registry = WorkerMetrics(worker).registry
    with MetricsServer(0, "127.0.0.1", registry=registry) as server:
        assert events(scrape_families(server.port)) == 0  # served before the worker runs
        runner.start()
        try:
            # Scraped while the worker runs, then once it stopped by itself.
            wait_until(lambda: events(scrape_families(server.port)) == 20, 60, "20 events")
            runner.join(60)
            assert not runner.is_alive()
            families = scrape_families(server.port)
        finally:
            worker.stop()
            runner.join(30)

    for name in WORKER_COUNTERS:
        assert families[name].kind == "counter", name
    assert events(families) == 20
    assert families["keyq_worker_events_skipped_total"].value(**labels) == 0
    assert families["keyq_worker_claims_total"].value(**labels) >= 2  # one queue per key
    assert families["keyq_worker_dead_lettered_total"].value(**labels) == 0
    assert families["keyq_worker_spark_seconds_total"].value(**labels) > 0
    assert families["keyq_worker_queues_held"].kind == "gauge"
    assert families["keyq_worker_queues_held"].value(**labels) == 0  # all handed back
    batches = families["keyq_worker_batches_total"].value(**labels)
    assert batches >= 1
    latency = families["keyq_worker_batch_seconds"]
    assert latency.kind == "histogram"
    assert latency.value("keyq_worker_batch_seconds_count", **labels) == batches
    assert latency.value("keyq_worker_batch_seconds_sum", **labels) > 0
    assert latency.value("keyq_worker_batch_seconds_bucket", le="+Inf", **labels) == batches
