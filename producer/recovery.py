"""What follows confirms on the producer's I/O thread: events returned or refused go again
in order once their queue is declared anew, and after a lost connection every unconfirmed
event goes again in submission order."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import deque
from collections.abc import Callable
from typing import Any

from keyq.producer.context import IoContext
from keyq.producer.lanes import Lanes, QueueLane, WaitReason
from keyq.producer.ledger import ConfirmLedger
from keyq.producer.outgoing import Outgoing, events_in
from keyq.producer.publisher import Publisher
from keyq.producer.stalled import OwnChannels

log = logging.getLogger("keyq.producer")

# A queue refused this many times in a row is given a fresh connection, to the next node: a
# channel on which a quorum queue nacks every publish after a node's loss can stay so until
# that node is back, while a channel opened afresh is served.
RECONNECT_AFTER_RECOVERIES = 6


class Recovery:
    """Settles confirms, re-declares deleted queues and re-sends what went unconfirmed."""

    def __init__(
        self,
        ctx: IoContext,
        lanes: Lanes,
        ledger: ConfirmLedger,
        own: OwnChannels,
        publisher: Publisher,
    ) -> None:
        self._ctx = ctx
        self._lanes = lanes
        self._ledger = ledger
        self._own = own
        self._publisher = publisher
        self._rng = random.Random()
        self.resend: list[Outgoing] = []  # collected from a lost connection, in order
        self.resent_events = 0  # events sent again after a lost connection

    def confirmed(
        self, inflight: deque[Outgoing], frame: Any, heard_again: Callable[[str], None]
    ) -> None:
        """One ack or nack of a channel (``inflight``: its messages in tag order): settle
        it, then send what may go now. ``heard_again`` is told each stalled queue that
        confirmed (``StalledQueues.heard_again``)."""
        settled = self._ledger.settle(inflight, frame)
        for queue in settled.to_flush:
            self._publisher.flush_gathered(queue, expired=False)
        if settled.published:
            for queue in self._ctx.window.settle(settled.published):
                log.info("queue %s confirms again", queue)
                heard_again(queue)
        for queue in settled.to_recover:
            lane = self._lanes.get(queue)
            if lane is None or not lane.waits_for(WaitReason.RECOVERING) or lane.inflight:
                continue
            if (
                lane.recoveries >= RECONNECT_AFTER_RECOVERIES
                and queue not in self._ctx.window.stalled
            ):
                # (A stalled queue is refused on its own channel: the others flow.)
                self._reconnect_refused(queue)
                return
            delay = lane.next_recovery_delay(self._rng)
            if delay:
                self._ctx.ioloop.call_later(
                    delay, lambda q=queue, s=lane: self._recover_later(q, s)
                )
            else:
                self._recover(queue, lane)

    def _reconnect_refused(self, queue: str) -> None:
        """Start over on a fresh connection (the next node): every unconfirmed event is
        collected and re-sent in order, the refused ones included."""
        connection = self._ctx.connection
        if connection is None or not connection.is_open:
            return
        log.warning("RabbitMQ keeps refusing events for %s on this connection; reconnecting", queue)
        self._ctx.window.mark_refusing(queue)
        self._ctx.restart(connection)

    def _recover_later(self, queue: str, lane: QueueLane) -> None:
        """A delayed recovery, unless a reconnect collected the queue's events meanwhile."""
        if (
            self._lanes.get(queue) is lane
            and lane.waits_for(WaitReason.RECOVERING)
            and lane.inflight == 0
        ):
            self._recover(queue, lane)

    def _recover(self, queue: str, lane: QueueLane) -> None:
        """Re-declare a deleted queue and re-send its returned events, then the waiting ones."""
        returned, waiting = lane.begin_recovery()
        log.debug("queue %s was deleted; re-declaring and re-sending %d", queue, len(returned))
        # Fresh records: a settled one may still sit in the in-flight window (behind an older
        # unconfirmed message), where its delivery tag must stay what it was.
        again = [dataclasses.replace(m, tag=0, returned=False, settled=False) for m in returned]
        self._ctx.meter.resent(events_in(again), "redeclare")
        self._publisher.send_all([*again, *waiting])

    def take_back(self, queue: str, pending: list[Outgoing]) -> None:
        """A stalled queue's own channel closed with ``pending`` unsettled: they wait again
        in front of its waiting events."""
        self._ledger.forget(pending)
        self._lanes.of(pending[0]).take_back(pending)

    def collect_unsettled(self) -> None:
        """After a lost connection: everything not confirmed goes out again, in order."""
        pending = self._ledger.collect()
        pending.extend(self._own.collect())
        for lane in self._lanes.values():
            pending.extend(lane.unsettled())
        pending.extend(self.resend)
        pending.sort(key=lambda message: message.number)
        self.resend = pending
        self._lanes.clear()

    def resend_collected(self) -> None:
        """On a new publishing channel: what the lost connection left unconfirmed, in order."""
        resend, self.resend = self.resend, []
        again = events_in(resend)
        self.resent_events += again
        self._ctx.meter.resent(again, "reconnect")
        self._publisher.send_all(resend)
