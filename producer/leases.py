"""Publish leases of keyed queues (see ``broker.retirement``), on the producer's I/O thread.

An event goes to its queue only under a lease, which keeps the janitor from deleting the queue
meanwhile. Leases are asked of the registrar, whose Redis thread hands the results back here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from keyq.producer.lanes import ParkReason, QueueLane
from keyq.producer.outgoing import Outgoing

if TYPE_CHECKING:
    from keyq.producer.link import PublisherLink

log = logging.getLogger("keyq.producer")


class Leases:
    """Asks, renews and applies leases; a queue without one holds its events (``HELD``)."""

    def __init__(
        self, link: PublisherLink, lease_s: float, request_lease: Callable[[str], None]
    ) -> None:
        self._link = link
        self.lease_s = lease_s
        self._request_lease = request_lease

    def ask(self, queue: str, lane: QueueLane) -> None:
        if not lane.leasing:
            lane.leasing = True
            self._request_lease(queue)

    def admit(self, message: Outgoing, lane: QueueLane, now: float) -> bool:
        """Whether ``message`` may go now. Past its queue's lease it parks while a lease is
        asked; in the lease's second half the lease is renewed ahead, holding nothing."""
        if now >= lane.lease_until:
            lane.park(ParkReason.HELD)
            lane.hold(message)
            self.ask(message.queue, lane)
            return False
        if now >= lane.lease_until - self.lease_s / 2:
            self.ask(message.queue, lane)
        return True

    def apply(self, granted: dict[str, int | None], issued_at: float) -> None:
        """From the Redis thread: hand lease results to the I/O thread."""
        # If the I/O loop is already gone there is nothing left to publish.
        with contextlib.suppress(RuntimeError, OSError, AttributeError):
            self._link.ioloop.add_callback_threadsafe(lambda: self.applied(granted, issued_at))

    def applied(self, granted: dict[str, int | None], issued_at: float) -> None:
        """On the I/O thread: each queue leased (by the incarnation it is now) or not."""
        link = self._link
        for queue, incarnation in granted.items():
            lane = link.sender.lanes.get(queue)
            if lane is None:
                continue
            lane.leasing = False
            if incarnation is not None:
                if incarnation != lane.incarnation:
                    # Deleted and moved on since (quorum): declared anew under the next name.
                    lane.incarnation = incarnation
                    lane.declared = False
                    lane.registered = False
                    lane.lease_chain += 1
                elif issued_at >= lane.lease_until:
                    lane.lease_chain += 1  # asked after the last lease ran out: a gap
                lane.lease_until = issued_at + self.lease_s
                link.ioloop.call_later(
                    self.lease_s / 2, lambda q=queue, s=lane: self._renew_in_flight(q, s)
                )
                if lane.parked_for(ParkReason.HELD):
                    lane.unpark(ParkReason.HELD)
                    link.sender.release_parked(queue)
            else:
                # Being retired: hold its events, and declare it again once the mark is gone.
                log.debug("queue %s is being retired: its events wait", queue)
                lane.lease_until = 0.0
                lane.lease_chain += 1
                lane.park(ParkReason.HELD)
                lane.declared = False
                lane.registered = False
                link.ioloop.call_later(self.lease_s / 4, lambda q=queue: self._retry(q))

    def _renew_in_flight(self, queue: str, lane: QueueLane) -> None:
        """Keep a queue leased while its events await their confirms, so a slow confirm is
        not mistaken for one that came after its queue was deleted (see ``Sender``)."""
        if (
            self._link.sender.lanes.get(queue) is lane
            and lane.inflight > 0
            and not lane.parked_for(ParkReason.HELD)
            and time.monotonic() >= lane.lease_until - self.lease_s / 2
        ):
            self.ask(queue, lane)

    def _retry(self, queue: str) -> None:
        lane = self._link.sender.lanes.get(queue)
        if lane is not None and lane.parked_for(ParkReason.HELD):
            self.ask(queue, lane)
