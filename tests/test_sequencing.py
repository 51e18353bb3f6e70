"""Per-key order rebuilt from (producer, seq), fed the orders brokers and producers really
deliver in; when a worker gives a gap up early or reopens a consumer for it, and what a
reopening keeps. Pure logic; real services in test_worker_sequencing."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable

from hypothesis import given, settings
from hypothesis import strategies as st

from keyq.broker.envelope import HEADER_PRODUCER, HEADER_SEQ
from keyq.worker.amqp.deliveries import Delivery, DeliveryBuffer
from keyq.worker.batch.marks import KeyMarks
from keyq.worker.batch.sequencing import Identified, plan_batch
from keyq.worker.holding.abandoned_gaps import QUIET_S, AbandonedGaps
from keyq.worker.holding.stuck_gaps import BUSY_FACTOR, StuckGaps
from tests.helpers import plain_delivery


def event(seq: int, key: str = "k", producer: str = "p", since: float | None = None) -> Identified:
    return Identified(key, producer, seq, deferred_since=since)


def seqs_of(items: list[Identified], indices: list[int]) -> list[int | None]:
    return [items[i].seq for i in indices]


def test_quorum_redelivery_order_is_applied_once_and_in_order() -> None:
    """A quorum queue hands a cancelled consumer's unacked 1..10 back after 11..20. Taken
    in delivery order, 11..20 would be applied and 1..10 then skipped as already seen."""
    items = [event(seq) for seq in [*range(11, 21), *range(1, 11)]]
    plan = plan_batch(items, {}, now=0.0, gap_timeout_s=60.0)
    assert seqs_of(items, plan.apply) == list(range(1, 21))
    assert plan.duplicates == [] and plan.deferred == [] and plan.late == []
    assert plan.marks["k"].seqs == {"p": 20}
    assert plan.marks["k"].applied == 20


def test_events_behind_a_gap_wait_across_batches_then_apply_in_order() -> None:
    first = [event(seq) for seq in range(11, 21)]
    plan = plan_batch(first, {}, now=100.0, gap_timeout_s=60.0)
    assert plan.apply == [] and seqs_of(first, plan.deferred) == list(range(11, 21))
    [gap] = plan.open_gaps
    assert (gap.key, gap.producer, gap.first, gap.last, gap.size) == ("k", "p", 1, 10, 10)
    assert plan.marks["k"].seqs == {}  # nothing applied

    # The parked events come back with the next batch, beside the ones they waited for.
    parked = [event(seq, since=100.0) for seq in range(11, 21)]
    second = parked + [event(seq) for seq in range(1, 11)]
    plan = plan_batch(second, {}, now=101.0, gap_timeout_s=60.0)
    assert seqs_of(second, plan.apply) == list(range(1, 21))
    assert plan.deferred == [] and plan.open_gaps == []


def test_re_sent_older_events_behind_newer_ones_are_not_lost() -> None:
    """A producer re-sends events the broker returned (a leader election) behind newer ones
    that were routed meanwhile: 1..3, 7..9, then the re-sent 4..6, then 7..9 again."""
    marks = {"k": KeyMarks(seqs={"p": 0})}
    order = [1, 2, 3, 7, 8, 9, 4, 5, 6, 7, 8, 9, 10]
    items = [event(seq) for seq in order]
    plan = plan_batch(items, marks, now=0.0, gap_timeout_s=60.0)
    assert seqs_of(items, plan.apply) == list(range(1, 11))
    assert seqs_of(items, plan.duplicates) == [7, 8, 9]
    # A copy of an event already waiting is a duplicate too.
    items = [event(5), event(5), event(6)]
    plan = plan_batch(items, {"k": KeyMarks(seqs={"p": 3})}, now=0.0, gap_timeout_s=60.0)
    assert plan.apply == []
    assert plan.deferred == [0, 2] and plan.duplicates == [1]


def test_producers_and_keys_are_sequenced_apart() -> None:
    items = [
        event(2, key="a", producer="p"),  # waits for a/p 1
        event(1, key="a", producer="q"),
        event(1, key="b", producer="p"),  # b is another key: p's mark on a does not count
        event(1, key="a", producer="p"),
        event(3, key="a", producer="q"),  # waits for a/q 2
    ]
    plan = plan_batch(items, {}, now=0.0, gap_timeout_s=60.0)
    assert plan.apply == [1, 2, 3, 0]
    assert plan.deferred == [4]
    assert plan.marks["a"].seqs == {"q": 1, "p": 2}
    assert plan.marks["b"].seqs == {"p": 1}


def test_events_without_identity_are_applied_as_they_come() -> None:
    items = [Identified("k", None, None), event(3), Identified("k", None, None)]
    plan = plan_batch(items, {"k": KeyMarks(seqs={"p": 1})}, now=0.0, gap_timeout_s=60.0)
    assert plan.apply == [0, 2] and plan.deferred == [1]
    assert plan.marks["k"].applied == 2


def test_a_gap_open_past_the_timeout_is_given_up_reported_and_remembered() -> None:
    waited = [event(seq, since=10.0) for seq in (4, 5, 8)]
    plan = plan_batch(waited[:2], {"k": KeyMarks(seqs={"p": 2})}, now=69.0, gap_timeout_s=60.0)
    assert plan.apply == [] and plan.skipped_gaps == []  # younger than the timeout: waits
    assert [(g.first, g.last, g.since) for g in plan.open_gaps] == [(3, 3, 10.0)]
    plan = plan_batch(waited, {"k": KeyMarks(seqs={"p": 2})}, now=70.5, gap_timeout_s=60.0)
    # 3 is given up: 4, 5 apply; 6..7 is a second gap, as old as the events behind it.
    assert seqs_of(waited, plan.apply) == [4, 5, 8]
    assert [(g.first, g.last) for g in plan.skipped_gaps] == [(3, 3), (6, 7)]
    marks = plan.marks["k"]
    assert marks.seqs == {"p": 8}
    assert marks.gaps == {"p": [[3, 3], [6, 7]]}

    # The marks survive a commit; a late 3 or 7 is dead-lettered, a re-sent 4 is skipped.
    marks = KeyMarks.from_json(marks.to_json())
    late = [event(3), event(4), event(7), event(9)]
    plan = plan_batch(late, {"k": marks}, now=71.0, gap_timeout_s=60.0)
    assert seqs_of(late, plan.late) == [3, 7]
    assert seqs_of(late, plan.duplicates) == [4]
    assert seqs_of(late, plan.apply) == [9]


def test_gap_memory_is_bounded_and_forgotten_with_its_producer() -> None:
    marks = KeyMarks()
    for n in range(20):
        marks.skip("p", 10 * n + 1, 10 * n + 2)
    assert len(marks.gaps["p"]) == 8
    assert marks.skipped("p", 192) and not marks.skipped("p", 2)
    for n in range(300):
        marks.advance(f"other-{n}", 1)
    assert "p" not in marks.seqs and "p" not in marks.gaps


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=1, max_value=40),
    st.integers(min_value=1, max_value=6),
    st.randoms(use_true_random=False),
)
def test_any_delivery_order_split_in_any_batches_applies_each_event_once_in_order(
    count: int, batches: int, rng: random.Random
) -> None:
    """Deliveries in any order, with duplicates, cut into batches whose waiting events
    rejoin the next: every seq is applied exactly once, in order, and none is late."""
    order = [seq for seq in range(1, count + 1) for _ in range(rng.choice([1, 1, 2]))]
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, len(order)), min(batches - 1, len(order) - 1)))
    chunks = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)], strict=True)]
    marks: dict[str, KeyMarks] = {}
    applied: list[int | None] = []
    parked: list[Identified] = []
    for chunk in chunks:
        items = parked + [event(seq) for seq in chunk]
        plan = plan_batch(items, marks, now=0.0, gap_timeout_s=60.0)
        assert plan.late == []
        applied += seqs_of(items, plan.apply)
        parked = [items[i] for i in plan.deferred]
        marks = {key: KeyMarks.from_json(m.to_json()) for key, m in plan.marks.items()}
    assert applied == list(range(1, count + 1))
    assert parked == []


def test_parked_deliveries_do_not_crowd_out_the_events_they_wait_for() -> None:
    buffer = DeliveryBuffer(gap_timeout_s=60.0)
    for tag in range(1, 4):
        buffer.add(plain_delivery("q", tag))
    waiting = buffer.take(3, 0.0, 0.0)
    parked_at = time.monotonic()
    buffer.defer(waiting, now=parked_at)
    assert len(buffer) == 0 and buffer.deferred() == 3 and buffer.depth("q") == 3
    assert buffer.take(2, 0.0, 0.0) == []  # nothing ready, and no gap due yet

    buffer.add(plain_delivery("q", 4))
    buffer.add(plain_delivery("q", 5))
    again = buffer.take(1, 0.0, 0.0)
    # The parked three rejoin their queue, beside the one ready event the quota allows.
    assert [d.delivery_tag for d in again] == [1, 2, 3, 4]
    assert [d.deferred_since for d in again] == [parked_at] * 3 + [None]
    assert buffer.deferred() == 0 and len(buffer) == 1


def test_a_due_gap_brings_its_parked_deliveries_back_on_their_own() -> None:
    buffer = DeliveryBuffer(gap_timeout_s=0.05)
    buffer.add(plain_delivery("q", 1))
    buffer.defer(buffer.take(1, 0.0, 0.0))
    assert buffer.take(5, 0.0, 0.0) == []
    back = buffer.take(5, 0.0, 1.0)  # waits for the gap to come due, not for the 1 s
    assert [d.delivery_tag for d in back] == [1]


def test_dropping_a_queue_forgets_its_parked_deliveries_of_that_consumer() -> None:
    buffer = DeliveryBuffer()
    buffer.add(plain_delivery("q", 1, epoch=1))
    buffer.defer(buffer.take(1, 0.0, 0.0))
    buffer.add(plain_delivery("q", 1, epoch=2))
    buffer.defer(buffer.take(1, 0.0, 0.0))
    assert buffer.drop("q", channel_epoch=1) == 1
    assert buffer.deferred("q") == 1
    assert buffer.drop("q") == 1
    assert buffer.deferred() == 0 and buffer.depth("q") == 0


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
