"""Queues whose node is down, declared aside until they answer; on the producer's I/O thread.

A declaration or publish to a classic queue on a stopped cluster node closes its channel with
a 404. Such a queue's events wait (``UNREACHABLE``) while every other queue's flow, and the
queue is declared again, on a channel of its own, with backoff, until its node is back.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import pika.exceptions

from keyq.broker.naming import base_queue_name
from keyq.broker.topology import dead_letter_queue_arguments
from keyq.producer.lanes import ParkReason

if TYPE_CHECKING:
    from keyq.producer.link import PublisherLink

log = logging.getLogger("keyq.producer")

# A queue whose node is down is declared again on a channel of its own after these delays.
PROBE_DELAYS = (0.5, 1.0, 2.0, 4.0)


def probe_delay(attempt: int) -> float:
    """The wait before declaring again after ``attempt`` (from 0) went unanswered."""
    return PROBE_DELAYS[min(attempt, len(PROBE_DELAYS) - 1)]


class Probes:
    """Unreachable queues (kept across reconnects) and their chains of declarations."""

    def __init__(self, link: PublisherLink) -> None:
        self._link = link
        self.unreachable: dict[str, str] = {}  # base name -> the incarnation that was down
        # queue -> the token of its one live chain of declarations (a new connection starts
        # a new chain; an older chain that sees another token stops).
        self.probing: dict[str, object] = {}

    def is_unreachable(self, queue: str) -> bool:
        return queue in self.unreachable

    def mark_unreachable(self, queue: str, why: str) -> None:
        """``queue`` (an incarnation's name) answered 404: its events wait for it."""
        base = base_queue_name(queue)
        if base not in self.unreachable:
            log.warning("queue %s is unavailable (%s); its events wait for it", queue, why)
            self.unreachable[base] = queue

    def probe_all(self) -> None:
        """On a new connection: the dead-letter queue (whose node may be down too: publishing
        must not stop for it) and every queue still unreachable."""
        link = self._link
        self.probe(link.dlq, dead_letter_queue_arguments(link.queue_type))
        for queue in self.unreachable.values():
            self.probe(queue, link.queue_args)

    def probe(self, queue: str, arguments: dict[str, Any]) -> None:
        """Start declaring ``queue`` aside on this connection, in place of any earlier chain:
        one that a lost connection cut off must not leave the queue waiting for good."""
        token = object()
        self.probing[queue] = token
        self._declare(queue, arguments, token, 0)

    def _declare(self, queue: str, arguments: dict[str, Any], token: object, attempt: int) -> None:
        """Declare ``queue`` on a channel of its own, so that a 404 (its node is down)
        closes only that channel; retried with backoff until it works, or until the next
        connection starts a chain of its own (``probe``)."""
        link = self._link
        if link.connector.stopping or self.probing.get(queue) is not token:
            return  # stopping, declared, or superseded by a newer connection's chain
        connection = link.connector.connection
        delay = probe_delay(attempt)

        def again() -> None:  # called at most once: each way out below takes one path
            link.ioloop.call_later(
                delay, lambda: self._declare(queue, arguments, token, attempt + 1)
            )

        if connection is None or not connection.is_open:
            again()
            return
        declared: list[bool] = []

        def on_declared(channel: Any) -> None:
            declared.append(True)
            if self.probing.get(queue) is token:
                del self.probing[queue]
            with contextlib.suppress(Exception):
                channel.close()
            self._reachable(queue)

        def on_closed(_channel: Any, reason: BaseException) -> None:
            if declared or link.connector.stopping:
                return
            if attempt == 0:
                log.warning("%s is unavailable, retrying: %s", queue, reason)
            again()

        def on_open(channel: Any) -> None:
            channel.queue_declare(
                queue, durable=True, arguments=arguments, callback=lambda _f: on_declared(channel)
            )

        try:
            channel = connection.channel(on_open_callback=on_open)
        except pika.exceptions.AMQPError:
            again()
            return
        # Registered before the channel opens: a connection lost while it is still opening
        # closes it too, and the chain must go on.
        channel.add_on_close_callback(on_closed)

    def _reachable(self, queue: str) -> None:
        """``queue`` was declared: its waiting events go, in order."""
        base = base_queue_name(queue)
        if self.unreachable.get(base) != queue:
            return
        del self.unreachable[base]
        log.info("queue %s is available again", queue)
        lane = self._link.sender.lanes.get(base)
        if lane is None:
            return
        lane.unpark(ParkReason.UNREACHABLE)
        lane.declared = True
        self._link.sender.release_parked(base)
