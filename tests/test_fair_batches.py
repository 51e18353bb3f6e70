"""Fair batches: with more ready events than one batch holds, ``DeliveryBuffer.take`` shares
half of each batch evenly among the queues, so no queue starves behind busy ones, and gives
the other half to the oldest events, so a queue left behind catches up.

The bound: with ``Q`` queues in the buffer and batches of ``B`` events, a queue with ready
deliveries at a take is served by that take or one of the ``ceil(Q / E) - 1`` after it (one
batch cycle), where ``E = ceil(B / 2)`` is the even half; when ``Q <= E`` that is every batch,
whatever ages the events claim. Pure logic, no services.
"""

from __future__ import annotations

import math
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyq.broker.envelope import HEADER_PUBLISHED_AT, HEADER_REDRIVE_ID
from keyq.worker.amqp.deliveries import Delivery, DeliveryBuffer
from tests.test_worker_units import delivery


def names(count: int) -> list[str]:
    return [f"q{index:02d}" for index in range(count)]


def filled(queues: list[str], depth: int) -> DeliveryBuffer:
    """A buffer whose queues each hold ``depth`` deliveries, tags 1..depth, interleaved."""
    buffer = DeliveryBuffer()
    for tag in range(1, depth + 1):
        for queue in queues:
            buffer.add(delivery(queue, tag))
    return buffer


