"""Queues the broker holds back from this worker's connection: held, messages ready, nothing
delivered.

RabbitMQ hands a quorum queue's deliveries to a consumer through the queue's replica on the
consumer's node, when that node has one: the leader leaves the sending to it. When that
replica is down while its node runs (it did not come back after a restart, say), a consumer
connected there is sent nothing, ever: its messages count as delivered to it, unacked, and
stay so until its channel closes, while a consumer on another node would get them at once. A
worker would hold such a queue, see it idle, hand it back and claim it again, forever, on the
same node.

The signature, in key mode, is a holding handed back idle with nothing delivered, after which
the queue has messages ready (closing gave them back); in bucket mode, whose queues are held
for good, a queue quiet for the idle time whose consumer has nothing unacked while messages
wait ready; in any mode, a queue reopened for a gap that stayed open that has more messages
ready once closed than its consumer held, with room for more (the gap's missing event was
kept from this node). Twice for one queue through one connection, within ``WINDOW_S``, and
the worker moves its connection to another node. Only quorum queues are watched: a classic queue has
one process, which sends its deliveries itself. ``StarvedQueues`` watches: it observes the
held queues' hand-backs (``keyq.worker.holding.held_queues``), and the claim loop has it look into
quiet holdings in bucket mode.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from keyq.broker.errors import KeyqError
from keyq.broker.log_context import about_queues
from keyq.worker.amqp.deliveries import DeliveryBuffer
from keyq.worker.amqp.link import ConsumerCalls, ConsumerLink, QueueCounter
from keyq.worker.holding.held_index import Held

log = logging.getLogger("keyq.worker.held")

# Starved holdings of one queue that move the connection. One can be a race: a delivery
# that arrived while the hand-back closed the channel, a peer's consumer still active on the
# queue for a moment (single active consumer: a paused zombie until its connection times
# out). Two, an idle period apart, through the same connection, are not.
STARVED_TIMES = 2
# Strikes older than this are forgotten: two rare races months apart are not a pattern.
WINDOW_S = 120.0


class StarvationWatch:
    """Counts, per queue, starved holdings seen through one connection; bookkeeping only,
    safe from any thread."""

    def __init__(self, times: int = STARVED_TIMES, window_s: float = WINDOW_S) -> None:
        self._times = times
        self._window_s = window_s
        self._lock = threading.Lock()
        self._strikes: dict[str, list[float]] = {}
        self._connection = 0

    def delivered(self, queue: str) -> None:
        """A holding of ``queue`` received something: the broker delivers it here."""
        with self._lock:
            self._strikes.pop(queue, None)

    def starved(self, queue: str, now: float, connection: int) -> bool:
        """A holding of ``queue`` was starved at ``now`` (monotonic s), through connection
        number ``connection`` (strikes through an earlier one are forgotten). True once it
        has been ``times`` within the window; its strikes then start over."""
        with self._lock:
            if connection != self._connection:
                self._connection = connection
                self._strikes.clear()
            strikes = [t for t in self._strikes.get(queue, []) if now - t < self._window_s]
            strikes.append(now)
            if len(strikes) >= self._times:
                self._strikes.pop(queue, None)
                return True
            self._strikes[queue] = strikes
            return False

    def forget(self) -> None:
        """The connection moved: what was seen through the old one no longer counts."""
        with self._lock:
            self._strikes.clear()


# How long the broker is given to take back a closed consumer's messages (its channel's end
# reaches the quorum queue's leader as a command of its log) before the queues are looked
# into, once per hand-back: a starved queue missed now is seen at its next hand-back.
SETTLE_S = 0.1
# Queues looked into per hand-back, picked at random: a starved holding is rare, a hand-back
# of hundreds is not.
MOST_LOOKED_INTO = 20


def ready_after_close(
    ready_of: Callable[[Sequence[str]], dict[str, int]],
    queues: Sequence[str],
    pause: Callable[[float], None],
) -> dict[str, int]:
    """The messages ready in (at most ``MOST_LOOKED_INTO`` of) ``queues``, consumers just
    closed, once the broker had ``SETTLE_S`` to take back what it counted as delivered to
    them; ``ready_of`` looks into several queues in one call."""
    picked = list(queues)
    if len(picked) > MOST_LOOKED_INTO:
        picked = random.sample(picked, MOST_LOOKED_INTO)
    pause(SETTLE_S)
    return ready_of(picked)


class StarvedQueues:
    """Spots starved quorum queues and moves the connection away from their node. Told of
    hand-backs on the batch loop, asked to look into quiet holdings on the claim loop."""

    def __init__(
        self,
        *,
        link: ConsumerLink,
        consumers: ConsumerCalls,
        counts: QueueCounter,
        buffer: DeliveryBuffer,
        queue_type: str,
    ) -> None:
        self._link = link
        self._consumers = consumers
        self._counts = counts
        self._buffer = buffer
        self._watching = queue_type == "quorum"
        self._watch = StarvationWatch()
        self._next_look: dict[str, float] = {}  # quiet holdings: monotonic time of next look
        self._moves_lock = threading.Lock()
        self.starved_moves = 0  # connections moved to another node

    def handed_back(self, reasons: Mapping[str, str], starved: set[str]) -> None:
        """Quorum queues handed back idle having delivered nothing, that have messages
        ready once closed, were starved."""
        idle = [queue for queue, reason in reasons.items() if reason == "idle"]
        if not self._watching or not idle:
            return
        for queue in idle:
            if queue not in starved:
                self._watch.delivered(queue)
        looked_into = [queue for queue in idle if queue in starved]
        if not looked_into:
            return
        try:
            ready = ready_after_close(self._counts.message_counts, looked_into, time.sleep)
        except (KeyqError, TimeoutError) as exc:
            log.debug("looking into queues handed back starved failed: %s", exc)
            return
        for queue, count in ready.items():
            if count and self._strike(queue, _held_idle(count)):
                return

    def watch_quiet(self, held: list[Held], quiet_after_s: float) -> None:
        """Bucket mode, on the claim loop: a quorum queue held with nothing arriving for
        ``quiet_after_s``, its consumer holding no unacked message, while the broker counts
        messages ready, is starved (a consumer with room is sent ready messages at once).
        Each is looked into at most once per ``quiet_after_s``."""
        if not self._watching:
            return
        now = time.monotonic()
        for gone in self._next_look.keys() - {item.queue for item in held}:
            del self._next_look[gone]
        for item in held:
            last = self._buffer.last_arrival(item.queue)
            if last is not None and last >= item.since and now - last < quiet_after_s:
                self._watch.delivered(item.queue)
                continue
            if now - max(last or item.since, item.since) < quiet_after_s:
                continue
            if self._next_look.get(item.queue, 0.0) > now or self._buffer.depth(item.queue):
                continue
            self._next_look[item.queue] = now + quiet_after_s
            ready = self._counts.message_count(item.queue)
            idle = ready and self._consumers.unacked_of(item.queue) == 0
            if idle and self._strike(item.queue, _held_idle(ready)):
                self._next_look.clear()
                return

    def closed_for_gap(self, queue: str, room: int | None) -> None:
        """``queue``'s consumer, its prefetch of ``room`` messages, was just closed for a gap
        that stayed open with nothing arriving, to get back what the broker counts as
        delivered to it; what it held is still buffered. More messages ready now than it
        held, while it had room for more, were kept from it: the broker counts them
        delivered through this node and does not send them (seen on 3.10 after node
        restarts; reopening on the same node does not help)."""
        if not self._watching or room is None:
            return
        held_messages = self._buffer.messages(queue)
        if held_messages >= room:
            return
        try:
            ready = ready_after_close(self._counts.message_counts, [queue], time.sleep)
        except (KeyqError, TimeoutError) as exc:
            log.debug("looking into a queue reopened for a gap failed: %s", exc)
            return
        kept = ready.get(queue, 0) - held_messages
        log.debug("queue %s reopened for a gap: %d kept of it", queue, max(kept, 0))
        if kept > 0:
            self._strike(queue, f"twice, {kept} messages were kept from its consumer behind a gap")

    def _strike(self, queue: str, seen: str) -> bool:
        """Count a starved holding of ``queue`` (``seen``: what the second one says was
        seen); the second within the window through the same connection moves it to another
        node (True), unless it has nowhere to go."""
        if not self._watch.starved(queue, time.monotonic(), self._link.reconnects):
            return False
        node = self._link.node or "its node"
        why = (
            f"queue {queue}: {seen}; RabbitMQ does not deliver it through {node} (a quorum "
            "queue sends through its replica on the consumer's node: that replica may be down)"
        )
        with about_queues([queue]):
            if self._link.single_node:
                log.error("%s. Only one RabbitMQ URL is set: list every node to move to", why)
                return False
            log.warning("%s. Moving this worker's connection to another node", why)
        with self._moves_lock:
            self.starved_moves += 1
        self._watch.forget()
        self._link.move(f"queue {queue} starved on {node}: moving to another node")
        return True


def _held_idle(ready: int) -> str:
    """What two idle starved holdings of a queue look like, ``ready`` messages waiting."""
    return f"held twice with nothing delivered while {ready} messages were ready"
