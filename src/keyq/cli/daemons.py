"""``keyq worker`` and ``keyq janitor`` as daemons: logging, the metrics endpoint, signals and
the bounded shutdown. The worker's modules are imported only when a worker runs, so the
janitor never imports Spark."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from prometheus_client import CollectorRegistry

from keyq.broker.errors import ConfigurationError
from keyq.broker.metrics import Health, start_first_free
from keyq.broker.settings import Settings, load_settings
from keyq.cli.log_format import LogContext, formatter_for
from keyq.janitor.config import JanitorSettings
from keyq.janitor.janitor import Janitor
from keyq.janitor.metrics import JanitorMetrics

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


class StopSignals:
    """SIGTERM and SIGINT caught from a daemon's first line: a supervisor may stop a daemon
    while it still imports Spark or connects, and that is a clean stop, not a death by signal.
    A signal that came before :meth:`hand_to` is passed on as soon as the handler is there."""

    def __init__(self) -> None:
        self._early: int | None = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._remember)

    def _remember(self, signum: int, _frame: FrameType | None) -> None:
        self._early = signum

    def hand_to(self, handler: Callable[[int, FrameType | None], None]) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, handler)
        if self._early is not None:
            handler(self._early, None)


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
    """Run a Worker until SIGTERM or Ctrl-C, which finish the batch in flight (a second
    signal exits at once). Imports Spark."""
    signals = StopSignals()
    from keyq.worker.config import WorkerSettings  # noqa: PLC0415 - Spark for workers only
    from keyq.worker.daemon import Worker  # noqa: PLC0415
    from keyq.worker.heap import settle_heap  # noqa: PLC0415
    from keyq.worker.metrics import WorkerMetrics  # noqa: PLC0415

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
        watchdog = threading.Timer(settings.shutdown_timeout, give_up, args=(log,))
        watchdog.daemon = True
        watchdog.start()

    worker_stopping = threading.Event()
    signals.hand_to(on_signal)
    metrics = WorkerMetrics(worker)
    settle_heap()  # what it has imported (pyspark, py4j, pyarrow) stays out of collections
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
    """Run a Janitor until SIGTERM or Ctrl-C, which stop it after its current step."""
    signals = StopSignals()
    settings = load_settings(JanitorSettings, idle_ttl_s=idle_ttl, metrics_port=metrics_port)
    janitor = Janitor(streams, settings=settings, janitor_id=janitor_id)
    configure_logging(log_level, ",".join(streams) or "*", janitor.janitor_id, settings.log_format)
    log = logging.getLogger("keyq.janitor")
    log.info("settings: %s", settings.describe())

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping after the current step", signum)
        janitor.stop()

    signals.hand_to(on_signal)
    janitor_metrics = JanitorMetrics(janitor)
    with serve_metrics(settings, janitor_metrics.registry, janitor_metrics.health):
        janitor.run(once=once)
    log.info("janitor stopped: %s", janitor.snapshot())
