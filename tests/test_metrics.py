"""The Prometheus endpoint: the HTTP server (scraped over real HTTP, read back with
prometheus_client's parser), and real scrapes of workers and janitors (an in-process one's in
tests/test_janitor.py): the batch histogram counts every batch (past the 1,000 a window once
held), and every keyq metric the deploy/ alert rules and dashboard use is exported."""

from __future__ import annotations

import errno
import json
import logging
import re
import socket
import threading
import time
import urllib.error
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import orjson
import pika
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from keyq import Producer
from keyq.broker.envelope import HEADER_KEY, HEADER_PRODUCER, HEADER_PUBLISHED_AT, HEADER_SEQ
from keyq.broker.metrics import Health, MetricsServer, start_first_free
from keyq.broker.settings import Settings, load_settings
from keyq.worker.config import WorkerSettings
from keyq.worker.daemon import Worker
from keyq.worker.metrics import WorkerMetrics
from tests.conftest import StreamFixture
from tests.helpers import queue_depth
from tests.scrapes import Family, scrape, scrape_families
from tests.servers import free_port
from tests.workers import REPO, JanitorProcess, run_keyq, wait_until

EMPTY = CollectorRegistry()


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


def test_a_taken_port_fails_or_moves_to_the_next_free_one_of_its_span_and_no_other_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with MetricsServer(0, "127.0.0.1", registry=EMPTY) as first:
        with pytest.raises(OSError):
            MetricsServer(first.port, "127.0.0.1", registry=EMPTY).start()
        # The next port is taken by this test, or by someone else: taken either way.
        blocker = socket.socket()
        try:
            with suppress(OSError):
                blocker.bind(("127.0.0.1", first.port + 1))
                blocker.listen(1)
            with pytest.raises(OSError, match=rf"ports {first.port}-{first.port + 1} are all"):
                start_first_free(first.port, 2, "127.0.0.1", registry=EMPTY)
            with pytest.raises(OSError, match=rf"port {first.port} is taken"):
                start_first_free(first.port, 1, "127.0.0.1", registry=EMPTY)
        finally:
            blocker.close()
        caplog.set_level(logging.WARNING, logger="keyq.metrics")
        second = start_first_free(first.port, 4, "127.0.0.1", registry=EMPTY)
        try:
            assert first.port < second.port < first.port + 4
            assert scrape(second.port, "/healthz")[::2] == (200, "live\n")
            assert f"metrics port {first.port} is taken; serving on {second.port}" in caplog.text
        finally:
            second.stop()
    # A bind failure that is no clash is not passed over: an address this machine does not
    # have, where no port of the span could ever be bound.
    with pytest.raises(OSError) as failure:
        start_first_free(47_000, 5, "192.0.2.123", registry=EMPTY)
    assert failure.value.errno == errno.EADDRNOTAVAIL


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


def test_a_worker_scrape_counts_its_events(
    stream: StreamFixture, producer: Producer, spark_engine: Any
) -> None:
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


RULES = REPO / "deploy" / "prometheus" / "keyq-alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "keyq-dashboard.json"
COPIES = 1100  # batches of one event each: more than the 1,000 durations a window kept
METRIC_NAME = re.compile(r"\bkeyq_[a-z0-9_]+")
# Exported only when the janitor can read the broker's fds (KEYQ_PROMETHEUS_URL or
# KEYQ_MANAGEMENT_URL); checked against the janitor's own table when not set.
BROKER_FDS = {"keyq_janitor_broker_fd_used", "keyq_janitor_broker_fd_limit"}


def _publish_copies(amqp: pika.BlockingConnection, queue: str, copies: int) -> None:
    """``copies`` of one event (same producer and seq): the first is applied, the rest are
    duplicates, each still a batch of its own with a commit and an ack, but no Spark job."""
    channel = amqp.channel()
    channel.confirm_delivery()
    published_at = int(time.time() * 1000)
    headers = {HEADER_KEY: "k-dup", HEADER_PRODUCER: "p-dup", HEADER_SEQ: 1}
    properties = pika.BasicProperties(
        headers={**headers, HEADER_PUBLISHED_AT: published_at}, delivery_mode=2
    )
    for _ in range(copies):
        channel.basic_publish("", queue, b'{"n": 1, "producer": "p-dup"}', properties)
    channel.close()


