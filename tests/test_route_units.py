"""The pure parts of auto mode: which keys are promoted (RouteWatch) and where the key gate
routes a delivery (Routing.way)."""

from __future__ import annotations

from keyq.broker.key_control import KeyStatus, ParkedKey
from keyq.broker.routes import Route
from keyq.broker.streams import StreamConfig
from keyq.worker.auto_mode import SHARED_BATCH_S, OwnEventCost, shared_cap
from keyq.worker.batch.key_gate import Routing, Way
from keyq.worker.batch.route_watch import Published, RouteWatch
from keyq.worker.config import WorkerSettings
from tests.helpers import plain_delivery

STREAM = "s"
BUCKET = "keyq.s.b.00001"
OWN = "keyq.s.k.k1"
ASIDE = "keyq.s.a.0123.abc"


def route(*, open_move: bool, queue: str = OWN) -> Route:
    return Route(epoch=3, queue=queue, bucket=BUCKET, open=open_move, at_ms=0, why="rate")


def published(
    start_ms: int, events: int, every_ms: float, *, producer: str = "p", first_seq: int = 1
) -> list[Published]:
    """``events`` of one producer, numbered from ``first_seq``, published ``every_ms`` apart."""
    return [
        Published(producer, first_seq + n, start_ms + round(n * every_ms)) for n in range(events)
    ]


def test_a_key_is_promoted_by_its_publish_rate_over_a_window_not_by_one_quiet_batch() -> None:
    watch = RouteWatch(rate=100, backlog=1000)
    # 40 events published 7 ms apart (about 140 a second), taken in three attempts.
    assert watch.due({"k1": published(0, 40, 7)}, {}, now=10.0) == {}
    assert watch.due({"k1": published(280, 40, 7, first_seq=41)}, {}, now=10.5) == {}
    found = watch.due({"k1": published(560, 40, 7, first_seq=81)}, {}, now=10.9)
    assert found == {"k1": "rate"}
    assert watch.due({"k1": published(840, 40, 7, first_seq=121)}, {}, now=11.0) == {}
    # 60 in each of two attempts, but published 1.5 s apart: never 100 within a second.
    assert watch.due({"k2": published(0, 60, 1)}, {}, now=20.0) == {}
    assert watch.due({"k2": published(1500, 60, 1, first_seq=61)}, {}, now=20.1) == {}


def test_a_backlog_taken_fast_is_not_a_hot_key() -> None:
    """A bucket draining a backlog takes a key's old events faster than they were published:
    500 events published 20 ms apart (50 a second) taken within half a second."""
    watch = RouteWatch(rate=100, backlog=1000)
    backlog = published(0, 500, 20)
    for n, start in enumerate(range(0, 500, 100)):
        assert watch.due({"cold": backlog[start : start + 100]}, {}, now=30.0 + n * 0.1) == {}
    # Published 5 ms apart (200 a second), the first 100 are a hot key's.
    assert watch.due({"hot": published(0, 100, 5)}, {}, now=40.0) == {"hot": "rate"}


def test_each_event_counts_once_and_producers_clocks_need_not_agree() -> None:
    watch = RouteWatch(rate=100, backlog=1000)
    # The same 60 events taken again and again (a rerun attempt, deferred behind a gap).
    again = published(0, 60, 5)
    for n in range(5):
        assert watch.due({"k": again}, {}, now=50.0 + n * 0.1) == {}
    # Two producers at 60 a second each, their clocks 5 s apart: 120 within a second.
    ahead = published(5000, 60, 10, producer="b")
    assert watch.due({"two": published(0, 60, 10, producer="a")}, {}, now=60.0) == {}
    assert watch.due({"two": ahead}, {}, now=60.1) == {"two": "rate"}
    # A producer's clock stepped back 10 s: its events count again from there.
    assert watch.due({"step": published(20_000, 60, 10)}, {}, now=70.0) == {}
    stepped = published(10_000, 60, 10, first_seq=61)
    assert watch.due({"step": stepped}, {}, now=70.1) == {}  # 60, not 120
    assert watch.due({"step": published(10_600, 40, 10, first_seq=121)}, {}, now=70.2) == {
        "step": "rate"
    }


