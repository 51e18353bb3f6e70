"""Real daemons scraped: the batch histogram counts every batch (past the 1,000 a window
once held), and every keyq metric the deploy/ alert rules and dashboard use is exported."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pika

from keyq import Producer
from keyq.broker.envelope import HEADER_KEY, HEADER_PRODUCER, HEADER_PUBLISHED_AT, HEADER_SEQ
from keyq.broker.settings import Settings
from tests.conftest import StreamFixture
from tests.helpers import queue_depth
from tests.scrapes import sample_names, scrape_families
from tests.servers import free_port
from tests.workers import REPO, JanitorProcess, wait_until

RULES = REPO / "deploy" / "prometheus" / "keyq-alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "keyq-dashboard.json"
COPIES = 1100  # batches of one event each: more than the 1,000 durations a window kept
METRIC_NAME = re.compile(r"\bkeyq_[a-z0-9_]+")
# Exported only when the janitor can read the broker's fds (KEYQ_PROMETHEUS_URL or
# KEYQ_MANAGEMENT_URL); checked against the janitor's own table when not set.
BROKER_FDS = {"keyq_janitor_broker_fd_used", "keyq_janitor_broker_fd_limit"}


def _metrics_env(port: int) -> dict[str, str]:
    return {"KEYQ_METRICS_PORT": str(port), "KEYQ_METRICS_HOST": "127.0.0.1"}


def _publish_copies(settings: Settings, queue: str, copies: int) -> None:
    """``copies`` of one event (same producer and seq): the first is applied, the rest are
    duplicates, each still a batch of its own with a commit and an ack, but no Spark job."""
    connection = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        headers = {
            HEADER_KEY: "k-dup",
            HEADER_PRODUCER: "p-dup",
            HEADER_SEQ: 1,
            HEADER_PUBLISHED_AT: int(time.time() * 1000),
        }
        properties = pika.BasicProperties(headers=headers, delivery_mode=2)
        for _ in range(copies):
            channel.basic_publish("", queue, b'{"n": 1, "producer": "p-dup"}', properties)
    finally:
        connection.close()


def test_the_batch_histogram_counts_every_batch_past_a_thousand(
    settings: Settings, stream: StreamFixture, producer: Producer, workers: Any
) -> None:
    queue = producer.publish("k-dup", {"n": 1, "producer": "sdk"}).queue
    producer.flush(30)
    _publish_copies(settings, queue, COPIES)
    port = free_port()
    workers(
        stream.name,
        env={**_metrics_env(port), "KEYQ_BATCH_MAX_EVENTS": "1", "KEYQ_BATCH_MAX_MS": "0"},
    ).wait_ready()
    amqp = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    try:
        wait_until(lambda: queue_depth(amqp, queue) == 0, 90, "the copies to be consumed")
    finally:
        amqp.close()
    labels = {"stream": stream.name}

    def batches() -> float:
        return scrape_families(port)["keyq_worker_batches_total"].value(**labels)

    # Scraped only once the load is through: no scrape in between caught batches up.
    wait_until(lambda: batches() >= COPIES + 1, 60, "every copy's batch")
    families = scrape_families(port)
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


def _rule_expressions() -> list[str]:
    import yaml

    rules = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def _dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        if isinstance(query, dict):
            found.append(query["query"])
    return found


def test_every_metric_the_rules_and_dashboard_use_is_exported(
    settings: Settings, stream: StreamFixture, producer: Producer, workers: Any, tmp_path: Path
) -> None:
    producer.publish("k-1", {"n": 1, "producer": "p"})
    producer.flush(30)
    worker_port, janitor_port = free_port(), free_port()
    workers(stream.name, env=_metrics_env(worker_port)).wait_ready()
    janitor = JanitorProcess(
        settings, tmp_path, "--stream", stream.name, env=_metrics_env(janitor_port)
    )
    try:

        def janitor_measured() -> bool:
            try:
                names = sample_names(janitor_port)
                return {"keyq_stream_live_workers", "keyq_stream_stranded_keys"} <= names
            except OSError:
                return False

        wait_until(janitor_measured, 60, "the janitor's stream gauges")
        exported = sample_names(worker_port) | sample_names(janitor_port)
    finally:
        janitor.terminate()
        janitor.close()
    expressions = _rule_expressions() + _dashboard_expressions()
    used = {name for expr in expressions for name in METRIC_NAME.findall(expr)}
    assert len(used) >= 10, used
    if not (settings.prometheus_url or settings.management_url):
        assert used >= BROKER_FDS
        used -= BROKER_FDS
    missing = sorted(used - exported)
    assert not missing, f"used by deploy/ but not exported: {missing}"
    assert {"keyq_stream_dead_letters", "keyq_stream_oldest_event_age_seconds"} <= exported
