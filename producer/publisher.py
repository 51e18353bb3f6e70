"""Sending events, on the producer's I/O thread.

Events go with ``mandatory`` on the confirm-mode publishing channel (a stalled queue's on its
own, see ``keyq.producer.stalled``), each queue through its lane, where they wait while
anything holds the queue back. The events of a queue that wait together go as one pack
(``keyq.producer.packing``): a message to confirms, returns and re-sends alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from keyq.broker.naming import incarnation_name
from keyq.producer.context import IoContext
from keyq.producer.lanes import Lanes, QueueLane, WaitReason
from keyq.producer.leases import LeaseRequests
from keyq.producer.ledger import ConfirmLedger
from keyq.producer.outgoing import Outgoing
from keyq.producer.packing import Packer
from keyq.producer.route_follow import Rerouting, RouteFollower, Way
from keyq.producer.stalled import OwnChannels

log = logging.getLogger("keyq.producer")

DRAIN_BATCH = 500
FORGET_LANES_ABOVE = 50_000


class Publisher:
    """Takes events from the window's outbox and sends them, each queue in order."""

    def __init__(
        self,
        ctx: IoContext,
        lanes: Lanes,
        *,
        packer: Packer,
        ledger: ConfirmLedger,
        own: OwnChannels,
        leases: LeaseRequests,
    ) -> None:
        self._ctx = ctx
        self._lanes = lanes
        self.packer = packer
        self._ledger = ledger
        self._own = own
        self._leases = leases
        # Auto mode (``PublisherLink.follow``): its keys' routes, and what follows them here.
        self.routes: RouteFollower | None = None
        self.rerouting: Rerouting | None = None

    def drain(self) -> None:
        """Send what application threads handed over (``DRAIN_BATCH`` at a time)."""
        window = self._ctx.window
        window.draining()
        if not self._ctx.publishing:
            return
        outbox = window.outbox
        taken: list[Outgoing] = []
        for _ in range(DRAIN_BATCH):
            try:
                taken.append(outbox.popleft())
            except IndexError:
                break
        else:
            if outbox and window.drain_again():
                self._ctx.ioloop.add_callback_threadsafe(self.drain)
        sending = self.packer.pack(taken)
        sent = 0
        try:
            for message in sending:
                self._gather_or_send(message)
                sent += 1
        finally:
            if sent < len(sending):  # an error sending: what is left waits, in order, in front
                left = [event for message in sending[sent:] for event in message.members]
                left.sort(key=lambda event: event.number)
                outbox.extendleft(reversed(left))
        if len(self._lanes) > FORGET_LANES_ABOVE:
            self._lanes.forget_quiet()

    def send_all(self, messages: Iterable[Outgoing]) -> None:
        """Send these (events or packs, of any queues) again, packed anew, in order."""
        for message in self.packer.pack(messages):
            self.send(message)

    def release(self, queue: str) -> None:
        """Send a queue's waiting events now that nothing holds them back (those beyond a
        stalled queue's room wait again, in order)."""
        lane = self._lanes.get(queue)
        if lane is None:
            return
        for message in self.packer.pack(lane.take_released()):
            self._gather_or_send(message)

    def _gather_or_send(self, message: Outgoing) -> None:
        """Send ``message`` now, or let it gather for a pack (``Packer.gathers``)."""
        lane = self._lanes.of(message)
        if not self.packer.gathers(lane, message.queue in self._ctx.window.stalled):
            if lane.gathering:  # older than ``message``: they go first
                self.flush_gathered(message.queue, expired=True)
            self.send(message)
            return
        now = time.monotonic()
        full, linger = self.packer.gather(lane, message, now)
        for pack in full:
            self.send(pack)
        if linger:
            self._ctx.ioloop.call_later(
                self.packer.linger_s,
                lambda q=message.queue, s=lane, t=now: self._linger_over(q, s, t),
            )

    def flush_gathered(self, queue: str, *, expired: bool) -> None:
        """Send what gathered for ``queue``: when its linger is over (``expired``), else once
        nothing of the queue is in flight any more and the linger is over."""
        lane = self._lanes.get(queue)
        if lane is None or not lane.gathering:
            return
        if not expired and not self.packer.lingered(lane, time.monotonic()):
            return
        for message in self.packer.take_gathered(lane):
            self.send(message)

    def _linger_over(self, queue: str, lane: QueueLane, began: float) -> None:
        """A linger is over: what gathered since ``began`` goes (not a later round's)."""
        if self._lanes.get(queue) is lane and lane.gathering and lane.gathered_at == began:
            self.flush_gathered(queue, expired=True)

    def send(self, message: Outgoing) -> None:
        ctx = self._ctx
        if self.routes is not None and not self._follow_route(message):
            return
        lane = self._lanes.of(message)
        stalled = message.queue in ctx.window.stalled
        channel = ctx.channel
        waits = lane.waits
        if stalled and not waits:
            channel = None if lane.waiting else self._own.channel_for(message.queue)
        if waits or channel is None or not channel.is_open:
            # A closed channel (a lease granted while reconnecting): waiting events are
            # collected and re-sent in order once the connection is back. A stalled queue's
            # events wait for its own channel to have room (``StalledQueues``).
            lane.add_waiting(message)
            return
        now = time.monotonic()
        if not self._leases.admit(message, lane, now):
            return
        name = incarnation_name(message.queue, lane.incarnation)
        if not lane.declared:
            if not stalled and self._declare_apart(message.queue, lane, name):
                lane.add_waiting(message)  # sent once its queue exists
                return
            # nowait: the broker handles the declare before the publish that follows it on
            # this channel, so no round trip is spent per new key.
            channel.queue_declare(name, durable=True, arguments=ctx.queue_args)
            lane.mark_declared()
        if stalled:
            self._own.track(message.queue, message)
        else:
            self._ledger.track(message)
        channel.basic_publish("", name, message.body, message.properties, mandatory=True)
        lane.sent(message, name, now)
        self.packer.count_sent(message)
        self._ledger.sent(message)

    def _follow_route(self, message: Outgoing) -> bool:
        """Auto mode: readdress ``message`` to its key's bucket, or keep it waiting while its
        key switches to its own queue (False)."""
        assert self.routes is not None and self.rerouting is not None
        way = self.routes.way(message.key, message.queue)
        if way is Way.TO_BUCKET:
            self.rerouting.to_bucket(message)
        elif way is Way.HOLD:
            lane = self._lanes.of(message)
            lane.wait(WaitReason.SWITCHING)
            lane.add_waiting(message)
            return False
        return True

    def _declare_apart(self, queue: str, lane: QueueLane, name: str) -> bool:
        """Declare a new key's queue on a declaring channel (``keyq.producer.declarers``);
        its events wait until the broker answers. False when no such channel is open."""
        declarers = self._ctx.declarers
        if declarers is None:
            return False

        def on_declared() -> None:
            if self._lanes.get(queue) is not lane or lane.declaring != name:
                return  # reconnected or recovered since: that lane is gone
            lane.declared_apart(name, incarnation_name(queue, lane.incarnation))
            log.debug("declared %s: %d events waited", name, len(lane.waiting))
            self.release(queue)

        if not declarers.declare(name, self._ctx.queue_args, on_declared):
            return False
        log.debug("declaring %s apart", name)
        lane.start_declaring(name)
        return True
