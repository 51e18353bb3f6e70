"""The watch over overdue confirms and declarations; a timer on the producer's I/O thread.

A quorum queue that lost its leader can leave a channel's publishes unanswered for good, and a
queue whose process is stuck leaves its declaration unanswered: every ``CONFIRM_CHECK_S`` the
watch looks for what waited past ``confirm_timeout`` and starts that part over, and says where
unconfirmed events wait when nothing has settled for long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from keyq.broker.naming import base_queue_name
from keyq.producer.context import IoContext
from keyq.producer.lanes import Lanes, WaitReason, waiting_counts
from keyq.producer.ledger import ConfirmLedger
from keyq.producer.outgoing import Outgoing, events_in
from keyq.producer.recovery import Recovery
from keyq.producer.stalled import STALLED_QUEUE_IN_FLIGHT, StalledQueues

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


class ConfirmWatch:
    """Reconnects past an overdue confirm, resets overdue stalled channels and declarations,
    and reports stalls."""

    def __init__(
        self,
        ctx: IoContext,
        lanes: Lanes,
        *,
        ledger: ConfirmLedger,
        release: Callable[[str], None],  # ``Publisher.release``
        recovery: Recovery,
        stalled: StalledQueues,
    ) -> None:
        self._ctx = ctx
        self._lanes = lanes
        self._ledger = ledger
        self._release = release
        self._recovery = recovery
        self._stalled = stalled
        self.overdue_reconnects = 0  # reconnects because a confirm did not come in time

    def start(self) -> None:
        self._ctx.ioloop.call_later(CONFIRM_CHECK_S, self._tick)

    def _tick(self) -> None:
        ctx = self._ctx
        if ctx.stopping or ctx.window.failure is not None:
            return
        ctx.ioloop.call_later(CONFIRM_CHECK_S, self._tick)
        self.check(time.monotonic())

    def check(self, now: float) -> None:
        """Reconnect when the oldest event sent on this connection has waited past
        ``confirm_timeout`` for its confirm: a fresh connection, to the next node, sends them
        again (a copy of an event that did arrive is dropped by its seq)."""
        ctx = self._ctx
        self._report_if_stuck(now)
        self._stalled.reset_overdue(now)
        self._reset_overdue_declarations()
        connection = ctx.connection
        if (
            connection is None
            or not connection.is_open
            or ctx.window.blocked  # flow control delays confirms on purpose
            or ctx.lost_at is not None
        ):
            return
        inflight = self._ledger.inflight
        found = overdue_oldest(inflight, now, ctx.settings.confirm_timeout)
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
            STALLED_QUEUE_IN_FLIGHT,
        )
        # Any of them may be the one that stopped the connection: each is stalled until it
        # confirms again, which the others do at once on the new connection.
        ctx.window.mark_stalled(waiting)
        ctx.restart(connection)

    def _reset_overdue_declarations(self) -> None:
        """A declaration unanswered past ``confirm_timeout`` (its queue is stuck): that queue
        stalls, as if its confirm were overdue, and is declared on a channel of its own
        with its events; the declarations that waited behind it are asked again."""
        ctx = self._ctx
        declarers = ctx.declarers
        if declarers is None or ctx.window.blocked:
            return
        timeout = ctx.settings.confirm_timeout
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
        stuck = {base_queue_name(name) for name in overdue.stuck}
        ctx.window.mark_stalled(stuck)
        for queue in sorted(stuck):
            self._stalled.open(queue)
        for name in [*overdue.stuck, *overdue.behind]:
            queue = base_queue_name(name)
            lane = self._lanes.get(queue)
            if lane is not None and lane.declaring == name:
                lane.stop_declaring()
                self._release(queue)

    def _report_if_stuck(self, now: float) -> None:
        """Say where unconfirmed events wait when nothing has settled for a long time, so a
        stall can be told apart: leases, a deleted queue, a node that is down, the broker."""
        window = self._ctx.window
        quiet_for = self._ledger.stall.due(now, window.unsettled)
        if quiet_for is None:
            return
        lanes = self._lanes.values()
        own = self._stalled.own
        on_own = own.in_flight()
        unleased = waiting_counts(lanes, WaitReason.UNLEASED)
        recovering = waiting_counts(lanes, WaitReason.RECOVERING)
        unreachable = waiting_counts(lanes, WaitReason.UNREACHABLE)
        log.warning(
            "no confirm for %.0f s with %d events unconfirmed: %d in flight (%d on the channels "
            "of %d stalled queues), %d waiting to be sent, %d gathering for a pack, %d to re-send "
            "after a reconnect; waiting: %d for a lease (%d queues), %d behind a deleted queue "
            "(%d queues), %d for a node that is down (%d queues)",
            quiet_for,
            window.unsettled,
            events_in(m for m in self._ledger.inflight if not m.settled) + on_own,
            on_own,
            len(own),
            len(window.outbox),
            sum(events_in(lane.gathering) for lane in lanes),
            events_in(self._recovery.resend),
            *unleased,
            *recovering,
            *unreachable,
        )
