"""Queues whose node is down, probed until they answer; on the producer's I/O thread.

A declaration or publish to a classic queue on a stopped cluster node closes its channel with
a 404. Such a queue's events wait (``UNREACHABLE``) while every other queue's flow, and the
queue is declared again, on a channel of its own, with backoff, until its node is back.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import pika.exceptions

from keyq.broker.backoff import Backoff
from keyq.broker.naming import base_queue_name
from keyq.broker.topology import dead_letter_queue_arguments
from keyq.producer.context import IoContext
from keyq.producer.lanes import Lanes

log = logging.getLogger("keyq.producer")

# A queue whose node is down is declared again on a channel of its own, with backoff.
PROBE_FIRST_S = 0.5
PROBE_MAX_S = 4.0


class Probes:
    """Unreachable queues (``Lanes.unreachable``, kept across reconnects) and their chains of
    declarations."""

    def __init__(
        self,
        ctx: IoContext,
        lanes: Lanes,
        dead_letter: tuple[str, str],  # the dead-letter queue and the stream's queue type
        release: Callable[[str], None],  # ``Publisher.release``
    ) -> None:
        self._ctx = ctx
        self._lanes = lanes
        self.unreachable = lanes.unreachable
        self._dead_letter = dead_letter
        self._release = release
        # queue -> the token of its one live chain of declarations (a new connection starts
        # a new chain; an older chain that sees another token stops).
        self.probing: dict[str, object] = {}

    def mark_unreachable(self, queue: str, why: str) -> None:
        """``queue`` (an incarnation's name) answered 404: its events wait for it."""
        base = base_queue_name(queue)
        if base not in self.unreachable:
            log.warning("queue %s is unavailable (%s); its events wait for it", queue, why)
            self.unreachable[base] = queue

    def probe_all(self) -> None:
        """On a new connection: the dead-letter queue (whose node may be down too: publishing
        must not stop for it) and every queue still unreachable."""
        queue, queue_type = self._dead_letter
        self.probe(queue, dead_letter_queue_arguments(queue_type))
        for queue in self.unreachable.values():
            self.probe(queue, self._ctx.queue_args)

    def probe(self, queue: str, arguments: dict[str, Any]) -> None:
        """Start probing ``queue`` on this connection, in place of any earlier chain:
        one that a lost connection cut off must not leave the queue waiting for good."""
        token = object()
        self.probing[queue] = token
        self._declare(queue, arguments, token, Backoff(PROBE_FIRST_S, PROBE_MAX_S), first=True)

    def _declare(
        self,
        queue: str,
        arguments: dict[str, Any],
        token: object,
        delays: Backoff,
        *,
        first: bool = False,
    ) -> None:
        """Declare ``queue`` on a channel of its own, so that a 404 (its node is down)
        closes only that channel; retried with backoff until it works, or until the next
        connection starts a chain of its own (``probe``)."""
        ctx = self._ctx
        if ctx.stopping or self.probing.get(queue) is not token:
            return  # stopping, declared, or superseded by a newer connection's chain
        connection = ctx.connection

        def again() -> None:  # called at most once: each way out below takes one path
            ctx.ioloop.call_later(
                delays.next(), lambda: self._declare(queue, arguments, token, delays)
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
            if declared or ctx.stopping:
                return
            if first:
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
        lane = self._lanes.get(base)
        if lane is None:
            return
        lane.reachable()
        self._release(base)
