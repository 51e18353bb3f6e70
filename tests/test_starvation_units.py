"""The bookkeeping of starved holdings (``keyq.worker.starvation``): pure logic. Whether the
broker starves a consumer, and that the worker then moves, is shown on a real cluster in
``tests/test_cluster.py::test_a_worker_moves_off_a_node_whose_replica_of_a_quorum_queue_is_down``."""

from __future__ import annotations

from keyq.worker.starvation import LOOKS, MOST_LOOKED_INTO, StarvationWatch, ready_after_close


def test_a_queue_starved_twice_in_a_row_is_reported_once_and_counted_afresh() -> None:
    watch = StarvationWatch()
    assert watch.starved("q") is False
    assert watch.starved("q") is True
    assert watch.starved("q") is False  # the count starts over
    assert watch.starved("other") is False


def test_a_holding_that_received_something_clears_the_count() -> None:
    watch = StarvationWatch()
    assert watch.starved("q") is False
    watch.delivered("q")
    assert watch.starved("q") is False
    watch.forget()
    assert watch.starved("q") is False


def test_queues_are_looked_into_until_the_broker_shows_their_messages_back() -> None:
    answers = {"slow": [0, 0, 4], "empty": [0, 0, 0], "quick": [2]}
    asked: list[str] = []
    pauses: list[float] = []

    def ready_of(queue: str) -> int:
        asked.append(queue)
        return answers[queue].pop(0)

    found = ready_after_close(ready_of, ["slow", "empty", "quick"], pauses.append)
    assert found == {"slow": 4, "empty": 0, "quick": 2}
    assert asked.count("quick") == 1 and asked.count("slow") == LOOKS
    assert len(pauses) == LOOKS


def test_a_hand_back_of_many_silent_queues_looks_into_a_bounded_number() -> None:
    queues = [f"q{index}" for index in range(MOST_LOOKED_INTO * 3)]
    found = ready_after_close(lambda _queue: 1, queues, lambda _seconds: None)
    assert len(found) == MOST_LOOKED_INTO
