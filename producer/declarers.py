"""New keys' queues declared over several channels at once.

RabbitMQ creates a queue inside the channel process that asked for it, one declaration at a
time per channel: new keys declared on the publishing channel alone were bounded by one
channel's pace (about 400 queues/s here, against about 650/s over four connections). A few
channels of their own, used in turn, let the broker create queues side by side, while the
publishing channel goes on with keys that already have a queue. A key's events wait until
its queue's declaration is answered, so none reaches the queue before it exists.

A declaration can go unanswered (a queue whose process is stuck): the declarations behind it
on its channel would wait too, so a channel whose oldest declaration is overdue is closed and
reopened, and the producer learns which queue stopped it and which merely waited behind.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions

DECLARING_CHANNELS = 4

OnDeclared = Callable[[], None]
OnClosed = Callable[[Any, BaseException], None]


@dataclass
class _Channel:
    channel: Any
    waiting: deque[str] = field(default_factory=deque)  # queues asked, in order
    # When the oldest declaration became the one the channel waits for: pika sends a
    # channel's declarations one after another, so time spent queued behind others is not
    # the broker's delay.
    head_since: float = 0.0
    closing: bool = False  # closed here, on purpose


@dataclass(frozen=True)
class Overdue:
    stuck: list[str]  # each the oldest declaration of a channel that stopped answering
    behind: list[str]  # declarations that waited behind them, not answered either


class Declarers:
    """A connection's declaring channels; all on the producer's I/O thread."""

    def __init__(self, connection: pika.SelectConnection, on_closed: OnClosed) -> None:
        self._connection = connection
        self._on_closed = on_closed
        self._channels: list[_Channel] = []
        self._turn = itertools.count()
        for _ in range(DECLARING_CHANNELS):
            self._open()

    def _open(self) -> None:
        with contextlib.suppress(pika.exceptions.AMQPError):
            self._connection.channel(on_open_callback=self._on_open)

    def _on_open(self, channel: Any) -> None:
        held = _Channel(channel)
        channel.add_on_close_callback(lambda _channel, reason: self._closed(held, reason))
        self._channels.append(held)

    def _closed(self, held: _Channel, reason: BaseException) -> None:
        if held in self._channels:
            self._channels.remove(held)
        if not held.closing:
            self._on_closed(held.channel, reason)

    def declare(self, queue: str, arguments: dict[str, Any], on_declared: OnDeclared) -> bool:
        """Declare ``queue`` on the next open channel; False if none is open (declare it on
        the publishing channel instead)."""
        usable = [held for held in self._channels if held.channel.is_open and not held.closing]
        if not usable:
            return False
        held = usable[next(self._turn) % len(usable)]

        def answered(_frame: Any) -> None:
            if held.waiting:  # replies come in the order asked, on one channel
                held.waiting.popleft()
                held.head_since = time.monotonic()
            on_declared()

        held.channel.queue_declare(queue, durable=True, arguments=arguments, callback=answered)
        if not held.waiting:
            held.head_since = time.monotonic()
        held.waiting.append(queue)
        return True

    def overdue(self, timeout_s: float) -> Overdue:
        """Close (and replace) each channel whose oldest declaration has gone unanswered
        for over ``timeout_s`` since it was sent; the declarations queued there will not be
        answered."""
        now = time.monotonic()
        stuck: list[str] = []
        behind: list[str] = []
        for held in list(self._channels):
            if not held.waiting or now - held.head_since < timeout_s:
                continue
            stuck.append(held.waiting[0])
            behind.extend(list(held.waiting)[1:])
            held.waiting.clear()
            held.closing = True
            self._channels.remove(held)
            with contextlib.suppress(pika.exceptions.AMQPError):
                held.channel.close()
            self._open()
        return Overdue(stuck, behind)
