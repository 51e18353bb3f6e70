"""The watch over overdue confirms and declarations; a timer on the producer's I/O thread.

A quorum queue that lost its leader can leave a channel's publishes unanswered for good, and a
queue whose process is stuck leaves its declaration unanswered: every ``CONFIRM_CHECK_S`` the
watch looks for what waited past ``confirm_timeout`` and starts that part over, and says where
unconfirmed events wait when nothing has settled for long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from keyq.broker.naming import base_queue_name
from keyq.producer.lanes import ParkReason, parked_counts
from keyq.producer.outgoing import Outgoing, events_in
from keyq.producer.silent import SILENT_QUEUE_IN_FLIGHT

if TYPE_CHECKING:
    from keyq.producer.link import PublisherLink

log = logging.getLogger("keyq.producer")

# How often the I/O thread looks for an event whose confirm is overdue (``confirm_timeout``).
CONFIRM_CHECK_S = 1.0


def overdue_oldest(
    inflight: Iterable[Outgoing], now: float, timeout_s: float
) -> tuple[Outgoing, float] | None:
    """The oldest unsettled event of a channel (``inflight`` in send order) and how long it
    has waited, if that is ``timeout_s`` or more."""
    oldest = next((message for message in inflight if not message.settled), None)
    if oldest is None:
        return None
    waited = now - oldest.sent_at
    if waited < timeout_s:
        return None
    return oldest, waited


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


class ConfirmWatch:
    """Reconnects past an overdue confirm, resets overdue silent channels and declarations,
    and reports stalls."""

    def __init__(self, link: PublisherLink) -> None:
        self._link = link
        self.overdue_reconnects = 0  # reconnects because a confirm did not come in time
        self.stall = StallClock(link.settings.confirm_timeout, time.monotonic())

    def start(self) -> None:
        self._link.ioloop.call_later(CONFIRM_CHECK_S, self._tick)

    def _tick(self) -> None:
        link = self._link
        if link.connector.stopping or link.window.failure is not None:
            return
        link.ioloop.call_later(CONFIRM_CHECK_S, self._tick)
        self.check(time.monotonic())

    def check(self, now: float) -> None:
        """Reconnect when the oldest event sent on this connection has waited past
        ``confirm_timeout`` for its confirm: a fresh connection, to the next node, sends them
        again (a copy of an event that did arrive is dropped by its seq)."""
        link = self._link
        self._report_if_stuck(now)
        link.silent.reset_overdue(now)
        self._reset_overdue_declarations()
        connection = link.connector.connection
        if (
            connection is None
            or not connection.is_open
            or link.window.blocked  # flow control delays confirms on purpose
            or link.connector.lost_at is not None
        ):
            return
        inflight = link.sender.inflight
        found = overdue_oldest(inflight, now, link.settings.confirm_timeout)
        if found is None:
            return
        oldest, waited = found
        waiting = {message.queue for message in inflight if not message.settled}
        unconfirmed = sum(not message.settled for message in inflight)
        self.overdue_reconnects += 1
        log.warning(
            "%d events of %d queues await their confirms on this connection, the oldest (for "
            "%s) for %.0f s; reconnecting to send them again, each of those queues on a channel "
            "of its own, %d at a time, until it confirms",
            unconfirmed,
            len(waiting),
            oldest.queue,
            waited,
            SILENT_QUEUE_IN_FLIGHT,
        )
        # Any of them may be the one that stopped the connection: each is silent until it
        # confirms again, which the others do at once on the new connection.
        link.window.mark_silent(waiting)
        link.connector.restart(connection)

    def _reset_overdue_declarations(self) -> None:
        """A declaration unanswered past ``confirm_timeout`` (its queue is stuck): that queue
        goes silent, as if its confirm were overdue, and is declared on a channel of its own
        with its events; the declarations that waited behind it are asked again."""
        link = self._link
        declarers = link.connector.declarers
        if declarers is None or link.window.blocked:
            return
        timeout = link.settings.confirm_timeout
        overdue = declarers.overdue(timeout)
        if not (overdue.stuck or overdue.behind):
            return
        log.warning(
            "declaring %s went unanswered for over %.0f s; it is declared on a channel of its "
            "own, and %d declarations that waited behind it are sent again",
            ", ".join(overdue.stuck),
            timeout,
            len(overdue.behind),
        )
        link.window.mark_silent({base_queue_name(name) for name in overdue.stuck})
        for name in [*overdue.stuck, *overdue.behind]:
            queue = base_queue_name(name)
            lane = link.sender.lanes.get(queue)
            if lane is not None and lane.declaring == name:
                lane.stop_declaring()
                link.sender.release_parked(queue)

    def _report_if_stuck(self, now: float) -> None:
        """Say where unconfirmed events wait when nothing has settled for a long time, so a
        stall can be told apart: leases, a deleted queue, a node that is down, the broker."""
        link = self._link
        quiet_for = self.stall.due(now, link.window.unsettled)
        if quiet_for is None:
            return
        lanes = link.sender.lanes.values()
        aside = link.silent.in_flight()
        held = parked_counts(lanes, ParkReason.HELD)
        recovering = parked_counts(lanes, ParkReason.RECOVERING)
        unreachable = parked_counts(lanes, ParkReason.UNREACHABLE)
        log.warning(
            "no confirm for %.0f s with %d events unconfirmed: %d in flight (%d on the channels "
            "of %d silent queues), %d waiting to be sent, %d gathering for a pack, %d to re-send "
            "after a reconnect; parked: %d for a lease (%d queues), %d behind a deleted queue "
            "(%d queues), %d for a node that is down (%d queues)",
            quiet_for,
            link.window.unsettled,
            events_in(message for message in link.sender.inflight if not message.settled) + aside,
            aside,
            len(link.silent.asides),
            len(link.window.outbox),
            sum(events_in(lane.gathering) for lane in lanes),
            events_in(link.sender.resend),
            *held,
            *recovering,
            *unreachable,
        )
