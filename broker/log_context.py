"""The queue a log line is about, for structured logs: set by whoever works on queues, read by
the log formatter of the daemons (``queue=-`` when a line is about no queue in particular)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

current_queue: ContextVar[str] = ContextVar("keyq_queue", default="-")


@contextmanager
def about_queues(queues: Sequence[str]) -> Iterator[None]:
    """Log lines inside the block name these queues (the first, and how many more)."""
    names = list(dict.fromkeys(queues))
    label = "-" if not names else names[0] + (f"+{len(names) - 1}" if len(names) > 1 else "")
    token = current_queue.set(label)
    try:
        yield
    finally:
        current_queue.reset(token)
