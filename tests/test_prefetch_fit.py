"""Which consumers are reopened with another prefetch (pure logic; the broker's side, a paced
producer's bucket catching up, in test_packed_deliveries and bench/hot_key.py)."""

from __future__ import annotations

from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.holding.prefetch_fit import COOL_DOWN_S, GROW_COOL_DOWN_S, PrefetchFit

EVENTS, BASE = 1000, 50  # KEYQ_PREFETCH, and its room in messages of 20 events
BATCH = 5000  # KEYQ_BATCH_MAX_EVENTS
BUDGET = 2 * BATCH  # KEYQ_PREFETCH_WIDEN_EVENTS


def none_buffered(_queue: str) -> int:
    return 0


def batch(queue: str, messages: int, per_message: int) -> list[Delivery]:
    return [
        Delivery(queue, 1, tag, False, {}, None, None, b"{}", part=part, parts=per_message)
        for tag in range(1, messages + 1)
        for part in range(per_message)
    ]


def test_full_packs_room_to_spare_no_budget_or_a_full_batch_widen_nothing() -> None:
    fit = PrefetchFit(EVENTS, BASE, EVENTS)
    rooms = {"packed": BASE, "quiet": BASE}
    fit.observe(batch("packed", BASE, 20) + batch("quiet", 3, 1), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {}
    no_budget = PrefetchFit(EVENTS, BASE, BATCH, 0)  # a backed-up queue, no budget to widen
    no_budget.observe(batch("packed", BASE, 20), rooms.get, none_buffered)
    assert no_budget.due(rooms.get, lambda _q: 0, now=100.0) == {}
    # A full batch widens nothing: the worker is busy, not a queue behind.
    fit = PrefetchFit(EVENTS, BASE, BATCH, BUDGET)
    rooms = {f"q{n}": BASE for n in range(5)}
    full_batch = [d for n in range(5) for d in batch(f"q{n}", BASE, 20)]
    fit.observe(full_batch, rooms.get, none_buffered)
    assert len(full_batch) == BATCH
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {}
    # ... then a widened queue stays so while it comes back full.
    fit.observe(batch("q0", BASE, 20), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"q0": BATCH // 20}
    rooms["q0"] = BATCH // 20
    fit.observe(batch("q0", BATCH // 20, 20), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0 + COOL_DOWN_S) == {}


def test_a_widened_queue_whose_packs_grew_again_is_narrowed_unless_a_gap_waits() -> None:
    fit = PrefetchFit(EVENTS, BASE, EVENTS)
    rooms = {"q": EVENTS}
    for _ in range(10):
        fit.observe(batch("q", 30, 20), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 5, now=100.0) == {}  # deferred events: kept wide
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"q": BASE}


def test_a_queue_is_refitted_at_most_once_per_cool_down_and_forgotten_once_let_go() -> None:
    fit = PrefetchFit(EVENTS, BASE, EVENTS)
    rooms: dict[str, int] = {"q": BASE}
    fit.observe(batch("q", BASE, 1), rooms.get, none_buffered)
    # Single events that took the whole room: room for the events.
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"q": EVENTS}
    fit.observe(batch("q", BASE, 1), rooms.get, none_buffered)  # not reopened yet
    assert fit.due(rooms.get, lambda _q: 0, now=100.0 + GROW_COOL_DOWN_S / 2) == {}
    rooms.clear()
    assert fit.due(rooms.get, lambda _q: 0, now=200.0) == {}
    assert fit.want("q") is None


def test_a_batch_that_took_half_the_room_while_the_rest_arrived_shows_a_full_consumer() -> None:
    fit = PrefetchFit(EVENTS, BASE, EVENTS)
    rooms = {"q": BASE}
    fit.observe(batch("q", BASE // 2, 1), rooms.get, lambda _q: BASE // 2)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"q": EVENTS}
    half = PrefetchFit(EVENTS, BASE, EVENTS)
    half.observe(batch("q", BASE // 2, 1), rooms.get, none_buffered)  # room to spare
    assert half.due(rooms.get, lambda _q: 0, now=100.0) == {}


def test_a_queue_grows_again_after_a_short_cool_down_but_shrinks_after_the_long_one() -> None:
    fit = PrefetchFit(EVENTS, BASE, EVENTS)
    rooms = {"q": BASE}
    for _ in range(3):
        fit.observe(batch("q", BASE, 5), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"q": EVENTS // 5}
    rooms["q"] = EVENTS // 5
    for _ in range(10):  # the packs left: single events, the room full
        fit.observe(batch("q", EVENTS // 5, 1), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0 + GROW_COOL_DOWN_S / 2) == {}
    grown = fit.due(rooms.get, lambda _q: 0, now=100.0 + GROW_COOL_DOWN_S)
    assert grown["q"] >= 2 * rooms["q"]
    rooms["q"] = grown["q"]
    for _ in range(10):  # full packs again
        fit.observe(batch("q", 30, 20), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0 + 2 * GROW_COOL_DOWN_S) == {}
    shrunk = fit.due(rooms.get, lambda _q: 0, now=100.0 + GROW_COOL_DOWN_S + COOL_DOWN_S)
    assert shrunk["q"] <= rooms["q"] // 2


def test_a_backed_up_queue_in_a_batch_with_room_to_spare_is_widened_to_a_batch() -> None:
    fit = PrefetchFit(EVENTS, BASE, BATCH, BUDGET)
    rooms = {"hot": BASE, "quiet": BASE}
    fit.observe(batch("hot", BASE, 20) + batch("quiet", 3, 20), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"hot": BATCH // 20}
    rooms["hot"] = BATCH // 20
    fit.observe(batch("hot", 60, 20), rooms.get, none_buffered)  # caught up: room to spare
    assert fit.due(rooms.get, lambda _q: 0, now=100.0 + COOL_DOWN_S) == {"hot": BASE}


def test_widening_is_bounded_for_the_whole_worker() -> None:
    fit = PrefetchFit(EVENTS, BASE, BATCH, BUDGET)
    queues = [f"q{n}" for n in range(10)]
    rooms = dict.fromkeys(queues, BASE)
    for queue in queues:  # each backs up in turn, in batches with room to spare
        fit.observe(batch(queue, BASE, 20), rooms.get, none_buffered)
    wanted = fit.due(rooms.get, lambda _q: 0, now=100.0)
    extra = sum(messages * 20 - EVENTS for messages in wanted.values())
    assert 0 < extra <= BUDGET
    assert set(wanted) == {"q0", "q1", "q2"}  # they took the budget; the rest keep prefetch
    assert wanted["q0"] == wanted["q1"] == BATCH // 20 > wanted["q2"]
    rooms.update(wanted)  # reopened
    rooms.pop("q0")  # let go: its share of the budget is free again
    fit.due(rooms.get, lambda _q: 0, now=200.0)
    fit.observe(batch("q9", BASE, 20), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 0, now=300.0) == {"q9": BATCH // 20}


def test_a_widened_queue_gives_its_budget_back_when_narrowed_not_before() -> None:
    fit = PrefetchFit(EVENTS, BASE, BATCH, BUDGET)
    queues = ["q0", "q1", "q2", "q3"]
    rooms = dict.fromkeys(queues, BASE)
    for queue in queues[:3]:
        fit.observe(batch(queue, BASE, 20), rooms.get, none_buffered)
    rooms.update(fit.due(rooms.get, lambda _q: 0, now=100.0))
    fit.observe(batch("q0", 10, 20), rooms.get, none_buffered)  # q0 caught up, still wide
    fit.observe(batch("q3", BASE, 20), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0 + COOL_DOWN_S) == {"q0": BASE}
    rooms["q0"] = BASE
    fit.observe(batch("q3", BASE, 20), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 0, now=200.0) == {"q3": BATCH // 20}
    # One that caught up before it was reopened wider gives the budget back too.
    fit = PrefetchFit(EVENTS, BASE, BATCH, BATCH)  # room for one widened queue
    rooms = {"a": BASE, "b": BASE}
    fit.observe(batch("a", BASE, 20), rooms.get, none_buffered)  # full: widening reserved
    fit.observe(batch("a", 3, 20), rooms.get, none_buffered)  # caught up before any reopening
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {}
    fit.observe(batch("b", BASE, 20), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"b": BATCH // 20}


def test_a_queue_the_worker_does_not_widen_keeps_its_prefetch_however_backed_up() -> None:
    fit = PrefetchFit(EVENTS, BASE, BATCH, BUDGET, widens=lambda queue: queue != "bucket")
    rooms = {"bucket": BASE, "own": BASE}
    fit.observe(batch("bucket", BASE, 20) + batch("own", BASE, 20), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"own": BATCH // 20}


def test_deliveries_put_back_count_once_and_their_queue_is_not_widened() -> None:
    fit = PrefetchFit(EVENTS, BASE, BATCH, BUDGET)
    rooms = {"limited": BASE}
    taken = batch("limited", BASE // 2, 20)  # all over its key's rate: back in the buffer
    fit.observe(taken, rooms.get, lambda _q: BASE // 2, put_back=taken)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {}  # half the room, counted once
    fit.observe(batch("limited", BASE, 20), rooms.get, none_buffered, put_back=taken[:1])
    assert fit.due(rooms.get, lambda _q: 0, now=200.0) == {}  # full, but held back: not widened
