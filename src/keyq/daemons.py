"""Running keyq's daemons from the command line: logging, signals, bounded shutdown."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from keyq.broker.connections import open_redis, redis_errors
from keyq.broker.errors import ConfigurationError
from keyq.broker.log_format import LogContext, formatter_for
from keyq.broker.metrics import Health, start_first_free
from keyq.broker.naming import check_stream_name, encode_key
from keyq.broker.settings import Settings, load_settings
from keyq.janitor.config import JanitorSettings
from keyq.janitor.janitor import Janitor
from keyq.janitor.metrics import JanitorMetrics
from keyq.worker.config import WorkerSettings
from keyq.worker.daemon import Worker
from keyq.worker.metrics import WorkerMetrics
from keyq.worker.state_store import StateStore

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


def run_worker_daemon(
    *,
    stream: str,
    pipeline: str,
    sink: str | None,
    mode: str | None,
    buckets: int | None,
    until_idle: float | None,
    worker_id: str | None,
    metrics_port: int | None,
    log_level: str,
) -> None:
    settings = load_settings(WorkerSettings, metrics_port=metrics_port)
    worker = Worker(
        stream,
        pipeline,
        sink=sink,
        mode=mode,
        buckets=buckets,
        settings=settings,
        worker_id=worker_id,
    )
    configure_logging(log_level, stream, worker.worker_id, settings.log_format)
    log = logging.getLogger("keyq.worker")
    log.info("settings: %s", settings.describe())

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if worker_stopping.is_set():
            log.warning("second signal: exiting now; unacked events go back to their queues")
            os._exit(EXIT_UNCLEAN)
        worker_stopping.set()
        log.info("signal %d: finishing the batch in flight, then handing queues back", signum)
        worker.stop()
        watchdog = threading.Timer(settings.shutdown_timeout, _give_up, args=(log,))
        watchdog.daemon = True
        watchdog.start()

    worker_stopping = threading.Event()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    metrics = WorkerMetrics(worker)
    with serve_metrics(settings, metrics.registry, metrics.health):
        worker.run(until_idle=until_idle)


def run_janitor_daemon(
    *,
    streams: tuple[str, ...],
    idle_ttl: float | None,
    once: bool,
    janitor_id: str | None,
    metrics_port: int | None,
    log_level: str,
) -> None:
    settings = load_settings(JanitorSettings, idle_ttl_s=idle_ttl, metrics_port=metrics_port)
    janitor = Janitor(streams, settings=settings, janitor_id=janitor_id)
    configure_logging(log_level, ",".join(streams) or "*", janitor.janitor_id, settings.log_format)
    log = logging.getLogger("keyq.janitor")
    log.info("settings: %s", settings.describe())

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping after the current step", signum)
        janitor.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    janitor_metrics = JanitorMetrics(janitor)
    with serve_metrics(settings, janitor_metrics.registry, janitor_metrics.health):
        janitor.run(once=once)
    log.info("janitor stopped: %s", janitor.snapshot())


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


def _give_up(log: logging.Logger) -> None:
    log.error("shutdown took longer than shutdown_timeout; exiting without waiting")
    os._exit(EXIT_UNCLEAN)


def read_state(stream: str, key: str) -> tuple[bool, Any, dict[str, Any]]:
    """(found, state, marks) of a key, straight from Redis."""
    check_stream_name(stream)
    encode_key(key)
    settings: Settings = load_settings()
    client = open_redis(settings)
    with redis_errors(settings.redis_url):
        store = StateStore(client, stream)
        raw = store.states([key]).get(key)
        marks = store.get_marks(key)
    client.close()
    value = None if raw is None else orjson.loads(raw)
    return raw is not None, value, {"producers": marks.seqs, "applied": marks.applied}
