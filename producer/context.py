"""What every part of the producer's I/O thread shares: its loop, settings, confirm window and
meter, and the connection and publishing channel of the moment (set by ``Connector`` alone)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
from pika.adapters.select_connection import IOLoop

from keyq.broker.settings import Settings
from keyq.producer.declarers import Declarers
from keyq.producer.metrics import Meter
from keyq.producer.window import ConfirmWindow

log = logging.getLogger("keyq.producer")


@dataclass(eq=False)
class IoContext:
    """The narrow context the parts of the I/O thread are built with (never each other's
    whole set: each part is given the siblings it calls)."""

    ioloop: IOLoop
    settings: Settings
    window: ConfirmWindow  # shared with application threads (under ``window.cond``)
    meter: Meter
    queue_args: dict[str, Any]  # a keyed queue's declaration arguments
    connection: pika.SelectConnection | None = None
    channel: Any = None  # the publishing channel, once open
    declarers: Declarers | None = None
    stopping: bool = False
    lost_at: float | None = None  # when the connection was lost, until it is back

    @property
    def connected(self) -> bool:
        connection = self.connection
        return connection is not None and connection.is_open

    @property
    def publishing(self) -> bool:
        """The publishing channel is open on a connection that is not being replaced."""
        channel = self.channel
        return channel is not None and channel.is_open and self.lost_at is None

    def restart(self, connection: pika.SelectConnection) -> None:
        """Close ``connection`` to start over on a fresh one; dropped if it does not close."""
        connection.close()
        self.ioloop.call_later(
            self.settings.connect_timeout, lambda: self._drop_if_still_closing(connection)
        )

    def _drop_if_still_closing(self, connection: pika.SelectConnection) -> None:
        """RabbitMQ stops reading a connection whose channel is held by flow control (a queue
        that does not answer), so it never answers the close either: drop the socket, as
        pika itself does on a missed heartbeat (``_terminate_stream``, a pika internal; pika
        is pinned below 1.5, and the test of stalled queues exercises it)."""
        current = self.connection
        if current is None or current is not connection or not current.is_closing:
            return
        log.warning("RabbitMQ did not answer the close; dropping the connection")
        current._terminate_stream(
            pika.exceptions.StreamLostError("RabbitMQ did not answer the close")
        )
