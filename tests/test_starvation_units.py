"""The bookkeeping of starved holdings (``keyq.worker.amqp.starvation``): pure logic. Whether the
broker starves a consumer, and that the worker then moves, is shown on a real cluster in
``tests/test_cluster.py::test_a_worker_moves_off_a_node_whose_replica_of_a_quorum_queue_is_down``."""

from __future__ import annotations

from collections.abc import Sequence

from keyq.worker.amqp.starvation import (
    MOST_LOOKED_INTO,
    SETTLE_S,
    WINDOW_S,
    StarvationWatch,
    ready_after_close,
)


def test_a_queue_starved_twice_is_reported_once_and_what_it_received_clears_the_count() -> None:
    watch = StarvationWatch()
    assert watch.starved("q", 0.0, 0) is False
    assert watch.starved("q", 10.0, 0) is True
    assert watch.starved("q", 20.0, 0) is False  # the count starts over
    assert watch.starved("other", 20.0, 0) is False
    watch.delivered("other")
    assert watch.starved("other", 30.0, 0) is False, "a holding that received something"
    watch.forget()
    assert watch.starved("q", 40.0, 0) is False, "forgotten"


def test_strikes_older_than_the_window_or_through_another_connection_are_forgotten() -> None:
    watch = StarvationWatch()
    assert watch.starved("q", 0.0, 0) is False
    assert watch.starved("q", WINDOW_S + 1, 0) is False  # the first one is too old
    assert watch.starved("q", WINDOW_S + 2, 1) is False  # a new connection since
    assert watch.starved("q", WINDOW_S + 3, 1) is True


def test_queues_are_looked_into_once_after_the_broker_had_time_to_take_them_back() -> None:
    calls: list[list[str]] = []
    pauses: list[float] = []

    def ready_of(queues: Sequence[str]) -> dict[str, int]:
        calls.append(list(queues))
        return {queue: len(queue) for queue in queues}

    found = ready_after_close(ready_of, ["a", "bb"], pauses.append)
    assert found == {"a": 1, "bb": 2}
    assert calls == [["a", "bb"]] and pauses == [SETTLE_S]


def test_a_hand_back_of_many_silent_queues_looks_into_a_bounded_random_number() -> None:
    queues = [f"q{index}" for index in range(MOST_LOOKED_INTO * 3)]
    picks = [
        set(ready_after_close(lambda qs: dict.fromkeys(qs, 1), queues, lambda _s: None))
        for _ in range(5)
    ]
    assert all(len(pick) == MOST_LOOKED_INTO for pick in picks)
    assert len(set.union(*picks)) > MOST_LOOKED_INTO  # not always the same ones
