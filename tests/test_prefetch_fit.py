"""Which consumers are reopened with another prefetch (pure logic; the broker's side, a paced
producer's bucket catching up, in test_packed_deliveries and bench/hot_key.py)."""

from __future__ import annotations

from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.holding.prefetch_fit import COOL_DOWN_S, PrefetchFit

EVENTS, BASE = 1000, 50  # KEYQ_PREFETCH, and its room in messages of 20 events


def batch(queue: str, messages: int, per_message: int) -> list[Delivery]:
    return [
        Delivery(queue, 1, tag, False, {}, None, None, b"{}", part=part, parts=per_message)
        for tag in range(1, messages + 1)
        for part in range(per_message)
    ]


def test_a_queue_of_single_events_that_took_its_whole_room_gets_room_for_its_events() -> None:
    fit = PrefetchFit(EVENTS, BASE)
    rooms = {"q": BASE}
    fit.observe(batch("q", BASE, 1), rooms.get)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"q": EVENTS}


def test_full_packs_or_room_to_spare_change_nothing() -> None:
    fit = PrefetchFit(EVENTS, BASE)
    rooms = {"packed": BASE, "quiet": BASE}
    fit.observe(batch("packed", BASE, 20) + batch("quiet", 3, 1), rooms.get)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {}


def test_a_widened_queue_whose_packs_grew_again_is_narrowed_unless_a_gap_waits() -> None:
    fit = PrefetchFit(EVENTS, BASE)
    rooms = {"q": EVENTS}
    for _ in range(10):
        fit.observe(batch("q", 30, 20), rooms.get)
    assert fit.due(rooms.get, lambda _q: 5, now=100.0) == {}  # deferred events: kept wide
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"q": BASE}


def test_a_queue_is_refitted_at_most_once_per_cool_down_and_forgotten_once_let_go() -> None:
    fit = PrefetchFit(EVENTS, BASE)
    rooms: dict[str, int] = {"q": BASE}
    fit.observe(batch("q", BASE, 1), rooms.get)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"q": EVENTS}
    fit.observe(batch("q", BASE, 1), rooms.get)  # the reopening has not happened yet
    assert fit.due(rooms.get, lambda _q: 0, now=100.0 + COOL_DOWN_S / 2) == {}
    rooms.clear()
    assert fit.due(rooms.get, lambda _q: 0, now=200.0) == {}
    assert fit.want("q") is None
