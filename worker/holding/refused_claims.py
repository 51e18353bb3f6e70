"""Queues whose consume was refused, left alone for a while before they are tried again: how
long depends on why (another consumer still attached, the queue gone, its node down)."""

from __future__ import annotations

import logging

from keyq.worker.amqp.consume_rounds import ConsumeOutcome

log = logging.getLogger("keyq.worker.holding.claims")

# Queues that refused us (another consumer still attached) are left alone this long.
BUSY_BACKOFF_S = 1.0
# A registered queue that does not exist (deleted; the janitor forgets it) is left alone longer.
MISSING_BACKOFF_S = 30.0
# A queue whose node is down is tried again soon: its node may be back.
UNREACHABLE_BACKOFF_S = 2.0


class RefusedClaims:
    """Used by the claim loop's thread only."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}
        # Queues whose last consume was refused because their node is down: said once when
        # that starts and once when it ends, not on every retry.
        self._unreachable: set[str] = set()

    def waiting(self, queue: str, now: float) -> bool:
        """Still left alone after a refusal."""
        return self._until.get(queue, 0) > now

    def refused(self, queue: str, outcome: ConsumeOutcome, now: float) -> None:
        """Leave ``queue`` alone for as long as ``outcome`` says."""
        if outcome is ConsumeOutcome.MISSING:
            self._unreachable.discard(queue)
            backoff = MISSING_BACKOFF_S
        elif outcome in (ConsumeOutcome.UNREACHABLE, ConsumeOutcome.FAILED):
            if outcome is ConsumeOutcome.UNREACHABLE:
                self._note_unreachable(queue)
            backoff = UNREACHABLE_BACKOFF_S
        else:
            backoff = BUSY_BACKOFF_S
        self._until[queue] = now + backoff

    def consumed(self, queue: str) -> None:
        """``queue`` is consumed: if it was unreachable, say it is back."""
        if queue in self._unreachable:
            self._unreachable.discard(queue)
            log.info("queue %s is reachable again", queue)

    def _note_unreachable(self, queue: str) -> None:
        if queue not in self._unreachable:
            self._unreachable.add(queue)
            log.warning(
                "queue %s is unreachable (its node or queue process is down); trying it "
                "every %.0f s",
                queue,
                UNREACHABLE_BACKOFF_S,
            )
