"""W3C trace context across a stream, when OpenTelemetry is installed (``keyq[otel]``):
``publish`` injects the caller's current span context into the event's headers
(``traceparent``, ``tracestate``), and the worker links each batch's span to the contexts of
its events (OpenTelemetry's messaging conventions for batches: one process span, a link per
message). Without OpenTelemetry every function here does nothing, at the cost of one failed
import, once."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

from keyq.broker.text import as_text

TRACE_HEADERS = ("traceparent", "tracestate")


@functools.cache
def _otel() -> tuple[Any, Any] | None:
    """OpenTelemetry's ``propagate`` and ``trace`` modules, if it is installed."""
    try:
        return (
            importlib.import_module("opentelemetry.propagate"),
            importlib.import_module("opentelemetry.trace"),
        )
    except ImportError:
        return None


def inject_trace_context(headers: MutableMapping[str, Any]) -> None:
    """Put the current span's context into ``headers``, unless the caller set one."""
    otel = _otel()
    if otel is None or any(name in headers for name in TRACE_HEADERS):
        return
    propagate, _trace = otel
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    headers.update({name: value for name, value in carrier.items() if name in TRACE_HEADERS})


def span_contexts(carriers: Iterable[Mapping[str, Any]]) -> list[Any]:
    """The valid span contexts found in ``carriers`` (events' headers), for span links."""
    otel = _otel()
    if otel is None:
        return []
    propagate, trace = otel
    found = []
    for headers in carriers:
        if "traceparent" not in headers:
            continue
        carrier = {name: as_text(headers[name]) for name in TRACE_HEADERS if name in headers}
        context = trace.get_current_span(propagate.extract(carrier)).get_span_context()
        if context.is_valid:
            found.append(context)
    return found


def tracer(name: str) -> Any | None:
    otel = _otel()
    return None if otel is None else otel[1].get_tracer(name)


def trace_api() -> Any | None:
    """OpenTelemetry's ``trace`` module (``Link``, ``SpanKind``…), if it is installed."""
    otel = _otel()
    return None if otel is None else otel[1]
