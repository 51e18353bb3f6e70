"""The producer's connection to RabbitMQ, owned by one I/O thread.

Only that thread touches pika objects. Application threads hand events over through the
confirm window (``keyq.producer.window``) and wait there for room; the I/O thread publishes
them with ``mandatory`` on a confirm-mode channel, tracks confirms by delivery tag, re-sends
events the broker returned (their queue was deleted) in order, and after a lost connection
reconnects and re-sends every unconfirmed event in submission order.

``PublisherLink`` builds the parts, each given the narrow ``IoContext`` and the siblings it
calls, so that calls go one way, from the top down:

* ``Connector`` (``connector``): the connection and its publishing channel, reconnects;
* ``ConfirmWatch`` (``overdue``): overdue confirms and declarations, stalls reported;
* ``Probes`` (``probes``): queues whose node is down, probed until they answer;
* ``StalledQueues`` (``stalled``): queues whose confirm was overdue, on channels of their own;
* ``Leases`` (``leases``): publish leases, asked of the registrar and applied;
* ``Recovery`` (``recovery``): what follows confirms, returned events re-sent in order;
* ``Rerouting`` (``route_follow``, auto mode): an own queue's events to its bucket, unrouted;
* ``Publisher`` (``publisher``): sends, packed (``packing``), through each ``QueueLane``;
* ``ConfirmLedger`` (``ledger``): what is in flight, settled under the lease rule.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from pika.adapters.select_connection import IOLoop

from keyq.broker.errors import BrokerUnavailable
from keyq.broker.settings import Settings
from keyq.broker.topology import keyed_queue_arguments
from keyq.producer.connector import Connector
from keyq.producer.context import IoContext
from keyq.producer.lanes import Lanes
from keyq.producer.leases import LeaseRequests, Leases
from keyq.producer.ledger import ConfirmLedger, NewQueues
from keyq.producer.metrics import NO_METRICS, Meter
from keyq.producer.outgoing import Outgoing
from keyq.producer.overdue import ConfirmWatch
from keyq.producer.packing import Packer
from keyq.producer.probes import Probes
from keyq.producer.publisher import Publisher
from keyq.producer.recovery import Recovery
from keyq.producer.route_follow import Rerouting, RouteFollower
from keyq.producer.stalled import OwnChannels, StalledQueues
from keyq.producer.window import ConfirmWindow


class PublisherLink:
    """Publishes ``Outgoing`` events with confirms on a background I/O thread."""

    def __init__(
        self,
        settings: Settings,
        stream: str,
        dead_letter: tuple[str, str],  # the dead-letter queue and the stream's queue type
        *,
        on_new_queues: NewQueues,
        request_lease: Callable[[str, str | None], None],
        meter: Meter = NO_METRICS,
    ) -> None:
        window = ConfirmWindow(settings.confirm_window)
        queue_args = keyed_queue_arguments(stream, dead_letter[1])
        self.ctx = ctx = IoContext(IOLoop(), settings, window, meter, queue_args)
        self.window = window  # shared with application threads (under ``window.cond``)
        meter.watch(window)  # read at each scrape (``metrics``)
        self.lanes = lanes = Lanes()
        self.ledger = ConfirmLedger(lanes, meter, settings.confirm_timeout, on_new_queues)
        own = OwnChannels()
        requests = LeaseRequests(settings.publish_lease_ms / 1000, request_lease)
        self.publisher = Publisher(
            ctx, lanes, packer=Packer(settings), ledger=self.ledger, own=own, leases=requests
        )
        self.recovery = Recovery(ctx, lanes, self.ledger, own, self.publisher)
        release = self.publisher.release
        self.leases = Leases(ctx, lanes, requests, release)
        self.rerouting: Rerouting | None = None  # auto mode (``follow``)
        self.stalled = StalledQueues(
            ctx,
            own,
            ledger=self.ledger,
            confirmed=self.recovery.confirmed,
            take_back=self.recovery.take_back,
            release=release,
        )
        self.probes = Probes(ctx, lanes, dead_letter, release)
        self.watch = ConfirmWatch(
            ctx,
            lanes,
            ledger=self.ledger,
            release=release,
            recovery=self.recovery,
            stalled=self.stalled,
        )
        self.connector = Connector(
            ctx,
            stream,
            ledger=self.ledger,
            publisher=self.publisher,
            recovery=self.recovery,
            stalled=self.stalled,
            probes=self.probes,
            watch=self.watch,
        )
        self._thread = threading.Thread(
            target=self.connector.run, name="keyq-producer-io", daemon=True
        )

    # ----------------------------------------------------------- application threads
    def start(self) -> None:
        """Connect, or raise the reason the broker cannot be used."""
        self._thread.start()
        limit = self.ctx.settings.connect_timeout * 3 + 1
        if not self.connector.ready.wait(limit):
            self.stop()
            raise BrokerUnavailable(f"RabbitMQ did not answer within {limit:.0f} s")
        with self.window.cond:
            failure = self.window.failure
        if failure is not None:
            self.stop()
            raise failure

    def follow(self, routes: RouteFollower) -> None:
        """Auto mode: an own queue whose key lost its route sends to its bucket instead."""
        self.rerouting = Rerouting(
            self.ctx, self.lanes, routes, self.publisher.release, self.leases.ask_again
        )
        self.publisher.routes = routes
        self.publisher.rerouting = self.rerouting
        self.leases.unrouted = self.rerouting.unrouted
        routes.on_switched = self.rerouting.switched

    def submit(self, message: Outgoing, deadline: float) -> None:
        """Queue an event for the I/O thread, waiting while the window is full or the
        broker blocks publishers, and wake the I/O thread to send it. Call with
        ``window.cond`` held."""
        if self.window.submit(message, deadline):
            self.ctx.ioloop.add_callback_threadsafe(self.publisher.drain)

    def stop(self) -> None:
        """Close the connection and end the I/O thread (unconfirmed events are abandoned)."""
        self.ctx.meter.unwatch(self.window)
        if self._thread.is_alive():
            self.ctx.ioloop.add_callback_threadsafe(self.connector.shutdown)
            self._thread.join(timeout=self.ctx.settings.connect_timeout + 5)

    def stats(self) -> dict[str, int]:
        """The I/O thread's counters (``Producer.stats``)."""
        packer = self.publisher.packer
        return {
            "returned": self.ledger.returned_events,
            "resent": self.recovery.resent_events,
            "late_confirms": self.ledger.late_confirms,
            "overdue_reconnects": self.watch.overdue_reconnects,
            "stalled_channel_resets": self.stalled.channel_resets,
            "reconnects": self.connector.reconnects,
            "unconfirmed": self.window.unsettled,
            "rerouted": 0 if self.rerouting is None else self.rerouting.rerouted,
            "packs": packer.packs_sent,
            "events_in_packs": packer.events_packed,
        }
