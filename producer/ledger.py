"""The confirm ledger of the producer's I/O thread: which messages are in flight on the
publishing channel, by delivery tag and by number, and what each confirm settles.

It owns the lease rule: RabbitMQ confirms an event whose queue was deleted after routing it,
so a confirm proves the event reached its queue only if leases held the queue's deleter off
from the send to the confirm without a gap.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pika

from keyq.producer.lanes import Lanes, WaitReason
from keyq.producer.metrics import Meter
from keyq.producer.outgoing import Outgoing

log = logging.getLogger("keyq.producer")

NewQueues = Callable[[dict[str, str | None]], None]


class StallClock:
    """When to say where unconfirmed events wait: after ``2 * timeout_s`` with no confirm,
    then at most once per ``timeout_s``."""

    def __init__(self, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self.last_settled_at = now
        self.reported_at = 0.0

    def settled(self, now: float) -> None:
        self.last_settled_at = now

    def due(self, now: float, unsettled: int) -> float | None:
        """How long nothing has settled, when a report is due now; else None."""
        if not unsettled:
            self.last_settled_at = now  # nothing owed: the wait starts with the next event
            return None
        quiet_for = now - self.last_settled_at
        if quiet_for < 2 * self.timeout_s or now - self.reported_at < self.timeout_s:
            return None
        self.reported_at = now
        return quiet_for


@dataclass
class Settled:
    """What one confirm settled: the queue of each event now published, the queues whose
    returned events may go again, and those whose gathered events may go."""

    published: list[str] = field(default_factory=list)
    to_recover: list[str] = field(default_factory=list)
    to_flush: list[str] = field(default_factory=list)


class ConfirmLedger:
    """Messages in flight, and their settling under the lease rule."""

    def __init__(self, lanes: Lanes, meter: Meter, confirm_timeout: float, on_new: NewQueues):
        self._lanes = lanes
        self._meter = meter
        self._on_new = on_new  # a queue's first event published: register it
        self.stall = StallClock(confirm_timeout, time.monotonic())
        self.next_tag = 1
        self.inflight: deque[Outgoing] = deque()  # the publishing channel's, in tag order
        self.by_number: dict[int, Outgoing] = {}
        self.returned_events = 0  # events the broker returned or refused, to send again
        self.late_confirms = 0  # events confirmed after their queue's lease ran out

    def track(self, message: Outgoing) -> None:
        """``message`` goes on the publishing channel now: it takes the next delivery tag."""
        message.tag = self.next_tag
        self.next_tag += 1
        self.inflight.append(message)

    def sent(self, message: Outgoing) -> None:
        """``message`` went out (on any channel): a return names it by number."""
        self.by_number[message.number] = message

    def on_return(self, _channel: Any, _method: Any, properties: Any, _body: bytes) -> None:
        """The broker returned a message (its queue is gone): it goes again once settled."""
        message_id = getattr(properties, "message_id", None) or ""
        number = message_id.rpartition(":")[2]
        message = self.by_number.get(int(number)) if number.isdigit() else None
        if message is None:
            return
        message.returned = True
        self._lanes[message.queue].wait(WaitReason.RECOVERING)
        log.debug(
            "message %d (%d events) returned by %s", message.number, message.count, message.sent_to
        )

    def settle(self, inflight: deque[Outgoing], frame: Any) -> Settled:
        """Settle what one ack or nack of a channel covers (``inflight``: that channel's
        messages in tag order, tags consecutive)."""
        method = frame.method
        nacked = isinstance(method, pika.spec.Basic.Nack)
        tag = method.delivery_tag
        settled = Settled()
        if not inflight:
            return settled
        if method.multiple:
            covered = list(itertools.takewhile(lambda message: message.tag <= tag, inflight))
        else:
            index = tag - inflight[0].tag
            covered = [inflight[index]] if 0 <= index < len(inflight) else []
        for message in covered:
            if not message.settled and self._settle(message, nacked, settled):
                settled.published.extend([message.queue] * message.count)
        while inflight and inflight[0].settled:
            inflight.popleft()
        self.stall.settled(time.monotonic())
        return settled

    def _settle(self, message: Outgoing, nacked: bool, settled: Settled) -> bool:
        """Mark one message (an event or a pack) settled; True if it is now published, False
        if it must go again."""
        message.settled = True
        self.by_number.pop(message.number, None)
        lane = self._lanes[message.queue]
        published = not (message.returned or nacked)
        if published and (
            time.monotonic() >= lane.lease_until or message.lease_chain != lane.lease_chain
        ):
            # A confirm proves the event reached its queue only if leases held its deleter off
            # from the send to the confirm without a gap (the grace outlasts every lease
            # granted before a mark). A lease that lapsed, a mark, or a new incarnation in
            # between (a quorum queue deleted and declared anew: the lane is leased for the
            # next name while a slow confirm still comes from the old) breaks that. Send it
            # again; a copy of an event already applied is dropped by its seq.
            published = False
            self.late_confirms += message.count
            log.debug("event %d to %s confirmed after its lease", message.number, message.sent_to)
        elif not published:
            self.returned_events += message.count
        if published:
            for event in message.members:
                if event.confirmation is not None:
                    event.confirmation.confirm()
        if lane.settled(message, published):
            self._on_new({message.sent_to: lane.key})
        if lane.inflight == 0 and lane.gathering:
            settled.to_flush.append(message.queue)
        if lane.waits_for(WaitReason.RECOVERING) and lane.inflight == 0:
            settled.to_recover.append(message.queue)
        self._meter.settled(message, nacked=nacked, published=published)
        return published

    def forget(self, messages: list[Outgoing]) -> None:
        """These will never be confirmed on their channel (it closed): they go again."""
        for message in messages:
            self.by_number.pop(message.number, None)

    def collect(self) -> list[Outgoing]:
        """After a lost connection: the publishing channel's unsettled messages, the ledger
        emptied (the next channel's tags start at 1)."""
        pending = [message for message in self.inflight if not message.settled]
        self.inflight.clear()
        self.by_number.clear()
        self.next_tag = 1
        return pending
