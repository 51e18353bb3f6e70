"""Which tags a consumer acks with ``multiple`` (pure logic; the broker side is in
tests/test_worker_sequencing.py): never a tag the broker numbered that did not reach the worker."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from keyq.worker.amqp.ack_ledger import AckLedger


def whole(*tags: int) -> list[tuple[int, int]]:
    """The one event of each of ``tags`` (messages of a single event)."""
    return [(tag, 0) for tag in tags]


def ledger_of(*tags: int) -> AckLedger:
    ledger = AckLedger()
    for tag in tags:
        ledger.delivered(tag)
    return ledger


def test_a_tag_that_never_arrived_stops_the_multiple_ack() -> None:
    # Tag 3 was counted as delivered by the broker but never reached us.
    ledger = ledger_of(1, 2, 4, 5)
    assert ledger.settle(whole(1, 2, 4, 5)) == (2, [4, 5])
    # Nothing later ever covers it either.
    ledger.delivered(6)
    assert ledger.settle(whole(6)) == (0, [6])


def test_a_waiting_delivery_splits_the_acks_and_is_covered_once_settled() -> None:
    ledger = ledger_of(1, 2, 3, 4)
    assert ledger.settle(whole(1, 3, 4)) == (1, [3, 4])  # 2 waits for an earlier seq
    assert ledger.settle(whole(2)) == (2, [])  # its own tag: 3 and 4 are acked already
    ledger.delivered(5)
    assert ledger.settle(whole(5)) == (5, [])


def test_a_settled_run_is_one_multiple_ack_and_no_tag_is_acked_twice() -> None:
    assert ledger_of(1, 2, 3).settle(whole(1, 2, 3)) == (3, [])
    ledger = ledger_of(1, 2)
    assert ledger.settle(whole(1)) == (1, [])
    assert ledger.settle(whole(1, 2, 7)) == (2, [])
    assert len(ledger) == 0


@given(
    arrived=st.lists(st.booleans(), min_size=1, max_size=40),
    rounds=st.lists(st.lists(st.integers(1, 40), max_size=40), max_size=6),
)
def test_every_ack_covers_only_delivered_tags_and_each_once(
    arrived: list[bool], rounds: list[list[int]]
) -> None:
    """Model: the broker's unacked tags; a multiple ack takes every unacked tag up to its own
    (which must be unacked), a single ack its own."""
    tags = range(1, len(arrived) + 1)
    delivered = {tag for tag, came in zip(tags, arrived, strict=True) if came}
    ledger = ledger_of(*sorted(delivered))
    unacked = set(tags)
    settled: set[int] = set()
    for settling in rounds:
        upto, singles = ledger.settle(whole(*settling))
        if upto:
            assert upto in unacked, "a multiple ack on a tag no longer unacked is refused"
            covered = {tag for tag in unacked if tag <= upto}
            assert covered <= delivered, "a multiple ack covered a tag that never arrived"
            unacked -= covered
            settled |= covered
        for tag in singles:
            assert tag in unacked
            unacked.discard(tag)
            settled.add(tag)
        assert settled == delivered & (settled | set(settling))
    assert unacked >= set(tags) - delivered
