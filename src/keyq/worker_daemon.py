"""``keyq worker`` as a daemon: a Worker with its metrics endpoint, stopped by SIGTERM or
Ctrl-C after the batch in flight (a second signal exits at once). Imports Spark."""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType

from keyq.broker.settings import load_settings
from keyq.daemons import EXIT_UNCLEAN, configure_logging, give_up, serve_metrics
from keyq.worker.config import WorkerSettings
from keyq.worker.daemon import Worker
from keyq.worker.metrics import WorkerMetrics


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
        watchdog = threading.Timer(settings.shutdown_timeout, give_up, args=(log,))
        watchdog.daemon = True
        watchdog.start()

    worker_stopping = threading.Event()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    metrics = WorkerMetrics(worker)
    with serve_metrics(settings, metrics.registry, metrics.health):
        worker.run(until_idle=until_idle)