def _deploy_expressions() -> list[str]:
    """Every PromQL expression of the alert rules and the dashboard (its variables too)."""
    import yaml

    rules = yaml.safe_load(RULES.read_text())
    found = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    dashboard = json.loads(DASHBOARD.read_text())
    found += [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        if isinstance(query, dict):
            found.append(query["query"])
    return found


def _sample_names(families: dict[str, Family]) -> set[str]:
    return {sample for family in families.values() for sample, _l, _v in family.samples}


def test_worker_and_janitor_processes_export_what_deploy_uses_and_count_every_batch(
    settings: Settings,
    stream: StreamFixture,
    producer: Producer,
    workers: Any,
    amqp: pika.BlockingConnection,
    tmp_path: Path,
) -> None:
    """A worker making a batch of each event is scraped once over 1,000 are through (no scrape
    in between caught batches up); ``keyq status`` shows the host and pid it writes on each
    heartbeat. A janitor run with ``--metrics-port 0`` binds a free port itself (no window in
    which another process could take one the test picked) and logs it."""
    queue = producer.publish("k-dup", {"n": 1, "producer": "sdk"}).queue
    producer.flush(30)
    _publish_copies(amqp, queue, COPIES)
    port = free_port()
    env = {"KEYQ_METRICS_PORT": str(port), "KEYQ_METRICS_HOST": "127.0.0.1"}
    worker = workers(
        stream.name, env={**env, "KEYQ_BATCH_MAX_EVENTS": "1", "KEYQ_BATCH_MAX_MS": "0"}
    ).wait_ready()
    done = run_keyq(settings, "status", "--stream", stream.name, "--json")
    assert done.returncode == 0, done.stderr
    [row] = orjson.loads(done.stdout)["workers"]
    host = socket.gethostname()
    shown = (row["worker"], row["host"], row["pid"], row["ready"])
    assert shown == (worker.worker_id, host, worker.pid, True)
    table = run_keyq(settings, "status", "--stream", stream.name).stdout
    assert f"{host}:{worker.pid}" in table and "-:-" not in table
    janitor = JanitorProcess(
        settings,
        tmp_path,
        "--stream",
        stream.name,
        "--metrics-port",
        "0",
        env={"KEYQ_METRICS_HOST": "127.0.0.1", "KEYQ_JANITOR_INTERVAL_S": "0.2"},
    )
    try:
        bound = wait_until(
            lambda: re.search(r"metrics on http://[^:]+:(\d+)/metrics", janitor.log()),
            30,
            "the janitor's metrics port",
        )
        janitor_port = int(bound.group(1))

        def janitor_measured() -> dict[str, Family] | None:
            """The janitor's families once it measured the stream; served (as 0) before its
            first pass, so a pass is waited for, not a name."""
            try:
                families = scrape_families(janitor_port)
            except OSError:
                return None
            gauges = {"keyq_stream_live_workers", "keyq_stream_stranded_keys"}
            passes = families["keyq_janitor_passes_total"].samples
            measured = gauges <= _sample_names(families) and passes and passes[0][2] >= 1
            return families if measured else None

        janitor_families = wait_until(janitor_measured, 60, "a janitor pass and its gauges")
        for family in ("passes", "deletions", "skipped", "errors"):
            assert janitor_families[f"keyq_janitor_{family}_total"].kind == "counter", family
        wait_until(lambda: queue_depth(amqp, queue) == 0, 90, "the copies to be consumed")
        labels = {"stream": stream.name}

        def batches() -> float:
            return scrape_families(port)["keyq_worker_batches_total"].value(**labels)

        wait_until(lambda: batches() >= COPIES + 1, 60, "every copy's batch")
        families = scrape_families(port)
        exported = _sample_names(families) | _sample_names(scrape_families(janitor_port))
    finally:
        assert janitor.terminate(60) == 0
        janitor.close()
    total = families["keyq_worker_batches_total"].value(**labels)
    histogram = families["keyq_worker_batch_seconds"]
    assert total > 1000
    assert histogram.value("keyq_worker_batch_seconds_count", **labels) == total
    assert histogram.value("keyq_worker_batch_seconds_bucket", le="+Inf", **labels) == total
    end_to_end = families["keyq_worker_end_to_end_seconds"]
    applied = families["keyq_worker_events_processed_total"].value(**labels)
    assert applied == 2  # the SDK's event and the first copy; the rest were duplicates
    assert end_to_end.value("keyq_worker_end_to_end_seconds_count", **labels) == applied
    assert end_to_end.value("keyq_worker_end_to_end_seconds_sum", **labels) > 0

    used = {name for expr in _deploy_expressions() for name in METRIC_NAME.findall(expr)}
    assert len(used) >= 10, used
    if not (settings.prometheus_url or settings.management_url):
        assert used >= BROKER_FDS
        used -= BROKER_FDS
    missing = sorted(used - exported)
    assert not missing, f"used by deploy/ but not exported: {missing}"
    assert {"keyq_stream_dead_letters", "keyq_stream_oldest_event_age_seconds"} <= exported
