"""Sending events and settling their confirms, on the producer's I/O thread.

Events go with ``mandatory`` on the confirm-mode publishing channel (a silent queue's on its
own, see ``keyq.producer.silent``), each queue through its lane, which parks them while
anything holds the queue. Confirms are tracked by delivery tag; events the broker returned
(their queue was deleted) or refused go again in order once the queue is declared anew, and
after a lost connection every unconfirmed event goes again in submission order. The events of
a queue that wait together go as one pack (``keyq.producer.packing``): a message to all of
the above, whose confirm settles each of its events.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import pika

from keyq.broker.naming import incarnation_name
from keyq.producer.lanes import ParkReason, QueueLane, forget_quiet
from keyq.producer.outgoing import Outgoing, events_in
from keyq.producer.packing import Packer, record_of

if TYPE_CHECKING:
    from keyq.producer.link import PublisherLink

log = logging.getLogger("keyq.producer")

DRAIN_BATCH = 500
FORGET_STATES_ABOVE = 50_000
# Before re-sending to a queue that returned events again right after its last recovery (a
# quorum queue electing a leader keeps returning them): no tight loop of returns.
RECOVERY_DELAYS = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0)
# A queue refused this many times in a row is given a fresh connection, to the next node: a
# channel on which a quorum queue nacks every publish after a node's loss can stay so until
# that node is back, while a channel opened afresh is served.
RECONNECT_AFTER_RECOVERIES = 6


class Sender:
    """The lanes of the current connection, and the events in flight on its main channel."""

    def __init__(self, link: PublisherLink) -> None:
        self._link = link
        self.packer = Packer(link.settings)
        self.lanes: dict[str, QueueLane] = {}
        self.next_tag = 1
        self.inflight: deque[Outgoing] = deque()  # the publishing channel's, in tag order
        self.by_number: dict[int, Outgoing] = {}
        self.resend: list[Outgoing] = []  # collected from a lost connection, in order
        self.returned_events = 0  # events the broker returned and that were sent again
        self.resent_events = 0  # events sent again after a lost connection
        self.late_confirms = 0  # events confirmed after their queue's lease ran out: sent again
        self._to_flush: list[str] = []  # queues whose gathered events may go (after a confirm)

    # ------------------------------------------------------------------------ sending
    def drain(self) -> None:
        link = self._link
        window = link.window
        window.draining()
        channel = link.connector.channel
        if channel is None or not channel.is_open or link.connector.lost_at is not None:
            return
        outbox = window.outbox
        taken: list[Outgoing] = []
        for _ in range(DRAIN_BATCH):
            try:
                taken.append(outbox.popleft())
            except IndexError:
                break
        else:
            if outbox:
                window.drain_again()
        sending = self.packer.pack(taken)
        sent = 0
        try:
            for message in sending:
                self.gather_or_send(message)
                sent += 1
        finally:
            if sent < len(sending):  # an error sending: what is left waits, in order, in front
                left = [event for message in sending[sent:] for event in message.members]
                left.sort(key=lambda event: event.number)
                outbox.extendleft(reversed(left))
        if len(self.lanes) > FORGET_STATES_ABOVE:
            forget_quiet(self.lanes)

    def resend_collected(self) -> None:
        """On a new publishing channel: what the lost connection left unconfirmed, in order."""
        self.next_tag = 1
        resend, self.resend = self.resend, []
        again = events_in(resend)
        self.resent_events += again
        self._link.meter.resent(again, "reconnect")
        for message in self.packer.pack(resend):
            self.send(message)

    def lane(self, message: Outgoing) -> QueueLane:
        lane = self.lanes.get(message.queue)
        if lane is None:
            lane = self.lanes[message.queue] = QueueLane(key=message.key)
            lane.unreachable = self._link.probes.is_unreachable(message.queue)
        return lane

    def gather_or_send(self, message: Outgoing) -> None:
        """Send ``message`` now, or let it wait for more of its queue's events to join its
        pack: while an earlier message of the queue awaits its confirm (then the next pack
        is as large as what arrived meanwhile), or for the linger. A full pack goes at once."""
        packer = self.packer
        lane = self.lane(message)
        if (
            not packer.enabled
            or lane.waiting
            or message.queue in self._link.window.silent
            or not (lane.inflight or lane.gathering or packer.linger_s)
        ):
            if lane.gathering:  # older than ``message``: they go first
                self._flush_gathered(message.queue, expired=True)
            self.send(message)
            return
        size = sum(len(record_of(event)) for event in message.members)
        now = time.monotonic()
        lane.gather(message, size, now)
        if packer.full(lane.gathered_events, lane.gathered_bytes):
            self._flush_gathered(message.queue, expired=True, keep_partial=True)
        elif packer.linger_s and len(lane.gathering) == 1:
            self._link.ioloop.call_later(
                packer.linger_s,
                lambda q=message.queue, s=lane, t=now: self._linger_over(q, s, t),
            )

    def _flush_gathered(self, queue: str, *, expired: bool, keep_partial: bool = False) -> None:
        """Send what gathered for ``queue``: when full or its linger is over (``expired``),
        else once nothing of the queue is in flight any more and the linger is over. With
        ``keep_partial`` (a pack filled up) only full packs go; the rest goes on gathering."""
        lane = self.lanes.get(queue)
        if lane is None or not lane.gathering:
            return
        if not expired:
            waited = time.monotonic() - lane.gathered_at
            if lane.inflight or waited < self.packer.linger_s:
                return
        since = lane.gathered_at
        packs = self.packer.pack(lane.take_gathered())
        if keep_partial and packs and not self.packer.full(packs[-1].count, len(packs[-1].body)):
            rest = packs.pop()
            lane.gather(rest, sum(len(record_of(e)) for e in rest.members), since)
        for message in packs:
            self.send(message)

    def _linger_over(self, queue: str, lane: QueueLane, began: float) -> None:
        """A linger is over: what gathered since ``began`` goes (not a later round's)."""
        if self.lanes.get(queue) is lane and lane.gathering and lane.gathered_at == began:
            self._flush_gathered(queue, expired=True)

    def send(self, message: Outgoing) -> None:
        link = self._link
        lane = self.lane(message)
        silent = message.queue in link.window.silent
        channel = link.connector.channel
        blocked = lane.waiting
        if silent and not blocked:
            channel = None if lane.parked else link.silent.channel_for(message.queue)
        if blocked or channel is None or not channel.is_open:
            # A closed channel (a lease granted while reconnecting): parked events are
            # collected and re-sent in order once the connection is back. A silent queue's
            # events wait for its own channel to have room (``release_parked``).
            lane.hold(message)
            return
        now = time.monotonic()
        if not link.leases.admit(message, lane, now):
            return
        name = incarnation_name(message.queue, lane.incarnation)
        if not lane.declared:
            if not silent and self._declare_apart(message.queue, lane, name):
                lane.hold(message)  # sent once its queue exists
                return
            # nowait: the broker handles the declare before the publish that follows it on
            # this channel, so no round trip is spent per new key.
            channel.queue_declare(name, durable=True, arguments=link.queue_args)
            lane.declared = True
        if silent:
            link.silent.track(message.queue, message)
        else:
            message.tag = self.next_tag
            self.next_tag += 1
            self.inflight.append(message)
        message.returned = False
        message.settled = False
        message.sent_at = now
        message.sent_to = name
        message.lease_chain = lane.lease_chain
        channel.basic_publish("", name, message.body, message.properties, mandatory=True)
        if message.events is not None:
            self.packer.packs_sent += 1
            self.packer.events_packed += len(message.events)
        self.by_number[message.number] = message
        lane.inflight += 1

    def _declare_apart(self, queue: str, lane: QueueLane, name: str) -> bool:
        """Declare a new key's queue on a declaring channel (``keyq.producer.declarers``);
        its events park until the broker answers. False when no such channel is open."""
        declarers = self._link.connector.declarers
        if declarers is None:
            return False

        def on_declared() -> None:
            if self.lanes.get(queue) is not lane or lane.declaring != name:
                return  # reconnected or recovered since: that lane is gone
            lane.stop_declaring()
            lane.declared = incarnation_name(queue, lane.incarnation) == name
            log.debug("declared %s: %d events parked", name, len(lane.parked))
            self.release_parked(queue)

        if not declarers.declare(name, self._link.queue_args, on_declared):
            return False
        log.debug("declaring %s apart", name)
        lane.start_declaring(name)
        return True

    def release_parked(self, queue: str) -> None:
        """Send a queue's parked events now that nothing else holds them (those beyond a
        silent queue's room park again, in order)."""
        lane = self.lanes.get(queue)
        if lane is None:
            return
        for message in self.packer.pack(lane.take_releasable()):
            self.gather_or_send(message)

    # ---------------------------------------------------------------------- confirms
    def on_return(self, _channel: Any, _method: Any, properties: Any, _body: bytes) -> None:
        message_id = getattr(properties, "message_id", None) or ""
        number = message_id.rpartition(":")[2]
        message = self.by_number.get(int(number)) if number.isdigit() else None
        if message is None:
            return
        message.returned = True
        self.lanes[message.queue].park(ParkReason.RECOVERING)
        log.debug(
            "message %d (%d events) returned by %s", message.number, message.count, message.sent_to
        )

    def on_confirm(self, frame: Any) -> None:
        self.settle_confirmed(self.inflight, frame)

    def settle_confirmed(self, inflight: deque[Outgoing], frame: Any) -> None:
        """Settle what one ack or nack of a channel covers (``inflight``: that channel's
        events in tag order, tags consecutive)."""
        method = frame.method
        nacked = isinstance(method, pika.spec.Basic.Nack)
        tag = method.delivery_tag
        if not inflight:
            return
        to_recover: list[str] = []
        published: list[str] = []  # the queue of each event now published
        if method.multiple:
            for message in inflight:
                if message.tag > tag:
                    break
                if not message.settled and self._settle(message, nacked, to_recover):
                    published.extend([message.queue] * message.count)
        else:
            index = tag - inflight[0].tag
            if 0 <= index < len(inflight):
                message = inflight[index]
                if not message.settled and self._settle(message, nacked, to_recover):
                    published.extend([message.queue] * message.count)
        while inflight and inflight[0].settled:
            inflight.popleft()
        self._after_settling(published, to_recover)

    def _after_settling(self, published: list[str], to_recover: list[str]) -> None:
        """What follows confirms: the window's counts, silent queues heard again (their own
        channel closed, their parked events sent on the main one), recoveries."""
        link = self._link
        link.watch.stall.settled(time.monotonic())
        if self._to_flush:
            flush, self._to_flush = self._to_flush, []
            for queue in flush:
                self._flush_gathered(queue, expired=False)
        if published:
            for queue in link.window.settle(published):
                log.info("queue %s confirms again", queue)
                link.silent.close(queue)
                self.release_parked(queue)
        for queue in to_recover:
            lane = self.lanes.get(queue)
            if lane is not None and lane.parked_for(ParkReason.RECOVERING) and lane.inflight == 0:
                if (
                    lane.recoveries >= RECONNECT_AFTER_RECOVERIES
                    and queue not in link.window.silent
                ):
                    # (A silent queue is refused on its own channel: the others flow.)
                    self._reconnect_refused(queue)
                    return
                delay = RECOVERY_DELAYS[min(lane.recoveries, len(RECOVERY_DELAYS) - 1)]
                lane.recoveries += 1
                if delay:
                    link.ioloop.call_later(delay, lambda q=queue, s=lane: self._recover_later(q, s))
                else:
                    self._recover(queue, lane)

    def _settle(self, message: Outgoing, nacked: bool, to_recover: list[str]) -> bool:
        """Mark one message (an event or a pack) settled; True if it is now published, False
        if it must go again."""
        message.settled = True
        self.by_number.pop(message.number, None)
        lane = self.lanes[message.queue]
        lane.inflight -= 1
        published = not (message.returned or nacked)
        if lane.inflight == 0 and lane.gathering:
            self._to_flush.append(message.queue)
        if published and (
            time.monotonic() >= lane.lease_until or message.lease_chain != lane.lease_chain
        ):
            # RabbitMQ confirms an event whose queue was deleted after routing it: a confirm
            # proves the event reached the queue only if leases held its deleter off from the
            # send to the confirm without a gap (the grace outlasts every lease granted before
            # a mark). A lease that lapsed, a mark, or a new incarnation in between (a quorum
            # queue deleted and declared anew: the lane is leased for the next name while a
            # slow confirm still comes from the old) breaks that. Send it again; a copy of an
            # event already applied is dropped by its seq.
            published = False
            self.late_confirms += message.count
            log.debug("event %d to %s confirmed after its lease", message.number, message.sent_to)
        if published:
            lane.recoveries = 0
            for event in message.members:
                if event.confirmation is not None:
                    event.confirmation.confirm()
            if not lane.registered:
                lane.registered = True
                self._link.on_new_queues({message.sent_to: lane.key})
        else:
            lane.park(ParkReason.RECOVERING)
            lane.returned.append(message)
            self.returned_events += message.count if message.returned or nacked else 0
        if lane.parked_for(ParkReason.RECOVERING) and lane.inflight == 0:
            to_recover.append(message.queue)
        self._link.meter.settled(message, nacked=nacked, published=published)
        return published

    # ---------------------------------------------------------------------- recovery
    def _reconnect_refused(self, queue: str) -> None:
        """Start over on a fresh connection (the next node): every unconfirmed event is
        collected and re-sent in order, the refused ones included."""
        link = self._link
        connection = link.connector.connection
        if connection is None or not connection.is_open:
            return
        log.warning("RabbitMQ keeps refusing events for %s on this connection; reconnecting", queue)
        link.window.mark_refusing(queue)
        link.connector.restart(connection)

    def _recover_later(self, queue: str, lane: QueueLane) -> None:
        """A delayed recovery, unless a reconnect collected the queue's events meanwhile."""
        if (
            self.lanes.get(queue) is lane
            and lane.parked_for(ParkReason.RECOVERING)
            and lane.inflight == 0
        ):
            self._recover(queue, lane)

    def _recover(self, queue: str, lane: QueueLane) -> None:
        """Re-declare a deleted queue and re-send its returned events, then the parked ones."""
        returned, parked = lane.begin_recovery()
        log.debug("queue %s was deleted; re-declaring and re-sending %d", queue, len(returned))
        # Fresh records: a settled one may still sit in the in-flight window (behind an older
        # unconfirmed message), where its delivery tag must stay what it was.
        again = [dataclasses.replace(m, tag=0, returned=False, settled=False) for m in returned]
        self._link.meter.resent(events_in(again), "redeclare")
        for message in self.packer.pack([*again, *parked]):
            self.send(message)

    def take_back(self, queue: str, pending: list[Outgoing]) -> None:
        """A silent queue's own channel closed with ``pending`` unsettled: they wait again
        in front of its parked events."""
        lane = self.lanes.setdefault(queue, QueueLane(key=pending[0].key))
        for message in pending:
            self.by_number.pop(message.number, None)
        lane.take_back(pending)

    def collect_unsettled(self) -> None:
        """After a lost connection: everything not confirmed goes out again, in order."""
        pending = [message for message in self.inflight if not message.settled]
        pending.extend(self._link.silent.collect())
        for lane in self.lanes.values():
            pending.extend(lane.returned)
            pending.extend(lane.gathering)
            pending.extend(lane.parked)
        pending.extend(self.resend)
        pending.sort(key=lambda message: message.number)
        self.resend = pending
        self.inflight.clear()
        self.by_number.clear()
        self.lanes.clear()