def test_backlog_held_back_and_rate_limited_keys_are_promoted_at_once() -> None:
    watch = RouteWatch(rate=1e9, backlog=500)
    paused = KeyStatus(paused_since_ms=1)
    parked_with_aside = KeyStatus(parked=ParkedKey(1, "poison", "p", 3), aside=("q",))
    promoted = KeyStatus(route=route(open_move=False))
    watch.limited(["limited"], now=5.0)
    found = watch.due(
        {
            "big": published(0, 500, 0),
            "paused": published(0, 1, 0),
            "aside": published(0, 1, 0),
            "limited": published(0, 1, 0),
            "promoted": published(0, 900, 0),
            "small": published(0, 3, 0),
        },
        {"paused": paused, "aside": parked_with_aside, "promoted": promoted},
        now=5.1,
    )
    assert found == {"big": "backlog", "paused": "stopped", "limited": "rate-limited"}
    assert (
        watch.due({"limited": published(0, 1, 0, first_seq=2)}, {}, now=7.0) == {}
    )  # given once, and forgotten


def test_the_gate_routes_a_promoted_keys_events() -> None:
    bucket = plain_delivery(BUCKET, 1)
    own = plain_delivery(OWN, 1)
    aside = plain_delivery(ASIDE, 1)
    forwarding = Routing(STREAM, {ASIDE: BUCKET}, frozenset({"k1"}))
    retiring = Routing(STREAM, {}, frozenset())
    # In its bucket: forwarded, or moving while its own queue is being retired.
    assert forwarding.way(bucket, "k1", route(open_move=True), aside=False) is Way.FORWARD
    assert forwarding.way(bucket, "k1", route(open_move=False), aside=False) is Way.FORWARD
    assert retiring.way(bucket, "k1", route(open_move=False), aside=False) is Way.MOVING
    assert forwarding.way(bucket, "k2", None, aside=False) is None  # not promoted
    # Drained aside under the bucket's lease: only the own queue's holder may apply it now.
    assert forwarding.way(aside, "k1", route(open_move=False), aside=True) is Way.HAND_BACK
    # In its own queue: waiting while the move is open, applied once it is closed.
    assert forwarding.way(own, "k1", route(open_move=True), aside=False) is Way.MOVING
    assert forwarding.way(own, "k1", route(open_move=False), aside=False) is None
    # A copy left in an own queue its route no longer names.
    assert forwarding.way(own, "k1", None, aside=False) is Way.STALE
    elsewhere = route(open_move=False, queue="keyq.s.k.other")
    assert forwarding.way(own, "k1", elsewhere, aside=False) is Way.STALE
    own_aside = Routing(STREAM, {ASIDE: OWN}, frozenset())
    assert own_aside.way(aside, "k1", route(open_move=True), aside=True) is Way.HAND_BACK
    assert own_aside.way(aside, "k1", route(open_move=False), aside=True) is None


def test_a_promoted_keys_share_of_a_batch_follows_what_its_events_cost() -> None:
    config = StreamConfig.from_json("s", '{"mode":"auto","buckets":4}')
    own, bucket = config.own_queue_for("hot"), config.queue_for("hot")
    settings = WorkerSettings(auto_key_batch_max=200)
    cost = OwnEventCost(config)
    assert shared_cap(settings, bucket, cost) is None  # buckets are never capped
    assert shared_cap(settings, own, cost) == 200  # until its cost is known
    cost.note([plain_delivery(bucket, 1)] * 10, 0.1)  # a job's fixed cost
    for _ in range(50):
        cost.note([plain_delivery(bucket, 1)] * 1000, 0.2)  # 0.1 ms an event of the buckets
    for _ in range(50):  # 1 ms an event of the own queue
        cost.note([plain_delivery(own, 1)] * 200 + [plain_delivery(bucket, 1)] * 1000, 0.4)
    assert 245 <= (shared_cap(settings, own, cost) or 0) <= 255
    cost.note([plain_delivery(own, 1)] * 200 + [plain_delivery(bucket, 1)] * 1000, 3.0)
    assert 245 <= (shared_cap(settings, own, cost) or 0) <= 255  # one slow batch is not the cost
    cheap = OwnEventCost(config)
    cheap.note([plain_delivery(bucket, 1)] * 10, 0.1)
    cheap.note([plain_delivery(own, 1)] * 5000, 0.35)  # 0.05 ms an event
    # Before the other events' cost is known, the batch's cost is shared by all its events.
    cheap.note([plain_delivery(own, 1)] * 1000 + [plain_delivery(bucket, 1)] * 4000, 0.35)
    assert shared_cap(settings, own, cheap) == round(SHARED_BATCH_S / 0.00005)
