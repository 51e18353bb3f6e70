"""What keyq's daemons share when run from the command line: logging, the metrics endpoint
and the bounded shutdown. Each daemon's runner is its own module (``keyq.worker_daemon``,
``keyq.janitor_daemon``), so the janitor's never imports Spark."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry

from keyq.broker.errors import ConfigurationError
from keyq.broker.log_format import LogContext, formatter_for
from keyq.broker.metrics import Health, start_first_free
from keyq.broker.settings import Settings

EXIT_UNCLEAN = 1


def configure_logging(level: str, stream: str, worker: str, log_format: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(formatter_for(log_format))
    handler.addFilter(LogContext(stream, worker))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("py4j").setLevel(logging.WARNING)
    # keyq turns every pika failure into one line of its own (a refused exclusive consume, a
    # vanished queue and a lost connection are routine for a worker); pika's own records
    # would repeat them with tracebacks.
    logging.getLogger("pika").setLevel(logging.CRITICAL)


@contextmanager
def serve_metrics(
    settings: Settings, registry: CollectorRegistry, health: Health
) -> Iterator[None]:
    """The Prometheus endpoint and health probes while the daemon runs, if a metrics port
    is set."""
    if settings.metrics_port is None:
        yield
        return
    try:
        server = start_first_free(
            settings.metrics_port,
            settings.metrics_port_span,
            settings.metrics_host,
            registry=registry,
            health=health,
        )
    except OSError as exc:
        raise ConfigurationError(
            f"cannot serve metrics (KEYQ_METRICS_PORT={settings.metrics_port}, "
            f"KEYQ_METRICS_PORT_SPAN={settings.metrics_port_span}): {exc.strerror or exc}"
        ) from None
    try:
        yield
    finally:
        server.stop()


def give_up(log: logging.Logger) -> None:
    """Exit at once: a graceful shutdown overran its time."""
    log.error("shutdown took longer than shutdown_timeout; exiting without waiting")
    os._exit(EXIT_UNCLEAN)
