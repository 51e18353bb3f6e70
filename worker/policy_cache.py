"""The stream's operator policy (``keyq.broker.stream_policy``) as the worker sees it: read
from Redis at most once a second, so that every batch and tick can ask for it, and a change
an operator makes takes effect within a second without a restart. A read that fails keeps
the last policy seen."""

from __future__ import annotations

import logging
import threading
import time

import redis

from keyq.broker.stream_policy import StreamPolicies, StreamPolicy

log = logging.getLogger("keyq.worker")

MAX_AGE_S = 1.0


class PolicyCache:
    """Safe from any thread."""

    def __init__(self, policies: StreamPolicies, max_age_s: float = MAX_AGE_S) -> None:
        self._policies = policies
        self._max_age_s = max_age_s
        self._lock = threading.Lock()
        self._policy = StreamPolicy()
        self._read_at: float | None = None

    def __call__(self) -> StreamPolicy:
        with self._lock:
            now = time.monotonic()
            if self._read_at is None or now - self._read_at >= self._max_age_s:
                try:
                    self._policy = self._policies.load()
                except (redis.exceptions.RedisError, OSError) as exc:
                    log.debug("reading the stream policy failed (kept the last): %s", exc)
                self._read_at = now
            return self._policy
