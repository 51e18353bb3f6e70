"""Publishing many messages on a blocking connection with publisher confirms tracked in a
window, not waited for one by one.

``BlockingChannel.confirm_delivery`` makes every ``basic_publish`` wait for its confirm: a round
trip per message (~1,100 msg/s on a 2-core machine). Here the channel's confirms arrive through
a callback, the messages go out without waiting, and ``wait`` drives the connection until every
one is confirmed. A bulk redrive puts thousands of letters back this way.
"""

from __future__ import annotations

import time
from typing import Any

import pika
import pika.exceptions
import pika.spec

from keyq.broker.errors import BrokerUnavailable

CONFIRM_WAIT_S = 60.0
POLL_S = 0.002


class ConfirmWindow:
    """A confirm-mode channel of ``connection``; used from the connection's thread only."""

    def __init__(self, connection: pika.BlockingConnection, window: int = 1000) -> None:
        self._connection: Any = connection
        self._window = window
        self._channel = connection.channel()
        self._impl: Any = self._channel._impl
        self._sent = 0
        self._unconfirmed: set[int] = set()
        self._failed: list[str] = []
        self._selected = False
        self._impl.add_on_return_callback(self._on_return)
        self._impl.confirm_delivery(ack_nack_callback=self._on_confirm, callback=self._on_select)
        self._drive(lambda: self._selected)

    def declare(self, queue: str, arguments: dict[str, Any]) -> None:
        """Declare ``queue`` durable (one round trip) on the publishing channel."""
        self._channel.queue_declare(queue, durable=True, arguments=arguments)

    def publish(self, queue: str, body: bytes, properties: pika.BasicProperties) -> None:
        """Send to ``queue`` by the default exchange, mandatory; waits only for window room."""
        if len(self._unconfirmed) >= self._window:
            self._drive(lambda: len(self._unconfirmed) < self._window)
        self._sent += 1
        self._unconfirmed.add(self._sent)
        self._impl.basic_publish("", queue, body, properties, mandatory=True)

    def wait(self) -> None:
        """Until every message sent is confirmed; raises ``BrokerUnavailable`` if one was
        refused (nack) or returned (its queue is gone), or the channel closed."""
        self._drive(lambda: not self._unconfirmed)
        if self._failed:
            raise BrokerUnavailable(f"{len(self._failed)} messages not taken: {self._failed[0]}")

    def close(self) -> None:
        if self._channel.is_open:
            self._channel.close()

    def _drive(self, done: Any) -> None:
        deadline = time.monotonic() + CONFIRM_WAIT_S
        while not done():
            if not self._channel.is_open:
                raise BrokerUnavailable("the publishing channel closed before its confirms")
            if time.monotonic() > deadline:
                raise BrokerUnavailable(f"no confirms within {CONFIRM_WAIT_S:g} s")
            # pika waits out the whole time limit: a short one, or each wait costs that much.
            self._connection.process_data_events(time_limit=POLL_S)
        self._connection._flush_output()

    def _on_select(self, _frame: Any) -> None:
        self._selected = True

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        tag, multiple = int(method.delivery_tag), bool(method.multiple)
        confirmed = {sent for sent in self._unconfirmed if sent <= tag} if multiple else {tag}
        self._unconfirmed -= confirmed
        if isinstance(method, pika.spec.Basic.Nack):
            self._failed.append(f"{len(confirmed)} nacked by the broker")

    def _on_return(self, _channel: Any, method: Any, _properties: Any, _body: bytes) -> None:
        self._failed.append(f"returned by the broker: {method.reply_text} ({method.routing_key})")
