"""One event's confirmation: what ``Receipt.wait`` and an awaited asyncio receipt wait for.

The I/O thread marks it published once RabbitMQ confirmed the event and did not return it (a
returned or refused event is sent again first, under the same confirmation). Waiting goes
through the confirm window, which also tells a producer's failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from keyq.producer.window import ConfirmWindow


class Confirmation:
    """Whether one event is published; a callback may be told when it is."""

    __slots__ = ("_on_published", "_window", "message_id", "published")

    def __init__(self, window: ConfirmWindow, message_id: str) -> None:
        self._window = window
        self.message_id = message_id
        self.published = False
        self._on_published: Callable[[], None] | None = None

    # ------------------------------------------------------------------- I/O thread
    def confirm(self) -> None:
        """Published. Set before the window counts it settled (and wakes its waiters)."""
        self.published = True
        callback = self._on_published
        if callback is not None:
            callback()

    # ----------------------------------------------------------- application threads
    def wait(self, timeout: float | None) -> None:
        """Block until published; raise ``ProducerClosed`` if the producer failed or was
        closed first, ``PublishTimeout`` after ``timeout`` seconds."""
        self._window.wait_confirmed(self, timeout)

    def on_published(self, callback: Callable[[], None]) -> None:
        """Have ``callback`` called once published: by the I/O thread, or at once if it is
        already. It may be called twice when the two meet, so it must be idempotent."""
        self._on_published = callback
        if self.published:
            callback()

    def failure(self) -> BaseException | None:
        """Why this event will never be published, if the producer failed or closed first."""
        return None if self.published else self._window.failure_for(self.message_id)
