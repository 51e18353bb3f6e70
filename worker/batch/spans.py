"""The spans of a batch, when OpenTelemetry is installed (``keyq.broker.tracing``): one
``process`` span per attempt that commits, linked to each event's trace context, with child
spans for the Spark job, the commit and the ack. Without OpenTelemetry, nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from keyq.broker.tracing import span_contexts, trace_api, tracer
from keyq.worker.amqp.deliveries import Delivery

MAX_LINKS = 128  # OpenTelemetry's default span link limit


class BatchSpans:
    """Opens a batch's spans; used only by the batch loop's thread."""

    def __init__(self, stream: str) -> None:
        self._stream = stream
        self._tracer = tracer("keyq.worker")

    @contextlib.contextmanager
    def batch(self, batch_id: str, deliveries: Sequence[Delivery]) -> Iterator[None]:
        api = trace_api()
        if self._tracer is None or api is None:
            yield
            return
        contexts = span_contexts(d.headers for d in deliveries)[:MAX_LINKS]
        attributes = {
            "messaging.system": "rabbitmq",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": self._stream,
            "messaging.batch.message_count": len(deliveries),
            "keyq.batch.id": batch_id,
        }
        with self._tracer.start_as_current_span(
            f"process {self._stream}",
            kind=api.SpanKind.CONSUMER,
            links=[api.Link(context) for context in contexts],
            attributes=attributes,
        ):
            yield

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[Any]:
        """A child span of the batch's (``spark``, ``commit``, ``ack``)."""
        if self._tracer is None:
            yield None
            return
        with self._tracer.start_as_current_span(name) as span:
            yield span
