"""Draining the queues a key's events waited in aside, once the key may flow again.

The worker that holds a key's queue is the only one that sets the key's events aside, and
the only one that drains them (``keyq.broker.key_control``): so between two of its batches
nothing is being set aside, and an aside queue found empty stays empty. Each step, for each
key with queues aside whose queue this worker holds and which is not stopped, the head of
its list is consumed under that queue's lease. When the head is drained (nothing of it
buffered here, nothing ready in it and no consumer but ours, and still nothing after our
consumer is closed, which hands back anything unacked), it is deleted, then dropped from the
list, fenced by the lease; a listed queue found missing is dropped too. The next one is
consumed on a later step. Once the list is empty the key's events in its own
queue apply directly again (``keyq.worker.batch.key_gate``).

The aside queues being drained are consumed under the lease of the key's queue and end with
it (``HeldQueues`` ends them through ``end``). ``step`` runs on the batch loop's thread,
between batches; ``end`` and ``gone`` on either loop's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

from keyq.broker.errors import KeyqError
from keyq.broker.key_control import KeyControl, KeyStatus
from keyq.broker.locks import Lease
from keyq.broker.naming import base_queue_name
from keyq.broker.queue_probe import QueueCounts
from keyq.worker.amqp.consume_rounds import ConsumeOutcome
from keyq.worker.amqp.dead_letters import DeadLetterCalls
from keyq.worker.amqp.deliveries import DeliveryBuffer
from keyq.worker.amqp.link import ConsumerCalls, QueueCounter
from keyq.worker.amqp.queue_channels import ConsumerGone
from keyq.worker.holding.held_index import Held, Holdings
from keyq.worker.holding.held_queues import HeldQueues

log = logging.getLogger("keyq.worker")

STEP_EVERY_S = 0.25
CLOSE_SETTLE_TRIES = 20  # at most a second for a closed consumer to leave the counts
CLOSE_SETTLE_S = 0.05
_DRAINED = QueueCounts(0, 1)  # nothing ready, our consumer alone
_GONE = QueueCounts(0, 0)


class AsideDrains:
    """Drains aside queues for one worker; ``wanted`` is read by the claim loop too."""

    def __init__(
        self,
        *,
        control: KeyControl,
        consumers: ConsumerCalls,
        counts: QueueCounter,
        dead_letters: DeadLetterCalls,
        buffer: DeliveryBuffer,
        queue_of_key: Callable[[str, KeyStatus], str | None],
        every_s: float = STEP_EVERY_S,
    ) -> None:
        self._control = control
        self._consumers = consumers
        self._counts = counts
        self._dead_letters = dead_letters
        self._buffer = buffer
        self._queue_of_key = queue_of_key
        self._every_s = every_s
        self._stepped_at = 0.0
        # Aside queues consumed now, each under the lease of the held queue it drains for.
        self._attached = Holdings()
        # The (base) queues of keys that have queues aside and may flow: a worker claims them
        # even when they are quiet, or nobody would drain what waits aside.
        self.wanted: frozenset[str] = frozenset()

    def step(self, held: HeldQueues) -> None:
        """One round, at most every ``every_s``; Redis or broker errors are the caller's."""
        now = time.monotonic()
        if now - self._stepped_at < self._every_s:
            return
        self._stepped_at = now
        aside = self._control.keys_aside()
        statuses = self._control.statuses(aside) if aside else {}
        # The keys that may flow, with the queue whose holder drains them (none while the key
        # moves to a queue of its own: ``broker.routes``).
        flowing: dict[str, tuple[list[str], str]] = {}
        for key, queues in aside.items():
            status = statuses.get(key, KeyStatus())
            applying = self._queue_of_key(key, status)
            if queues and not status.stopped and applying is not None:
                flowing[key] = (queues, applying)
        self.wanted = frozenset(applying for _, applying in flowing.values())
        by_base = {base_queue_name(queue): queue for queue in held.queues()}
        heads: dict[str, tuple[str, str]] = {}  # aside queue -> (key, held queue)
        for key, (queues, applying) in flowing.items():
            main = by_base.get(applying)
            if main is not None:
                heads[queues[0]] = (key, main)
        attached = set(self._attached.queues())
        for queue in attached - heads.keys():
            self.detach(queue)  # stopped again, or no longer the head
        for queue, (key, main) in heads.items():
            if queue in attached:
                self._finish_if_drained(held, queue, key, main)
                continue
            outcome = self._attach(held, queue, main)
            if outcome is ConsumeOutcome.CONSUMING:
                log.info("draining %s, set aside for key %r", queue, key)
            elif outcome is ConsumeOutcome.MISSING:
                self._forget(held, queue, key, main)  # deleted by a drain that stopped short

    def _attach(self, held: HeldQueues, queue: str, main: str) -> ConsumeOutcome | None:
        """Consume aside ``queue`` under the lease of held queue ``main``, with an exclusive
        consumer. How the consume went (CONSUMING: attached now; MISSING: the queue is gone;
        else try later: a zombie's consumer is still on it); None if ``main`` is not held."""
        holding = held.get(main)
        if holding is None:
            return None
        attached = Held(queue=queue, lease=holding.lease, epoch=self._consumers.new_epoch())
        self._attached.add(attached)
        try:
            outcome = self._consumers.consume(queue, attached.epoch).outcome
        except KeyqError:
            self.detach(queue)
            raise
        if outcome is not ConsumeOutcome.CONSUMING or main not in held:
            self.detach(queue)  # refused, or its lease ended meanwhile
        return outcome

    def detach(self, queue: str) -> None:
        """Stop consuming aside ``queue``: close its consumer (its unacked deliveries go back
        to it, in order), then drop what of it is buffered."""
        attached = self._attached.remove(queue)
        if attached is not None:
            self._consumers.close_queue(queue, attached.epoch)
            self._buffer.drop(queue, attached.epoch)

    def lease_for(self, queue: str, epoch: int) -> Lease | None:
        return self._attached.lease_for(queue, epoch)

    def end(self, leases: Collection[Lease]) -> None:
        """The holdings of ``leases`` ended: so do the aside queues drained under them."""
        ended = [
            held
            for held in self._attached.all()
            if held.lease in leases and self._attached.remove(held.queue, held.epoch)
        ]
        if ended:
            self._consumers.close_queues([(held.queue, held.epoch) for held in ended])
            for held in ended:
                self._buffer.drop(held.queue, held.epoch)

    def gone(self, event: ConsumerGone) -> bool:
        """The broker took an aside queue's consumer away: forget it (attached again next
        step); False if it is not one of ours."""
        if self._attached.remove(event.queue, event.epoch) is None:
            return False
        self._buffer.drop(event.queue, event.epoch)
        return True

    def draining(self) -> set[str]:
        """The held queues whose keys' aside queues are being drained."""
        return {held.lease.queue for held in self._attached.all()}

    def _finish_if_drained(self, held: HeldQueues, queue: str, key: str, main: str) -> None:
        """Delete ``queue`` and drop it from the key's list once nothing is left in it. It is
        deleted first: a list never names a queue that was dropped but still holds events."""
        if self._buffer.depth(queue) or self._counts.counts(queue) != _DRAINED:
            return  # events buffered or ready; or not our consumer alone (a zombie's too)
        self.detach(queue)
        if self._counts_after_close(queue) != _GONE:
            return  # something came back when the consumer closed: attach again next step
        if not self._dead_letters.delete_drained(queue):
            return  # not empty after all: attach again next step
        self._forget(held, queue, key, main)

    def _counts_after_close(self, queue: str) -> QueueCounts:
        """The aside queue's counts once our closed consumer is gone from them: a quorum
        queue (RabbitMQ 4) takes the close asynchronously, so its count lags a moment."""
        counts = self._counts.counts(queue)
        for _ in range(CLOSE_SETTLE_TRIES):
            if counts.consumers == 0:
                break
            time.sleep(CLOSE_SETTLE_S)
            counts = self._counts.counts(queue)
        return counts

    def _forget(self, held: HeldQueues, queue: str, key: str, main: str) -> None:
        holding = held.get(main)
        if holding is None:
            return  # the new holder of the key's queue finds it gone and forgets it
        left = self._control.drop_aside(key, holding.lease, queue)
        if left is None:
            return  # the lease moved on: the same
        log.info(
            "drained %s for key %r; %s",
            queue,
            key,
            f"{len(left)} more aside" if left else "its events apply directly again",
        )
