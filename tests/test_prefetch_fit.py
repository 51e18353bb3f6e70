"""Which consumers are reopened with another prefetch (pure logic; the broker's side, a paced
producer's bucket catching up, in test_packed_deliveries and bench/hot_key.py)."""

from __future__ import annotations

from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.holding.prefetch_fit import COOL_DOWN_S, GROW_COOL_DOWN_S, WIDE, PrefetchFit

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


def test_a_queue_whose_messages_shrank_grows_at_once_from_its_latest_batch() -> None:
    """A bucket fed full packs, then small ones (a hot key's producers switched to its own
    queue): the latest batch, not the running size, says how much room a backlog needs."""
    fit = PrefetchFit(EVENTS, BASE)
    rooms = {"q": BASE}
    for _ in range(10):
        fit.observe(batch("q", 10, 20), rooms.get)
    fit.observe(batch("q", BASE // 3, 2), rooms.get)  # a third of its room: not backed up
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {}
    fit.observe(batch("q", BASE // 2, 2), rooms.get)  # half: what a backed-up queue's take is
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"q": EVENTS // 2}


def test_a_queue_is_widened_at_most_once_per_grow_cool_down_and_narrowed_once_per_cool_down() -> (
    None
):
    fit = PrefetchFit(EVENTS, BASE)
    rooms: dict[str, int] = {"q": BASE}
    fit.observe(batch("q", BASE, 4), rooms.get)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"q": EVENTS // 4}
    rooms["q"] = EVENTS // 4
    fit.observe(batch("q", EVENTS // 4, 1), rooms.get)
    assert fit.due(rooms.get, lambda _q: 0, now=100.0 + GROW_COOL_DOWN_S / 2) == {}
    assert fit.due(rooms.get, lambda _q: 0, now=100.0 + GROW_COOL_DOWN_S) == {"q": EVENTS}
    rooms["q"] = EVENTS
    for _ in range(30):  # the running size comes back to full packs
        fit.observe(batch("q", 10, 20), rooms.get)
    later = 100.0 + GROW_COOL_DOWN_S
    assert fit.due(rooms.get, lambda _q: 0, now=later + COOL_DOWN_S / 2) == {}
    narrowed = fit.due(rooms.get, lambda _q: 0, now=later + COOL_DOWN_S)
    assert narrowed == {"q": fit.want("q")} and narrowed["q"] < 2 * BASE


def test_a_queue_whose_batches_pass_their_events_on_is_widened_until_they_apply_them_again() -> (
    None
):
    """A bucket whose holder forwards a key just promoted: forwarding costs no Spark job, so
    it holds ``WIDE`` times the events while its batches mostly forward."""
    fit = PrefetchFit(EVENTS, BASE)
    rooms = {"bucket": BASE, "other": BASE}
    taken = batch("bucket", BASE // 2, 20) + batch("other", BASE // 2, 20)
    fit.observe(taken, rooms.get, {"bucket": 100, "other": 500})  # of 500 events each
    assert fit.due(rooms.get, lambda _q: 0, now=100.0) == {"bucket": WIDE * BASE}
    rooms["bucket"] = WIDE * BASE
    fit.observe(batch("bucket", BASE, 20), rooms.get, None)  # committed nothing: not passing
    assert fit.due(rooms.get, lambda _q: 0, now=100.0 + COOL_DOWN_S) == {"bucket": BASE}


def test_a_queue_is_forgotten_once_let_go() -> None:
    fit = PrefetchFit(EVENTS, BASE)
    rooms: dict[str, int] = {"q": BASE}
    fit.observe(batch("q", BASE, 1), rooms.get)
    rooms.clear()
    assert fit.due(rooms.get, lambda _q: 0, now=200.0) == {}
    assert fit.want("q") is None
