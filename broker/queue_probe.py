"""A queue's counts by passive declare, written once.

A passive declare of a queue that is not there (or whose node is down) closes the channel
with a 404, so every probe needs a channel it may lose and a way to open the next one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from keyq.broker.queue_refusals import NOT_FOUND, QueueRefusal, classify


@dataclass(frozen=True)
class QueueCounts:
    """What a passive declare tells of a queue."""

    ready: int  # messages ready for delivery (not those delivered and unacked)
    consumers: int


class QueueProbe:
    """Passive declares on a channel of their own, opened on first use and again after a
    404 closed it."""

    def __init__(self, open_channel: Callable[[], BlockingChannel]) -> None:
        self._open_channel = open_channel
        self._channel: BlockingChannel | None = None

    def counts(self, queue: str) -> QueueCounts | None:
        """``queue``'s counts; None when the broker answers 404 (missing, or its node down).
        Any other refusal is raised."""
        found = self.look(queue)
        return found if isinstance(found, QueueCounts) else None

    def look(self, queue: str) -> QueueCounts | QueueRefusal:
        """``queue``'s counts, or what its 404 means (``queue_refusals.classify``), for a
        caller that must tell a queue that is gone from one whose node is down. Any other
        refusal is raised."""
        channel = self._channel
        if channel is None or not channel.is_open:
            channel = self._channel = self._open_channel()
        try:
            method = channel.queue_declare(queue, passive=True).method
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._channel = None
            if exc.reply_code != NOT_FOUND:
                raise
            return classify(exc.reply_code, exc.reply_text)
        return QueueCounts(int(method.message_count), int(method.consumer_count))

    def counts_of(self, queues: Iterable[str]) -> dict[str, QueueCounts | None]:
        """The counts of each of ``queues`` (each asked once), None for those not found."""
        return {queue: self.counts(queue) for queue in dict.fromkeys(queues)}

    def close(self) -> None:
        """Close the probe's channel, if open; quietly, as the connection may be gone."""
        channel, self._channel = self._channel, None
        if channel is not None and channel.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                channel.close()
