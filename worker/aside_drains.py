"""Draining the queues a key's events waited in aside, once the key may flow again.

The worker that holds a key's queue is the only one that sets the key's events aside, and
the only one that drains them (``keyq.broker.key_control``): so between two of its batches
nothing is being set aside, and a side queue found empty stays empty. Each step, for each
key with queues aside whose queue this worker holds and which is not stopped, the head of
its list is consumed under that queue's lease. When the head is drained (nothing of it
buffered here, nothing ready in it and no consumer but ours, and still nothing after our
consumer is closed, which hands back anything unacked), it is deleted, then dropped from the
list, fenced by the lease; a listed queue found missing is dropped too. The next one is
consumed on a later step. Once the list is empty the key's events in its own
queue apply directly again (``keyq.worker.key_gate``).

Runs on the batch loop's thread, between batches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from keyq.broker.key_control import KeyControl, KeyStatus
from keyq.broker.naming import base_queue_name
from keyq.worker.consumer import ConsumeOutcome, ConsumerLink
from keyq.worker.deliveries import DeliveryBuffer
from keyq.worker.held_queues import HeldQueues

log = logging.getLogger("keyq.worker")

STEP_EVERY_S = 0.25
CLOSE_SETTLE_TRIES = 20  # at most a second for a closed consumer to leave the counts
CLOSE_SETTLE_S = 0.05


class AsideDrains:
    """Drains side queues for one worker; ``wanted`` is read by the claim loop too."""

    def __init__(
        self,
        *,
        control: KeyControl,
        held: HeldQueues,
        link: ConsumerLink,
        buffer: DeliveryBuffer,
        queue_of_key: Callable[[str], str],
        every_s: float = STEP_EVERY_S,
    ) -> None:
        self._control = control
        self._held = held
        self._link = link
        self._buffer = buffer
        self._queue_of_key = queue_of_key
        self._every_s = every_s
        self._stepped_at = 0.0
        # The (base) queues of keys that have queues aside and may flow: a worker claims them
        # even when they are quiet, or nobody would drain what waits aside.
        self.wanted: frozenset[str] = frozenset()

    def step(self) -> None:
        """One round, at most every ``every_s``; Redis or broker errors are the caller's."""
        now = time.monotonic()
        if now - self._stepped_at < self._every_s:
            return
        self._stepped_at = now
        aside = self._control.keys_aside()
        statuses = self._control.statuses(aside) if aside else {}
        flowing = {
            key: queues
            for key, queues in aside.items()
            if queues and not statuses.get(key, KeyStatus()).stopped
        }
        self.wanted = frozenset(self._queue_of_key(key) for key in flowing)
        held = {base_queue_name(queue): queue for queue in self._held.queues()}
        heads: dict[str, tuple[str, str]] = {}  # side queue -> (key, held queue)
        for key, queues in flowing.items():
            main = held.get(self._queue_of_key(key))
            if main is not None:
                heads[queues[0]] = (key, main)
        attached = self._held.sides()
        for side in attached:
            if side not in heads:
                self._held.detach(side)  # stopped again, or no longer the head
        for side, (key, main) in heads.items():
            if side not in attached:
                outcome = self._held.attach(side, main)
                if outcome is ConsumeOutcome.CONSUMING:
                    log.info("draining %s, set aside for key %r", side, key)
                elif outcome is ConsumeOutcome.MISSING:
                    self._forget(side, key, main)  # deleted by a drain that stopped short
                continue
            self._finish_if_drained(side, key, main)

    def _finish_if_drained(self, side: str, key: str, main: str) -> None:
        """Delete ``side`` and drop it from the key's list once nothing is left in it. It is
        deleted first: a list never names a queue that was dropped but still holds events."""
        if self._buffer.depth(side) or self._link.queue_counts(side) != (0, 1):
            return  # events buffered or ready; or not our consumer alone (a zombie's too)
        self._held.detach(side)
        if self._counts_after_close(side) != (0, 0):
            return  # something came back when the consumer closed: attach again next step
        if not self._link.delete_drained(side):
            return  # not empty after all: attach again next step
        self._forget(side, key, main)

    def _counts_after_close(self, side: str) -> tuple[int, int]:
        """The side queue's counts once our closed consumer is gone from them: a quorum
        queue (RabbitMQ 4) takes the close asynchronously, so its count lags a moment."""
        counts = self._link.queue_counts(side)
        for _ in range(CLOSE_SETTLE_TRIES):
            if counts[1] == 0:
                break
            time.sleep(CLOSE_SETTLE_S)
            counts = self._link.queue_counts(side)
        return counts

    def _forget(self, side: str, key: str, main: str) -> None:
        holding = self._held.get(main)
        if holding is None:
            return  # the new holder of the key's queue finds it gone and forgets it
        left = self._control.drop_aside(key, holding.lease, side)
        if left is None:
            return  # the lease moved on: the same
        log.info(
            "drained %s for key %r; %s",
            side,
            key,
            f"{len(left)} more aside" if left else "its events apply directly again",
        )
