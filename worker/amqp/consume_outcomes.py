"""What became of a claim's consume, and how many claims go to the broker at once.

Pure: the broker's replies are read here, the broker is reached in ``keyq.worker.amqp.consuming``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import pika.exceptions

from keyq.broker.queue_refusals import QueueRefusal, classify

# Consumers opened per pipelined burst: a claim round's budget is checked between bursts. The
# first burst is small; the next ones are sized from the time a claim took in the last, so a
# broker slow to answer does not make one burst outlast the budget (and the locks held).
PIPELINE_DEPTH = 25
FIRST_BURST = 8


class ConsumeOutcome(enum.Enum):
    CONSUMING = "consuming"
    BUSY = "busy"  # another consumer holds it exclusively
    MISSING = "missing"  # the queue does not exist (deleted by the janitor)
    UNREACHABLE = "unreachable"  # its node is down (a classic queue on a cluster)
    FAILED = "failed"  # the channel or the connection failed while consuming
    NOT_TRIED = "not tried"  # the claim round's time ran out first


@dataclass(frozen=True)
class Consumed:
    outcome: ConsumeOutcome
    epoch: int = 0


def refused(refusal: pika.exceptions.ChannelClosedByBroker | None) -> ConsumeOutcome:
    """The outcome of a consume whose channel closed instead (``refusal`` is the broker's
    reason, None if it closed some other way): 403 is an exclusive consumer elsewhere, 404 a
    queue deleted or one whose node is down; anything else failed."""
    if refusal is not None and refusal.reply_code == 403:
        return ConsumeOutcome.BUSY
    if refusal is not None and refusal.reply_code == 404:
        if classify(404, str(refusal.reply_text)) is QueueRefusal.MISSING:
            return ConsumeOutcome.MISSING
        return ConsumeOutcome.UNREACHABLE
    return ConsumeOutcome.FAILED


def first_burst(budgeted: bool) -> int:
    """Claims in a round's first burst: small when the round has a time budget to keep."""
    return FIRST_BURST if budgeted else PIPELINE_DEPTH


def next_burst(elapsed_s: float, claims: int, time_left_s: float) -> int:
    """Claims in the next burst of a budgeted round, when the last burst of ``claims`` took
    ``elapsed_s``: as many as fit in the time left at that pace, at least one, at most
    ``PIPELINE_DEPTH``."""
    per_claim = max(elapsed_s / claims, 1e-4)
    return max(1, min(PIPELINE_DEPTH, int(time_left_s / per_claim)))
