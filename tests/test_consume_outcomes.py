"""What a refused consume means, and how large a claim round's bursts are (pure logic; the
broker side is in tests/test_claim_rounds.py and tests/test_consume_rounds.py)."""

from __future__ import annotations

import pika.exceptions
from hypothesis import given
from hypothesis import strategies as st

from keyq.worker.amqp.consume_rounds import (
    FIRST_BURST,
    PIPELINE_DEPTH,
    ConsumeOutcome,
    first_burst,
    next_burst,
    refused,
)


def closed(code: int, text: str) -> pika.exceptions.ChannelClosedByBroker:
    return pika.exceptions.ChannelClosedByBroker(code, text)


def test_an_exclusive_consumer_elsewhere_is_busy() -> None:
    text = "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue 'q' in vhost '/'"
    assert refused(closed(403, text)) is ConsumeOutcome.BUSY


def test_a_queue_that_does_not_exist_is_missing() -> None:
    assert refused(closed(404, "NOT_FOUND - no queue 'q' in vhost '/'")) is ConsumeOutcome.MISSING


def test_a_queue_whose_node_is_down_is_unreachable_in_either_broker_s_words() -> None:
    down_310 = (
        "NOT_FOUND - home node 'rabbit@b' of durable queue 'q' in vhost '/' is down or inaccessible"
    )
    down_43 = "NOT_FOUND - queue 'q' in vhost '/' process is stopped by supervisor"
    assert refused(closed(404, down_310)) is ConsumeOutcome.UNREACHABLE
    assert refused(closed(404, down_43)) is ConsumeOutcome.UNREACHABLE


def test_a_404_that_names_no_queue_is_taken_as_unreachable_never_as_missing() -> None:
    # Waiting for a queue that turns out missing costs a retry; forgetting one strands it.
    assert refused(closed(404, "NOT_FOUND - something else")) is ConsumeOutcome.UNREACHABLE


def test_any_other_close_failed() -> None:
    assert refused(None) is ConsumeOutcome.FAILED
    assert refused(closed(406, "PRECONDITION_FAILED - unknown delivery tag 1")) is (
        ConsumeOutcome.FAILED
    )


def test_a_budgeted_round_starts_small_and_an_unbudgeted_one_at_full_depth() -> None:
    assert first_burst(budgeted=True) == FIRST_BURST < PIPELINE_DEPTH
    assert first_burst(budgeted=False) == PIPELINE_DEPTH


def test_the_next_burst_fits_the_time_left_at_the_last_burst_s_pace() -> None:
    # 8 claims took 80 ms: 10 ms a claim, 50 ms left -> 5 claims.
    assert next_burst(0.080, 8, 0.050) == 5
    # A fast broker is capped at the pipeline depth.
    assert next_burst(0.001, 8, 10.0) == PIPELINE_DEPTH
    # Out of time (or past it): still one, the caller checks the deadline before sending.
    assert next_burst(0.080, 8, 0.0) == 1
    assert next_burst(0.080, 8, -1.0) == 1
    # A burst measured as taking no time at all does not divide by zero.
    assert next_burst(0.0, 8, 0.001) == 10


@given(
    elapsed=st.floats(min_value=0, max_value=60),
    claims=st.integers(min_value=1, max_value=PIPELINE_DEPTH),
    left=st.floats(min_value=-60, max_value=60),
)
def test_a_burst_is_never_empty_nor_deeper_than_the_pipeline(
    elapsed: float, claims: int, left: float
) -> None:
    assert 1 <= next_burst(elapsed, claims, left) <= PIPELINE_DEPTH
