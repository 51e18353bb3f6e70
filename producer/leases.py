"""Publish leases of keyed queues (see ``broker.retirement``), on the producer's I/O thread.

An event goes to its queue only under a lease, which keeps the janitor from deleting the queue
meanwhile. Leases are asked of the registrar (``LeaseRequests``), whose Redis thread hands the
results back (``Leases``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from keyq.broker.retirement import UNROUTED
from keyq.producer.context import IoContext
from keyq.producer.lanes import Lanes, QueueLane, WaitReason
from keyq.producer.outgoing import Outgoing

log = logging.getLogger("keyq.producer")


class LeaseRequests:
    """Asks leases; a queue without one has its events wait (``UNLEASED``)."""

    def __init__(self, lease_s: float, request_lease: Callable[[str, str | None], None]) -> None:
        self.lease_s = lease_s
        self._request_lease = request_lease

    def ask(self, queue: str, lane: QueueLane) -> None:
        if lane.start_leasing():
            self._request_lease(queue, lane.key)

    def admit(self, message: Outgoing, lane: QueueLane, now: float) -> bool:
        """Whether ``message`` may go now. Past its queue's lease it waits while a lease is
        asked; in the lease's second half the lease is renewed ahead, holding nothing back."""
        if now >= lane.lease_until:
            lane.wait(WaitReason.UNLEASED)
            lane.add_waiting(message)
            self.ask(message.queue, lane)
            return False
        if now >= lane.lease_until - self.lease_s / 2:
            self.ask(message.queue, lane)
        return True


class Leases:
    """Applies lease results on the I/O thread, and keeps leases of queues in flight."""

    def __init__(
        self,
        ctx: IoContext,
        lanes: Lanes,
        requests: LeaseRequests,
        release: Callable[[str], None],  # ``Publisher.release``
    ) -> None:
        self._ctx = ctx
        self._lanes = lanes
        self._requests = requests
        self._release = release
        self.lease_s = requests.lease_s
        # Auto mode: an own queue whose key lost its route (``route_follow.Rerouting``).
        self.unrouted: Callable[[str, float], None] | None = None

    def apply(self, granted: dict[str, int | None], issued_at: float) -> None:
        """From the Redis thread: hand lease results to the I/O thread."""
        # If the I/O loop is already gone there is nothing left to publish.
        with contextlib.suppress(RuntimeError, OSError, AttributeError):
            self._ctx.ioloop.add_callback_threadsafe(lambda: self.applied(granted, issued_at))

    def applied(self, granted: dict[str, int | None], issued_at: float) -> None:
        """On the I/O thread: each queue leased (by the incarnation it is now) or not."""
        ioloop = self._ctx.ioloop
        for queue, incarnation in granted.items():
            lane = self._lanes.get(queue)
            if lane is None:
                continue
            if incarnation == UNROUTED and self.unrouted is not None:
                self.unrouted(queue, self.lease_s)
            elif incarnation is not None and incarnation >= 0:
                lane.leased(incarnation, issued_at, self.lease_s)
                ioloop.call_later(
                    self.lease_s / 2, lambda q=queue, s=lane: self._renew_in_flight(q, s)
                )
                if lane.waits_for(WaitReason.UNLEASED):
                    lane.release(WaitReason.UNLEASED)
                    self._release(queue)
            else:
                log.debug("queue %s is being retired: its events wait", queue)
                lane.refused_lease()
                ioloop.call_later(self.lease_s / 4, lambda q=queue: self._retry(q))

    def _renew_in_flight(self, queue: str, lane: QueueLane) -> None:
        """Keep a queue leased while its events await their confirms, so a slow confirm is
        not mistaken for one that came after its queue was deleted (``ConfirmLedger``)."""
        if (
            self._lanes.get(queue) is lane
            and lane.inflight > 0
            and not lane.waits_for(WaitReason.UNLEASED)
            and time.monotonic() >= lane.lease_until - self.lease_s / 2
        ):
            self._requests.ask(queue, lane)

    def ask_again(self, queue: str) -> None:
        self._retry(queue)

    def _retry(self, queue: str) -> None:
        lane = self._lanes.get(queue)
        if lane is not None and lane.waits_for(WaitReason.UNLEASED):
            self._requests.ask(queue, lane)
