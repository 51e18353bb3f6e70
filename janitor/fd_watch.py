"""The janitor's watch on the broker's file descriptors, logged on change rather than per pass.

A node near its fd limit is the one broker limit key mode runs into first (a queue per key),
and running out crashes queues, so the janitor, which runs all the time, says so: a warning
when a node reaches ``KEYQ_FD_WARN_RATIO`` of its limit, again every ``KEYQ_FD_WARN_EVERY_S``
while it stays there, one info line when it is back below. A figure that cannot be read is
mentioned once at info, as the janitor works without it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from keyq.broker.fd_usage import FdUsage, read_fd_usage
from keyq.broker.settings import Settings

log = logging.getLogger("keyq.janitor")

FD_CHECK_EVERY_S = 60.0


class FdWatch:
    """Reads the broker's fd use at most every ``check_every_s`` (``poll``) and decides what to
    log (``observe``); ``latest`` is the last reading, for metrics."""

    def __init__(
        self,
        settings: Settings,
        repeat_s: float,
        *,
        check_every_s: float = FD_CHECK_EVERY_S,
        read: Callable[[Settings], FdUsage] = read_fd_usage,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.latest: FdUsage | None = None
        self._settings = settings
        self._repeat_s = repeat_s
        self._check_every_s = check_every_s
        self._read = read
        self._clock = clock
        self._checked_at: float | None = None
        self._warned_at: float | None = None
        self._unknown_said = False

    def poll(self) -> FdUsage | None:
        """Read and judge the figures if a check is due; the latest reading."""
        now = self._clock()
        if self._checked_at is None or now - self._checked_at >= self._check_every_s:
            self._checked_at = now
            self.observe(self._read(self._settings), now)
        return self.latest

    def observe(self, usage: FdUsage, now: float) -> None:
        """Log what ``usage`` changes: crossing the threshold, a repeat, clearing, unknown."""
        self.latest = usage
        if not usage.known:
            if not self._unknown_said:
                log.info("not watching the broker's file descriptors: %s", usage.unknown_reason)
                self._unknown_said = True
            return
        self._unknown_said = False
        warning = usage.warning()
        if warning is not None:
            if self._warned_at is None or now - self._warned_at >= self._repeat_s:
                log.warning(warning)
                self._warned_at = now
        elif self._warned_at is not None:
            log.info("broker file descriptors back below the warning: %s", usage.summary())
            self._warned_at = None
