"""Wake-ups from the producer's threads onto an asyncio event loop.

The I/O thread settles confirms many times a second; an asyncio producer only needs to hear
that something changed, once per turn of its loop. ``LoopWaker.poke`` may be called from any
thread (with the confirm window's lock held, so it never blocks): it schedules one call of the
loop-side callback unless one is already pending.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


class LoopWaker:
    """Coalesces pokes from other threads into one callback on ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_wake: Callable[[], None]) -> None:
        self._loop = loop
        self._on_wake = on_wake
        self._pending = False

    def poke(self) -> None:
        """From any thread: run ``on_wake`` on the loop soon (once for many pokes)."""
        if self._pending:
            return
        self._pending = True
        # A loop closed under a producer it never closed: nobody is left to wake.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        self._pending = False  # cleared first: a change from now on pokes again
        self._on_wake()


def resolve(future: asyncio.Future[None]) -> None:
    """On the loop: end a waiter's future unless it already ended (or was cancelled)."""
    if not future.done():
        future.set_result(None)


def resolve_from_thread(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    """From any thread: ``resolve`` on the loop; nothing if the loop is closed."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(resolve, future)
