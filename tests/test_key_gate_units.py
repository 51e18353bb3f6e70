"""The key gate and the per-key token buckets as pure units (what they do with real workers
is in tests/test_park_redrive.py, test_pause.py and test_rate_limit.py)."""

from __future__ import annotations

from typing import Any

from keyq.broker.envelope import CONTENT_JSON, HEADER_KEY, HEADER_PRODUCER, HEADER_SEQ
from keyq.broker.key_control import KeyStatus, ParkedKey
from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.batch.decoding import decoder_for
from keyq.worker.batch.key_gate import sort_by_key_status
from keyq.worker.batch.rate_limits import KeyRateLimiter, within_rates

MAIN = "keyq.s.b.00000"
SIDE = "keyq.s.a.0123.tok"
_tags = iter(range(1, 10_000))


def event(key: str, seq: int, queue: str = MAIN, body: bytes = b'{"n": 1}') -> Delivery:
    headers: dict[str, Any] = {HEADER_KEY: key, HEADER_PRODUCER: "p", HEADER_SEQ: seq}
    return Delivery(queue, 1, next(_tags), False, headers, CONTENT_JSON, None, body)


def sort(deliveries: list[Delivery], statuses: dict[str, KeyStatus], park: bool = False) -> Any:
    return sort_by_key_status(
        deliveries,
        decoder_for({}),
        statuses,
        is_aside_queue=lambda queue: queue == SIDE,
        park_at_poison=park,
        now_ms=1,
    )


def test_a_flowing_key_goes_through_a_paused_or_aside_one_is_set_aside_or_handed_back() -> None:
    a1, b1, a2 = event("a", 1), event("b", 1), event("a", 2)
    sorting = sort([a1, b1, a2], {"a": KeyStatus(paused_since_ms=5)})
    assert sorting.through == [b1]
    assert sorting.aside == {"a": [a1, a2]}
    # A key with queues aside sets its new events aside and drains only its head.
    waiting = KeyStatus(aside=(SIDE, "keyq.s.a.0123.later"))
    fresh, old = event("a", 9), event("a", 3, queue=SIDE)
    sorting = sort([fresh, old], {"a": waiting})
    assert sorting.aside == {"a": [fresh]}
    assert sorting.through == [old]
    stopped = KeyStatus(paused_since_ms=1, aside=(SIDE,))
    assert sort([old], {"a": stopped}).hand_back == [old]
    not_head = KeyStatus(aside=("keyq.s.r.0123.first", SIDE))
    assert sort([old], {"a": not_head}).hand_back == [old]


def test_under_park_what_follows_the_poison_by_seq_is_set_aside_or_held_back() -> None:
    a1, poison, a3, b1 = event("a", 1), event("a", 2, body=b"\xff"), event("a", 3), event("b", 1)
    sorting = sort([a1, poison, a3, b1], {}, park=True)
    assert sorting.through == [a1, poison, b1]
    assert sorting.aside == {"a": [a3]}
    parked = sorting.parking["a"]
    assert isinstance(parked, ParkedKey) and (parked.producer, parked.seq) == ("p", 2)
    assert "not UTF-8" in parked.reason
    assert sort([a1, poison, a3], {}, park=False).aside == {}
    # A quorum queue handed the poison (seq 5) back after its successors.
    e6, e7, poison = event("a", 6), event("a", 7), event("a", 5, body=b"\xff")
    other = event("b", 1)
    sorting = sort([e6, e7, poison, other], {}, park=True)
    assert sorting.through == [poison, other]
    assert sorting.aside == {"a": [e6, e7]}
    # From an aside queue they are held back (closed and handed back), never moved to the tail.
    waiting = KeyStatus(aside=(SIDE,))
    side = [event("a", 6, queue=SIDE), event("a", 5, queue=SIDE, body=b"\xff")]
    sorting = sort(side, {"a": waiting}, park=True)
    assert sorting.through == [side[1]] and sorting.hand_back == [side[0]]


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_token_bucket_gives_a_second_of_events_then_the_rate() -> None:
    clock = Clock()
    limiter = KeyRateLimiter(10, clock)
    assert limiter.take("k", 25) == 10
    assert limiter.take("k", 5) == 0
    assert limiter.due_in("k") == 0.1
    clock.now += 0.35
    assert limiter.take("k", 5) == 3
    assert limiter.take("other", 4) == 4  # keys do not share tokens
    clock.now += 10
    limiter.forget_full()
    assert limiter.take("k", 50) == 10  # never more than a second's worth


def test_rate_limits_hold_back_a_keys_later_events_in_order() -> None:
    limiter = KeyRateLimiter(2, Clock())
    deliveries = [event("hot", n) for n in range(1, 5)] + [event("cold", 1)]
    sorting = sort(deliveries, {})
    within, beyond = within_rates(sorting.through, sorting.through_keys, limiter)
    assert within == [deliveries[0], deliveries[1], deliveries[4]]
    assert beyond == deliveries[2:4]
