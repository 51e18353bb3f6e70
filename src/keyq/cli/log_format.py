"""The daemons' log lines: text for people, or one JSON object per line for log collectors
(``KEYQ_LOG_FORMAT=json``), both with the stream, worker and queue a line is about."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import orjson

from keyq.broker.log_context import current_queue

TEXT_FORMAT = (
    "%(asctime)s %(levelname)s %(name)s stream=%(stream)s worker=%(worker)s "
    "queue=%(queue)s %(message)s"
)


class LogContext(logging.Filter):
    """Stamps every log line with the stream and the worker it is about, and the queue."""

    def __init__(self, stream: str, worker: str) -> None:
        super().__init__()
        self.stream = stream
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        record.stream = self.stream
        record.worker = self.worker
        record.queue = current_queue.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``time`` (ISO 8601, UTC, milliseconds),
    ``level``, ``logger``, ``message``, the context of ``LogContext``, and ``exception``
    (the traceback as text) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in ("stream", "worker", "queue"):
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(line, default=str).decode()


def formatter_for(log_format: str) -> logging.Formatter:
    """The formatter of ``KEYQ_LOG_FORMAT``: ``json``, or text lines."""
    return JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
