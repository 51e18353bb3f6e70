"""``keyq janitor`` as a daemon: a Janitor with its metrics endpoint, stopped by SIGTERM or
Ctrl-C after its current step. Needs no Spark."""

from __future__ import annotations

import logging
import signal
from types import FrameType

from keyq.broker.settings import load_settings
from keyq.daemons import configure_logging, serve_metrics
from keyq.janitor.config import JanitorSettings
from keyq.janitor.janitor import Janitor
from keyq.janitor.metrics import JanitorMetrics


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
