"""Trace context from the request that published an event to the batch that applied it
(``keyq[otel]``): ``publish`` injects the caller's span context, and the worker's batch span
links to each event's context, with child spans for the Spark job, the commit and the ack.
Checked with the OpenTelemetry SDK's in-memory exporter, in one process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from keyq import Producer, Worker
from keyq.broker.settings import load_settings
from keyq.worker.batch.state_store import StateStore
from keyq.worker.config import WorkerSettings
from keyq.worker.spark.engine import SparkEngine
from tests.conftest import StreamFixture
from tests.workers import wait_until

# One process runs the file: OpenTelemetry allows one tracer provider a process.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tracing")]


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    found = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(found))
    trace.set_tracer_provider(provider)
    yield found
    provider.shutdown()


def test_a_published_events_trace_is_linked_from_the_batch_that_applied_it(
    stream: StreamFixture,
    producer: Producer,
    spark_engine: SparkEngine,
    exporter: InMemorySpanExporter,
) -> None:
    with trace.get_tracer("test-app").start_as_current_span("POST /orders") as request:
        producer.publish("traced-key", {"n": 1, "producer": "p"})
        request_trace = request.get_span_context().trace_id
    producer.publish("traced-key", {"n": 2, "producer": "p"})  # outside any span
    producer.flush(timeout=20)

    settings = load_settings(WorkerSettings, batch_max_ms=200)
    worker = Worker(
        stream.name, "tests.pipelines:audit", mode="key", settings=settings, engine=spark_engine
    )
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            worker.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            failure.append(exc)

    thread = threading.Thread(target=serve, name="test-traced-worker", daemon=True)
    thread.start()
    try:
        store = StateStore(stream.redis, stream.name)
        wait_until(lambda: (store.get("traced-key") or {}).get("applied") == 2, 60, "both applied")
    finally:
        worker.stop()
        thread.join(30)
    assert not failure, failure

    spans = exporter.get_finished_spans()
    batches = [s for s in spans if s.name == f"process {stream.name}"]
    linked = [s for s in batches if any(link.context.trace_id == request_trace for link in s.links)]
    assert linked, [(s.name, s.links) for s in batches]
    batch = linked[0]
    attributes: Any = batch.attributes
    assert attributes["messaging.system"] == "rabbitmq"
    assert attributes["messaging.batch.message_count"] == 2
    assert len(batch.links) == 1  # the event published outside a span has no context
    children = {s.name for s in spans if s.parent and s.parent.span_id == batch.context.span_id}
    assert {"spark", "commit", "ack"} <= children
