"""Fair batches: with more ready events than one batch holds, ``DeliveryBuffer.take`` shares
each batch among the queues, so no queue starves behind busy ones.

The bound: with ``Q`` queues in the buffer and batches of ``B`` events, a queue with ready
deliveries at a take is served by that take or one of the ``ceil(Q / B) - 1`` after it (one
batch cycle); when ``Q <= B`` that is every batch. Pure logic, no services.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    for index, (ready, cycle) in enumerate(zip(ready_before, cycles, strict=True)):
        window = set().union(*served[index : index + cycle])
        starved = ready - window
        assert not starved, f"take {index}: {sorted(starved)} not served within {cycle} takes"


@pytest.mark.parametrize(("queue_count", "batch"), [(16, 5), (16, 16), (17, 4), (4, 10), (3, 7)])
def test_saturated_queues_are_all_served_within_one_cycle(queue_count: int, batch: int) -> None:
    queues = names(queue_count)
    depth = 4 * batch  # many more ready deliveries than one batch holds, in every queue
    buffer = filled(queues, depth)
    left = dict.fromkeys(queues, depth)
    cycle = math.ceil(queue_count / batch)
    batches: list[list[Delivery]] = []
    ready_before: list[set[str]] = []
    while len(buffer):
        ready_before.append({queue for queue, count in left.items() if count})
        taken = take(buffer, batch)
        assert len(taken) == min(batch, sum(left.values()))
        for item in taken:
            left[item.queue] -= 1
        batches.append(taken)

    assert_served_within_a_cycle(ready_before, batches, [cycle] * len(batches))
    # Nothing lost, nothing twice, and each queue's deliveries in arrival order across takes.
    assert served_by_queue(batches) == {queue: list(range(1, depth + 1)) for queue in queues}


def test_queues_that_fit_share_each_batch_evenly() -> None:
    queues = names(4)
    buffer = filled(queues, 40)
    for _ in range(5):
        counts = Counter(item.queue for item in take(buffer, 10))
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
    later = [take(buffer, 4) for _ in range(math.ceil(11 / 4))]
    assert "late" in {item.queue for batch in later for item in batch}


def test_a_put_back_batch_keeps_each_queues_order() -> None:
    queues = names(6)
    buffer = filled(queues, 10)
    buffer.put_back(take(buffer, 4))  # a batch that could not be committed comes back
    batches: list[list[Delivery]] = []
    while len(buffer):
        batches.append(take(buffer, 4))
    assert served_by_queue(batches) == {queue: list(range(1, 11)) for queue in queues}


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

    def add(self, queue: str, count: int) -> None:
        for _ in range(count):
            self.added[queue] += 1
            self.buffer.add(delivery(queue, self.added[queue]))

    def take(self) -> None:
        self.ready_before.append({q for q in self.added if self.taken[q] < self.added[q]})
        self.cycles.append(math.ceil(len(self.added) / self.batch))
        batch = take(self.buffer, self.batch)
        assert 0 < len(batch) <= self.batch
        self.taken.update(item.queue for item in batch)
        self.batches.append(batch)


# One step: add ``count`` deliveries to queue ``index``, or (count 0) take a batch.
steps = st.lists(st.tuples(st.integers(0, 11), st.integers(0, 9)), min_size=1, max_size=80)


@settings(max_examples=300, deadline=None)
@given(steps=steps, batch=st.integers(1, 12))
def test_any_interleaving_of_adds_and_takes_is_fair_and_loses_nothing(
    steps: list[tuple[int, int]], batch: int
) -> None:
    recorder = Recorder(DeliveryBuffer(), batch)
    for index, count in steps:
        if count:
            recorder.add(f"q{index:02d}", count)
        elif len(recorder.buffer):
            recorder.take()
    while len(recorder.buffer):
        recorder.take()

    # The buffer ends empty, so a window cut short by the end still holds every queue's turn.
    assert_served_within_a_cycle(recorder.ready_before, recorder.batches, recorder.cycles)
    expected = {queue: list(range(1, n + 1)) for queue, n in recorder.added.items()}
    assert served_by_queue(recorder.batches) == expected


def test_a_capped_queue_gives_a_shared_batch_at_most_its_cap_and_alone_all() -> None:
    """Auto mode caps a promoted key's own queue in batches it shares with other queues."""
    buffer = DeliveryBuffer(shared_cap=lambda queue, others: 100 if queue == "hot" else None)
    for tag in range(1, 1001):
        buffer.add(delivery("hot", tag))
    for tag in range(1, 31):
        buffer.add(delivery("bucket", tag))
    shared = Counter(d.queue for d in take(buffer, 5000))
    assert shared == {"hot": 100, "bucket": 30}
    alone = Counter(d.queue for d in take(buffer, 5000))
    assert alone == {"hot": 900}  # nothing else waits: no cap


def test_a_capped_queue_is_told_how_many_the_other_queues_have() -> None:
    """Until its events' cost is known, a promoted key may match the others in a busy stream."""

    def cap(queue: str, others: int) -> int | None:
        return max(100, others) if queue == "hot" else None

    buffer = DeliveryBuffer(shared_cap=cap)
    for tag in range(1, 3001):
        buffer.add(delivery("hot", tag))
    for queue in ("b1", "b2"):
        for tag in range(1, 401):
            buffer.add(delivery(queue, tag))
    shared = Counter(d.queue for d in take(buffer, 5000))
    assert shared == {"hot": 800, "b1": 400, "b2": 400}