def cycle(queue_count: int, batch: int) -> int:
    """Takes within which a queue with ready events is served."""
    return math.ceil(queue_count / (batch - batch // 2))


def take(buffer: DeliveryBuffer, max_events: int) -> list[Delivery]:
    return buffer.take(max_events, max_wait_s=0.0, idle_wait_s=0.0)


def served_by_queue(batches: list[list[Delivery]]) -> dict[str, list[int]]:
    by_queue: dict[str, list[int]] = {}
    for batch in batches:
        for item in batch:
            by_queue.setdefault(item.queue, []).append(item.delivery_tag)
    return by_queue


def assert_served_within_a_cycle(
    ready_before: list[set[str]], batches: list[list[Delivery]], cycles: list[int]
) -> None:
    """Each queue ready before take ``i`` is in one of takes ``i .. i + cycles[i] - 1``."""
    served = [{item.queue for item in batch} for batch in batches]
    for index, (ready, takes) in enumerate(zip(ready_before, cycles, strict=True)):
        window = set().union(*served[index : index + takes])
        starved = ready - window
        assert not starved, f"take {index}: {sorted(starved)} not served within {takes} takes"


class Recorder:
    """Takes batches and notes, before each, which queues were ready and the cycle then."""

    def __init__(self, buffer: DeliveryBuffer, batch: int) -> None:
        self.buffer = buffer
        self.batch = batch
        self.added: Counter[str] = Counter()
        self.taken: Counter[str] = Counter()
        self.batches: list[list[Delivery]] = []
        self.ready_before: list[set[str]] = []
        self.cycles: list[int] = []

    def add(self, queue: str, count: int, published_ms: int | None = None) -> None:
        headers = {} if published_ms is None else {HEADER_PUBLISHED_AT: published_ms}
        for _ in range(count):
            self.added[queue] += 1
            self.buffer.add(delivery(queue, self.added[queue], headers=dict(headers)))

    def take(self) -> None:
        self.ready_before.append({q for q in self.added if self.taken[q] < self.added[q]})
        self.cycles.append(cycle(len(self.added), self.batch))
        ready = len(self.buffer)
        batch = take(self.buffer, self.batch)
        assert len(batch) == min(self.batch, ready), "a take fills its batch from what is ready"
        self.taken.update(item.queue for item in batch)
        self.batches.append(batch)

    def take_all_and_check(self) -> None:
        """Take until the buffer is empty: each queue was served within a cycle, and its
        deliveries arrived in order across takes, none lost, none twice."""
        while len(self.buffer):
            self.take()
        # The buffer ends empty, so a window cut short by the end still holds every turn.
        assert_served_within_a_cycle(self.ready_before, self.batches, self.cycles)
        expected = {queue: list(range(1, n + 1)) for queue, n in self.added.items()}
        assert served_by_queue(self.batches) == expected


@pytest.mark.parametrize(("queue_count", "batch"), [(16, 5), (16, 16), (17, 4), (4, 10), (3, 7)])
def test_saturated_queues_are_all_served_within_one_cycle(queue_count: int, batch: int) -> None:
    recorder = Recorder(DeliveryBuffer(), batch)
    for _ in range(4 * batch):  # many more ready deliveries than one batch holds, in every queue
        for queue in names(queue_count):
            recorder.add(queue, 1)
    recorder.take_all_and_check()


def test_queues_that_fit_share_each_batch_evenly() -> None:
    queues = names(4)
    buffer = filled(queues, 40)
    for _ in range(5):
        counts = taken_counts(buffer, 10)
        assert set(counts) == set(queues)
        assert max(counts.values()) - min(counts.values()) <= 1


def test_a_short_queue_leaves_its_share_to_the_others() -> None:
    buffer = filled(names(3), 2)
    for tag in range(3, 21):
        buffer.add(delivery("q02", tag))
    taken = take(buffer, 12)
    assert Counter(item.queue for item in taken) == {"q00": 2, "q01": 2, "q02": 8}
    assert [item.delivery_tag for item in taken if item.queue == "q02"] == list(range(1, 9))


def test_a_queue_that_arrives_late_is_served_within_a_cycle() -> None:
    buffer = filled(names(10), 50)
    take(buffer, 4)
    buffer.add(delivery("late", 1))
    later = [take(buffer, 4) for _ in range(cycle(11, 4))]
    assert "late" in {item.queue for batch in later for item in batch}


def test_a_put_back_batch_keeps_each_queues_order() -> None:
    queues = names(6)
    buffer = filled(queues, 10)
    buffer.put_back(take(buffer, 4))  # a batch that could not be committed comes back
    batches: list[list[Delivery]] = []
    while len(buffer):
        batches.append(take(buffer, 4))
    assert served_by_queue(batches) == {queue: list(range(1, 11)) for queue in queues}


# One step: add ``count`` deliveries to queue ``index`` that claim to have been published at
# a time (or say nothing: their arrival counts), or (count 0) take a batch. The claimed times
# are any, as producers' clocks may be: none may starve a queue or reorder one.
steps = st.lists(
    st.tuples(
        st.integers(0, 11),
        st.integers(0, 9),
        st.none() | st.integers(1_700_000_000_000, 1_700_000_100_000),
    ),
    min_size=1,
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(steps=steps, batch=st.integers(1, 12))
def test_any_interleaving_of_adds_and_takes_is_fair_and_loses_nothing(
    steps: list[tuple[int, int, int | None]], batch: int
) -> None:
    recorder = Recorder(DeliveryBuffer(), batch)
    for index, count, published_ms in steps:
        if count:
            recorder.add(f"q{index:02d}", count, published_ms)
        elif len(recorder.buffer):
            recorder.take()
    recorder.take_all_and_check()


def taken_counts(buffer: DeliveryBuffer, max_events: int) -> Counter[str]:
    return Counter(item.queue for item in take(buffer, max_events))


def test_a_capped_queue_gives_a_shared_batch_at_most_its_cap_and_alone_all() -> None:
    """Auto mode caps a promoted key's own queue in batches it shares with other queues."""
    buffer = DeliveryBuffer(shared_cap=lambda queue, others: 100 if queue == "hot" else None)
    buffer.add_all([delivery("hot", tag) for tag in range(1, 1001)])
    buffer.add_all([delivery("bucket", tag) for tag in range(1, 31)])
    assert taken_counts(buffer, 5000) == {"hot": 100, "bucket": 30}, "shared: capped"
    assert taken_counts(buffer, 5000) == {"hot": 900}, "nothing else waits: no cap"
    # The cap is told how many the other queues have: a promoted key may match them.
    buffer = DeliveryBuffer(
        shared_cap=lambda queue, others: max(100, others) if queue == "hot" else None
    )
    buffer.add_all([delivery("hot", tag) for tag in range(1, 3001)])
    for queue in ("b1", "b2"):
        buffer.add_all([delivery(queue, tag) for tag in range(1, 401)])
    assert taken_counts(buffer, 5000) == {"hot": 800, "b1": 400, "b2": 400}


def stamped(queue: str, tags: range, published_ms: int) -> list[Delivery]:
    return [delivery(queue, tag, headers={HEADER_PUBLISHED_AT: published_ms}) for tag in tags]


def test_a_queue_left_behind_gets_the_oldest_half_of_a_batch() -> None:
    """After a takeover one bucket holds events seconds older than the 60 others: at an even
    share of a batch it would catch up some 40 events a batch; oldest first, all it holds."""
    buffer = DeliveryBuffer()
    now_ms = 1_700_000_000_000
    buffer.add_all(stamped("behind", range(1, 1001), now_ms - 5_000))
    for queue in names(60):
        buffer.add_all(stamped(queue, range(1, 201), now_ms))
    counts = taken_counts(buffer, 5000)
    assert counts["behind"] == 1000
    assert set(counts) == {"behind", *names(60)}  # the even half still reaches every queue
    assert sum(counts.values()) == 5000


def test_the_oldest_half_follows_publish_times_across_queues() -> None:
    buffer = DeliveryBuffer()
    base = 1_700_000_000_000
    for tag in range(1, 101):  # a: 100 events 10 ms apart from base; b: the same, 5 ms later
        buffer.add_all(stamped("a", range(tag, tag + 1), base + 10 * tag))
        buffer.add_all(stamped("b", range(tag, tag + 1), base + 10 * tag + 5))
    buffer.add_all(stamped("c", range(1, 101), base + 10_000))  # newer than all of a and b
    # Even half: 10 each. Oldest half: a and b alternate (their next events interleave).
    assert taken_counts(buffer, 60) == {"a": 25, "b": 25, "c": 10}


def test_without_publish_times_the_oldest_half_goes_by_arrival_and_keeps_to_caps() -> None:
    buffer = DeliveryBuffer()
    for tag in range(1, 51):
        buffer.add(delivery("early", tag, received_at=100.0 + tag / 1000))
    for tag in range(1, 51):
        buffer.add(delivery("late", tag, received_at=200.0 + tag / 1000))
    assert taken_counts(buffer, 40) == {"early": 30, "late": 10}
    # The oldest half keeps to a capped queue's cap.
    buffer = DeliveryBuffer(shared_cap=lambda queue, others: 100 if queue == "hot" else None)
    buffer.add_all(stamped("hot", range(1, 1001), 1_700_000_000_000))
    buffer.add_all(stamped("bucket", range(1, 3001), 1_700_000_009_000))
    assert taken_counts(buffer, 5000) == {"hot": 100, "bucket": 3000}


def test_redriven_letters_and_clocks_ahead_count_from_their_arrival() -> None:
    """A redriven letter keeps its first publish time, maybe days old: it goes by when it was
    put back. An event stamped after it arrived (its producer's clock runs ahead) goes by its
    arrival too, not behind every other queue's."""
    now_ms = round(time.time() * 1000)
    arrived = time.monotonic()
    buffer = DeliveryBuffer()
    redriven = {HEADER_PUBLISHED_AT: now_ms - 86_400_000, HEADER_REDRIVE_ID: "letter-1"}
    for tag in range(1, 101):
        buffer.add(delivery("redriven", tag, headers=dict(redriven), received_at=arrived))
    live = {HEADER_PUBLISHED_AT: now_ms - 5_000}  # published 5 s ago, arrived now too
    for tag in range(1, 101):
        buffer.add(delivery("live", tag, headers=dict(live), received_at=arrived))
    ahead = {HEADER_PUBLISHED_AT: now_ms + 3_600_000}  # arrived 10 s ago
    for tag in range(1, 101):
        buffer.add(delivery("ahead", tag, headers=dict(ahead), received_at=arrived - 10))
    # Even half: 10 each. Oldest half: "ahead" (10 s), then "live" (5 s); "redriven" is newest.
    assert taken_counts(buffer, 60) == {"ahead": 40, "live": 10, "redriven": 10}
