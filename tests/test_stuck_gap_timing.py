"""When a worker reopens a consumer for a gap that stays open, and what a reopening keeps
(pure logic on the delivery buffer; the broker side is in tests/test_stuck_gaps.py)."""

from __future__ import annotations

import time

from keyq.broker.envelope import HEADER_PRODUCER, HEADER_SEQ
from keyq.worker.amqp.deliveries import Delivery, DeliveryBuffer
from keyq.worker.holding.abandoned_gaps import QUIET_S
from keyq.worker.holding.stuck_gaps import BUSY_FACTOR, StuckGaps
from tests.test_abandoned_gaps import QUEUE, parked


def delivery(seq: int, epoch: int, at: float) -> Delivery:
    """Event ``seq`` of producer ``p``, as ``parked`` builds them, on consumer ``epoch``."""
    headers = {HEADER_PRODUCER: "p", HEADER_SEQ: seq}
    return Delivery(QUEUE, epoch, seq, False, headers, None, None, b"{}", received_at=at)


def test_a_queue_is_reopened_once_its_gap_waited_and_it_went_quiet_then_not_again_at_once() -> None:
    buffer = DeliveryBuffer(gap_timeout_s=60)
    stuck = StuckGaps(buffer, gap_timeout_s=60)
    parked(buffer, "p", [3, 4], ago=stuck.reopen_after_s - 1)
    now = time.monotonic()
    assert stuck.due(now) == []  # not waited long enough
    assert stuck.due(now + 1) == [QUEUE]
    stuck.note_reopened(QUEUE, now + 1)
    assert stuck.due(now + 2) == []
    assert stuck.due(now + 1 + stuck.reopen_after_s) == [QUEUE]


def test_a_queue_still_receiving_is_reopened_only_once_its_gap_waited_longer() -> None:
    """A busy bucket is never quiet: its gap still gets a reopening, well within the
    gap timeout, or a message the broker withholds comes back only to be dead-lettered."""
    buffer = DeliveryBuffer(gap_timeout_s=60)
    stuck = StuckGaps(buffer, gap_timeout_s=60)
    busy_after = stuck.reopen_after_s * BUSY_FACTOR
    parked(buffer, "p", [3], ago=busy_after - 1)
    now = time.monotonic()
    buffer.add(delivery(9, 1, now - QUIET_S / 2))  # something arrived just now
    assert not stuck.quiet(QUEUE, now)
    assert stuck.due(now) == []  # a quiet queue would be due: waited reopen_after_s
    buffer.add(delivery(10, 1, now + 1 - QUIET_S / 2))
    assert stuck.due(now + 1) == [QUEUE]
    assert busy_after < 60 - stuck.reopen_after_s  # time for a second one before the timeout


def test_a_short_gap_timeout_reopens_sooner() -> None:
    assert StuckGaps(DeliveryBuffer(), gap_timeout_s=4).reopen_after_s == 2


def test_a_reopened_consumers_redeliveries_keep_waiting_from_when_they_first_did() -> None:
    """Otherwise every reopening would restart the gap's timeout."""
    buffer = DeliveryBuffer(gap_timeout_s=60)
    parked(buffer, "p", [3, 4], ago=20)
    first = buffer.deferred_items()[QUEUE][0].deferred_since
    assert first is not None
    assert buffer.drop(QUEUE, 1, keep_waits=True) == 2
    redelivered = delivery(3, 2, time.monotonic())
    buffer.add(redelivered)
    assert redelivered.deferred_since == first
    # A queue handed back (no keep_waits) forgets them: another worker starts afresh.
    buffer.drop(QUEUE)
    again = delivery(4, 3, time.monotonic())
    buffer.add(again)
    assert again.deferred_since is None


def test_a_gap_due_takes_all_of_its_queue_buffered_here_so_its_filler_is_not_left_behind() -> None:
    """The batch that gives a gap up must see every event of its queue that arrived: the one
    that fills it may sit past the queue's share of a batch (a deep prefetch, backed up), and
    taken one batch later it would be late, dead-lettered. Another queue keeps its share."""
    buffer = DeliveryBuffer(gap_timeout_s=60)
    parked(buffer, "p", [5, 6], ago=61)  # due: waited past the gap timeout
    now = time.monotonic()
    buffer.add_all([delivery(100 + n, 1, now) for n in range(20)])  # others of its queue
    buffer.add(delivery(4, 1, now))  # the gap's event, behind them
    other = [
        Delivery("other", 1, n, False, {}, None, None, b"{}", received_at=now) for n in range(20)
    ]
    buffer.add_all(other)
    batch = buffer.take(max_events=10, max_wait_s=0, idle_wait_s=0)
    seqs = {d.headers[HEADER_SEQ] for d in batch if d.queue == QUEUE}
    assert {4, 5, 6} <= seqs and len(seqs) == 23
    assert sum(d.queue == "other" for d in batch) < 10  # its share, not all of it
    assert buffer.depth(QUEUE) == 0
    # Not due: a queue gives a batch its share only, and its waiting events rejoin it.
    buffer = DeliveryBuffer(gap_timeout_s=60)
    parked(buffer, "p", [5, 6], ago=1)
    buffer.add_all([delivery(100 + n, 1, now) for n in range(20)])
    batch = buffer.take(max_events=10, max_wait_s=0, idle_wait_s=0)
    assert len(batch) == 12 and buffer.depth(QUEUE) == 10
