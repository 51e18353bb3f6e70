"""The one lock over a stream's dead-letter queue, held by whatever walks it.

Two walks at once would each see only the letters the other does not hold (a letter taken by
one walk is invisible to the other until handed back), so a redrive could put a key's later
letters back ahead of an earlier one. Every command that walks the queue (``show --walk``,
drop, redrive, reindex) therefore holds ``StreamKeys.redrive_lock``: ``SET NX`` with a random
token and a ttl, renewed from a thread while the command runs, so that a killed command frees
it within one ttl. A command waiting for it tries again after growing, jittered waits.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Iterator
from types import TracebackType

import redis

from keyq.broker.backoff import Backoff
from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.broker.dead_letter_queue import DeadLetterWalk
from keyq.broker.errors import KeyqError
from keyq.broker.redis_keys import StreamKeys
from keyq.ops.context import OperatorContext

LOCK_TTL_MS = 30_000  # a lock a killed command left runs out within this
BUSY_WAIT_S = 0.05  # the first wait before trying a busy lock again
BUSY_WAIT_MAX_S = 0.5  # the longest

# KEYS[1] = lock; ARGV[1] = token, ARGV[2] = ttl ms. 1 if still ours (renewed), else 0.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS[1] = lock; ARGV[1] = token. Deletes it only if it is still ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class DeadLetterQueueBusy(KeyqError):
    """Another command held the dead-letter queue for longer than this one would wait."""


class DeadLetterLock:
    """``with DeadLetterLock(client, stream, wait_s=30):`` holds the stream's dead-letter lock."""

    def __init__(
        self, client: redis.Redis, stream: str, *, wait_s: float, ttl_ms: int | None = None
    ) -> None:
        self._client = client
        self._key = StreamKeys(stream).redrive_lock
        self._wait_s = wait_s
        self._ttl_ms = ttl_ms or LOCK_TTL_MS
        self._token = secrets.token_hex(12)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost = False

    def acquire(self) -> None:
        """Take the lock, waiting up to ``wait_s``; raises ``DeadLetterQueueBusy``."""
        deadline = time.monotonic() + self._wait_s
        backoff = Backoff(BUSY_WAIT_S, BUSY_WAIT_MAX_S)
        while not self._client.set(self._key, self._token, nx=True, px=self._ttl_ms):
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadLetterQueueBusy(
                    f"the dead-letter queue is in use by another keyq command "
                    f"(lock {self._key} still held after {self._wait_s:g} s)"
                )
            time.sleep(min(left, backoff.next()))
        self._renewer = threading.Thread(
            target=self._keep, name="keyq-dead-letter-lock", daemon=True
        )
        self._renewer.start()

    def _keep(self) -> None:
        while not self._stop.wait(self._ttl_ms / 3000):
            try:
                if not int(self._renew(keys=[self._key], args=[self._token, self._ttl_ms])):
                    self.lost = True
                    return
            except redis.exceptions.RedisError:
                continue  # tried again next round; the ttl leaves two more

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        with contextlib.suppress(redis.exceptions.RedisError):
            self._release(keys=[self._key], args=[self._token])

    def __enter__(self) -> DeadLetterLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


@contextlib.contextmanager
def locked_walk(ctx: OperatorContext, wait: float) -> Iterator[DeadLetterWalk]:
    """A walk of the stream's dead-letter queue, under its lock (one walk at a time), that
    brings the index up to date with what it meets."""
    index = DeadLetterIndex(ctx.redis, ctx.stream)
    with DeadLetterLock(ctx.redis, ctx.stream, wait_s=wait):
        started = index.clock_ms()
        with DeadLetterWalk(ctx.amqp(), ctx.config.dead_letter_queue) as walk:
            index.reconcile(walk.read(), started)
            yield walk
