"""When a worker gives up a sequence gap early (a gone producer, a quiet queue, room in the
prefetch, no ready message), when it reopens a consumer for a gap that stays open, and what a
reopening keeps. Pure logic; real services in test_worker_sequencing and test_stuck_gaps."""

from __future__ import annotations

import time
from collections.abc import Iterable

from keyq.broker.envelope import HEADER_PRODUCER, HEADER_SEQ
from keyq.worker.amqp.deliveries import Delivery, DeliveryBuffer
from keyq.worker.holding.abandoned_gaps import QUIET_S, AbandonedGaps
from keyq.worker.holding.stuck_gaps import BUSY_FACTOR, StuckGaps

QUEUE = "keyq.s.k.acct"


def delivery(seq: int, epoch: int, at: float, producer: str = "p") -> Delivery:
    """Event ``seq`` of ``producer`` on consumer ``epoch`` of ``QUEUE``, arrived ``at``."""
    headers = {HEADER_PRODUCER: producer, HEADER_SEQ: seq}
    return Delivery(QUEUE, epoch, seq, False, headers, None, None, b"{}", received_at=at)


def parked(
    buffer: DeliveryBuffer, producer: str, seqs: Iterable[int], ago: float = QUIET_S
) -> None:
    """Deliveries of ``producer`` that arrived, and were parked, ``ago`` seconds ago."""
    at = time.monotonic() - ago
    for seq in seqs:
        buffer.add(delivery(seq, 1, at, producer))
    buffer.defer(buffer.take(100, 0.0, 0.0), now=at)  # what was parked before comes along


class Broker:
    def __init__(self, ready: int = 0, room: int | None = 100, running: Iterable[str] = ()) -> None:
        self.ready, self.room, self.running = ready, room, set(running)
        self.asked: list[str] = []
        self.reopened: list[str] = []

    def alive(self, ids: Iterable[str]) -> set[str]:
        return set(ids) & self.running

    def ready_count(self, queue: str) -> int:
        self.asked.append(queue)
        return self.ready

    def room_of(self, _queue: str) -> int | None:
        return self.room


def closer(
    buffer: DeliveryBuffer,
    broker: Broker,
    confirm_gone_s: float = 0.0,
    reopened_at: float | None = float("inf"),
) -> AbandonedGaps:
    # By default the queue's consumer counts as reopened since the gap opened.
    return AbandonedGaps(
        buffer,
        broker.alive,
        broker.ready_count,
        broker.room_of,
        confirm_gone_s,
        reopened_at=lambda _queue: reopened_at,
        reopen=broker.reopened.append,
    )


def test_a_gone_producers_parked_events_are_made_due_once_the_queue_is_drained() -> None:
    buffer = DeliveryBuffer(gap_timeout_s=60)
    parked(buffer, "gone", [3, 4])
    assert closer(buffer, Broker()).check() == 2
    # Due now: a take hands them back at once, as after the gap timeout.
    assert len(buffer.take(100, 0.0, 0.0)) == 2


def test_nothing_is_given_up_while_it_might_still_come() -> None:
    cases = {
        "producer still running": (Broker(running=["p"]), QUIET_S),
        "ready messages in the queue": (Broker(ready=1), QUIET_S),
        "the consumer's prefetch is full": (Broker(room=2), QUIET_S),
        "the queue is no longer held": (Broker(room=None), QUIET_S),
        "not quiet long enough": (Broker(), QUIET_S / 2),
    }
    for why, (broker, ago) in cases.items():
        buffer = DeliveryBuffer(gap_timeout_s=60)
        parked(buffer, "p", [3, 4], ago=ago)
        assert closer(buffer, broker).check() == 0, why
        assert buffer.take(100, 0.0, 0.0) == [], why


def test_only_the_gone_producers_events_are_made_due() -> None:
    buffer = DeliveryBuffer(gap_timeout_s=60)
    parked(buffer, "gone", [3])
    parked(buffer, "running", [7])
    assert closer(buffer, Broker(running=["running"])).check() == 1
    # The queue's parked deliveries come back together; only the gone producer's are due
    # (sequencing gives up a gap by its oldest waiting event).
    taken = buffer.take(100, 0.0, 0.0)
    overdue = time.monotonic() - 60
    assert {d.headers[HEADER_PRODUCER]: (d.deferred_since or 0) <= overdue for d in taken} == {
        "gone": True,
        "running": False,
    }


def test_checks_are_spaced_out() -> None:
    buffer = DeliveryBuffer(gap_timeout_s=60)
    parked(buffer, "p", [3])
    broker = Broker(ready=1)
    gaps = closer(buffer, broker)
    start = time.monotonic()
    for step in range(10):
        gaps.check(now=start + step * 0.05)
    assert len(broker.asked) == 1


def test_a_producer_must_stay_gone_a_while_before_it_counts() -> None:
    """A Redis that restarted without its data forgets a running producer until its next
    renewal: one look is not enough."""
    buffer = DeliveryBuffer(gap_timeout_s=60)
    parked(buffer, "p", [3])
    broker = Broker()
    gaps = closer(buffer, broker, confirm_gone_s=5.0)
    start = time.monotonic()
    assert gaps.check(now=start) == 0
    broker.running = {"p"}  # back: it was alive after all
    assert gaps.check(now=start + 3) == 0
    broker.running = set()
    assert gaps.check(now=start + 6) == 0  # gone again, but only since start + 6
    assert gaps.check(now=start + 10) == 0
    assert gaps.check(now=start + 11) == 1


def test_a_consumer_not_reopened_since_the_gap_opened_is_reopened_before_giving_up() -> None:
    # A message the broker counts as delivered to this consumer but never sent is not
    # "ready": only reopening the consumer brings it back, so that comes first.
    buffer = DeliveryBuffer(gap_timeout_s=60)
    parked(buffer, "gone", [3, 4])
    broker = Broker()
    assert closer(buffer, broker, reopened_at=None).check() == 0
    assert broker.reopened == [QUEUE]
    # Reopened before the events started waiting does not count either.
    broker.reopened.clear()
    assert closer(buffer, broker, reopened_at=time.monotonic() - 60).check() == 0
    assert broker.reopened == [QUEUE]
    # Reopened since: given up.
    assert closer(buffer, broker, reopened_at=time.monotonic()).check() == 2


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
    assert StuckGaps(DeliveryBuffer(), gap_timeout_s=4).reopen_after_s == 2  # a short timeout


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
    buffer.add_all([Delivery("other", 1, n, False, {}, None, None, b"{}") for n in range(20)])
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
