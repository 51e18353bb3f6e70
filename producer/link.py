"""The producer's connection to RabbitMQ, owned by one I/O thread.

Only that thread touches pika objects. Application threads hand events over through the
confirm window (``keyq.producer.window``) and wait there for room; the I/O thread publishes
them with ``mandatory`` on a confirm-mode channel, tracks confirms by delivery tag, re-sends
events the broker returned (their queue was deleted) in order, and after a lost connection
reconnects and re-sends every unconfirmed event in submission order.

``PublisherLink`` puts together the parts, each on the I/O thread but the window:

* ``Connector`` (``connector``): the connection and its publishing channel, reconnects;
* ``Sender`` (``sending``): each queue's ``QueueLane`` (``lanes``), sends and confirms;
* ``SilentQueues`` (``silent``): queues whose confirm was overdue, on channels of their own;
* ``ConfirmWatch`` (``overdue``): overdue confirms and declarations, stalls reported;
* ``Probes`` (``probes``): queues whose node is down, declared aside until they answer;
* ``Leases`` (``leases``): publish leases, asked of the registrar and applied.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pika.adapters.select_connection import IOLoop

from keyq.broker.errors import BrokerUnavailable, KeyqError
from keyq.broker.settings import Settings
from keyq.broker.topology import keyed_queue_arguments
from keyq.producer.connector import Connector
from keyq.producer.lanes import QueueLane
from keyq.producer.leases import Leases
from keyq.producer.metrics import NO_METRICS, Meter
from keyq.producer.outgoing import Outgoing
from keyq.producer.overdue import ConfirmWatch
from keyq.producer.probes import Probes
from keyq.producer.sending import Sender
from keyq.producer.silent import SilentQueues
from keyq.producer.window import REFUSING_QUEUE_ROOM, ConfirmWindow

__all__ = ["REFUSING_QUEUE_ROOM", "NewQueues", "PublisherLink"]

NewQueues = Callable[[dict[str, str | None]], None]


class PublisherLink:
    """Publishes ``Outgoing`` events with confirms on a background I/O thread."""

    def __init__(
        self,
        settings: Settings,
        stream: str,
        dead_letter_queue: str,
        queue_type: str,
        *,
        on_new_queues: NewQueues,
        request_lease: Callable[[str], None],
        meter: Meter = NO_METRICS,
    ) -> None:
        self.settings = settings
        self.stream = stream
        self.dlq = dead_letter_queue
        self.queue_type = queue_type
        self.queue_args = keyed_queue_arguments(stream, queue_type)
        self.on_new_queues = on_new_queues
        self.ioloop = IOLoop()
        # Shared with application threads (under ``cond``).
        self.window = ConfirmWindow(
            settings.confirm_window,
            lambda: self.ioloop.add_callback_threadsafe(self.sender.drain),
        )
        # Recorded into by the I/O thread; reads the window at each scrape (``metrics``).
        self.meter = meter
        meter.watch(self.window)
        # Owned by the I/O thread.
        self.connector = Connector(self)
        self.sender = Sender(self)
        self.silent = SilentQueues(self)
        self.watch = ConfirmWatch(self)
        self.probes = Probes(self)
        self.leases = Leases(self, settings.publish_lease_ms / 1000, request_lease)
        self._thread = threading.Thread(
            target=self.connector.run, name="keyq-producer-io", daemon=True
        )

    # ----------------------------------------------------------- application threads
    def start(self) -> None:
        """Connect, or raise the reason the broker cannot be used."""
        self._thread.start()
        limit = self.settings.connect_timeout * 3 + 1
        if not self.connector.ready.wait(limit):
            self.stop()
            raise BrokerUnavailable(f"RabbitMQ did not answer within {limit:.0f} s")
        with self.cond:
            failure = self.window.failure
        if failure is not None:
            self.stop()
            raise failure

    @property
    def cond(self) -> threading.Condition:
        """Guards the window; ``submit`` is called with it held."""
        return self.window.cond

    def submit(self, message: Outgoing, deadline: float) -> None:
        """Queue an event for the I/O thread, waiting while the window is full or the
        broker blocks publishers. Call with ``cond`` held."""
        self.window.submit(message, deadline)

    def wait_settled(self, deadline: float | None) -> None:
        """Block until every submitted event is confirmed (or raise why not)."""
        self.window.wait_settled(deadline)

    @property
    def unsettled(self) -> int:
        return self.window.unsettled

    def unsettled_by_queue(self) -> dict[str, int]:
        return self.window.unsettled_by_queue()

    @property
    def failure(self) -> KeyqError | None:
        return self.window.failure

    def stop(self) -> None:
        """Close the connection and end the I/O thread (unconfirmed events are abandoned)."""
        self.meter.unwatch(self.window)
        if self._thread.is_alive():
            self.ioloop.add_callback_threadsafe(self.connector.shutdown)
            self._thread.join(timeout=self.settings.connect_timeout + 5)

    def apply_leases(self, granted: dict[str, int | None], issued_at: float) -> None:
        """From the Redis thread: hand lease results to the I/O thread."""
        self.leases.apply(granted, issued_at)

    # ------------------------------------------------------------------ counters
    @property
    def returned_events(self) -> int:
        """Events the broker returned and that were sent again."""
        return self.sender.returned_events

    @property
    def resent_events(self) -> int:
        """Events sent again after a lost connection."""
        return self.sender.resent_events

    @property
    def packs_sent(self) -> int:
        """Messages sent as packs (``keyq.producer.packing``)."""
        return self.sender.packer.packs_sent

    @property
    def events_packed(self) -> int:
        """Events that went inside packs."""
        return self.sender.packer.events_packed

    @property
    def late_confirms(self) -> int:
        """Events confirmed after their queue's lease ran out: sent again."""
        return self.sender.late_confirms

    @property
    def overdue_reconnects(self) -> int:
        """Reconnects because a confirm did not come in time."""
        return self.watch.overdue_reconnects

    @property
    def silent_channel_resets(self) -> int:
        """A silent queue's own channel reopened because its confirm was overdue."""
        return self.silent.channel_resets

    @property
    def reconnects(self) -> int:
        """Connections opened again after one was lost or closed."""
        return self.connector.reconnects

    # ------------------------------------------------- the parts, under older names
    @property
    def _ioloop(self) -> IOLoop:
        return self.ioloop

    @property
    def _queue_args(self) -> dict[str, Any]:
        return self.queue_args

    @property
    def _queues(self) -> dict[str, QueueLane]:
        return self.sender.lanes

    @property
    def _unreachable(self) -> dict[str, str]:
        return self.probes.unreachable

    def _probe(self, queue: str, arguments: dict[str, Any]) -> None:
        self.probes.probe(queue, arguments)
