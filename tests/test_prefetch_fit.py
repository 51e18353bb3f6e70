"""Which consumers are reopened with another prefetch (pure logic; the broker's side, a paced
producer's bucket catching up, in test_packed_deliveries and bench/hot_key.py)."""

from __future__ import annotations

from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.holding.prefetch_fit import COOL_DOWN_S, GROW_COOL_DOWN_S, PrefetchFit

EVENTS, BASE = 1000, 50  # KEYQ_PREFETCH, and its room in messages of 20 events


def none_buffered(_queue: str) -> int:
    return 0


def batch(queue: str, messages: int, per_message: int) -> list[Delivery]:
    return [
        Delivery(queue, 1, tag, False, {}, None, None, b"{}", part=part, parts=per_message)
        for tag in range(1, messages + 1)
        for part in range(per_message)
    ]


def test_a_queue_of_single_events_that_took_its_whole_room_gets_room_for_its_events() -> None:
    fit = PrefetchFit(EVENTS, BASE)
    rooms = {"q": BASE}
    fit.observe(batch("q", BASE, 1), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"q": EVENTS}


def test_full_packs_or_room_to_spare_change_nothing() -> None:
    fit = PrefetchFit(EVENTS, BASE)
    rooms = {"packed": BASE, "quiet": BASE}
    fit.observe(batch("packed", BASE, 20) + batch("quiet", 3, 1), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {}


def test_a_widened_queue_whose_packs_grew_again_is_narrowed_unless_a_gap_waits() -> None:
    fit = PrefetchFit(EVENTS, BASE)
    rooms = {"q": EVENTS}
    for _ in range(10):
        fit.observe(batch("q", 30, 20), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 5, now=100.0) == {}  # deferred events: kept wide
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"q": BASE}


def test_a_queue_is_refitted_at_most_once_per_cool_down_and_forgotten_once_let_go() -> None:
    fit = PrefetchFit(EVENTS, BASE)
    rooms: dict[str, int] = {"q": BASE}
    fit.observe(batch("q", BASE, 1), rooms.get, none_buffered)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"q": EVENTS}
    fit.observe(batch("q", BASE, 1), rooms.get, none_buffered)  # not reopened yet
    assert fit.due(rooms.get, lambda _q: 0, now=100.0 + GROW_COOL_DOWN_S / 2) == {}
    rooms.clear()
    assert fit.due(rooms.get, lambda _q: 0, now=200.0) == {}
    assert fit.want("q") is None


def test_a_batch_that_took_half_the_room_while_the_rest_arrived_shows_a_full_consumer() -> None:
    fit = PrefetchFit(EVENTS, BASE)
    rooms = {"q": BASE}
    fit.observe(batch("q", BASE // 2, 1), rooms.get, lambda _q: BASE // 2)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"q": EVENTS}
    half = PrefetchFit(EVENTS, BASE)
    half.observe(batch("q", BASE // 2, 1), rooms.get, none_buffered)  # room to spare
    assert half.due(rooms.get, lambda _q: 0, now=100.0) == {}


def test_a_queue_grows_again_after_a_short_cool_down_but_shrinks_after_the_long_one() -> None:
    fit = PrefetchFit(EVENTS, BASE)
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
