"""The pure parts of auto mode: which keys are promoted (RouteWatch), where the key gate
routes a delivery (Routing.way), and where a promoted key's own queue is held (with the
routes in the real Redis)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from keyq.broker.key_control import KeyStatus, ParkedKey
from keyq.broker.naming import Mode
from keyq.broker.routes import Route, RouteBook
from keyq.broker.streams import StreamConfig, ensure_stream_config
from keyq.producer.route_follow import CAUGHT_UP_S, PutOff, RouteFollower
from keyq.worker.auto_mode import SHARED_BATCH_S, OwnEventCost, shared_cap
from keyq.worker.batch.key_gate import Routing, Way
from keyq.worker.batch.route_watch import CURRENT_S, SLOW_EVENT_S, Published, RouteWatch
from keyq.worker.config import WorkerSettings
from keyq.worker.holding.placement import SPREAD_WAIT_S, Placement, auto_share
from tests.conftest import StreamFixture
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
    return [(producer, first_seq + n, start_ms + round(n * every_ms)) for n in range(events)]


def due(
    watch: RouteWatch,
    events: dict[str, list[Published]],
    *,
    now: float,
    statuses: dict[str, KeyStatus] | None = None,
    behind_ms: int = 0,
) -> dict[str, str]:
    """``watch.due``, taken ``behind_ms`` after the newest event was published."""
    newest = max((at_ms for each in events.values() for _, _, at_ms in each), default=0)
    return watch.due(events, statuses or {}, now, newest + behind_ms)


def test_a_key_is_promoted_by_its_publish_rate_over_a_window_not_by_one_quiet_batch() -> None:
    watch = RouteWatch(rate=100, backlog=1000)
    # 40 events published 7 ms apart (about 140 a second), taken in attempts: the first
    # spans 0.27 s, under half the window, so it counts as half a window's worth (80 a second).
    assert due(watch, {"k1": published(0, 40, 7)}, now=10.0) == {}
    found = due(watch, {"k1": published(280, 40, 7, first_seq=41)}, now=10.5)
    assert found == {"k1": "rate"}
    assert due(watch, {"k1": published(560, 40, 7, first_seq=81)}, now=11.0) == {}
    # Bursts of 40 a millisecond apart, 1.5 s apart: never 100 a second.
    assert due(watch, {"k2": published(0, 40, 1)}, now=20.0) == {}
    assert due(watch, {"k2": published(1500, 40, 1, first_seq=41)}, now=20.1) == {}


def test_a_key_that_has_just_got_hot_is_promoted_by_the_first_attempt_that_takes_it() -> None:
    """Its first 0.08 s at 2,000 a second: the rate over what it was seen for, while its
    bucket is current. A count over a whole window would wait for later attempts, by which
    time applying its events may have put the bucket behind."""
    watch = RouteWatch(rate=200, backlog=1000)
    assert due(watch, {"hot": published(0, 160, 0.5)}, now=5.0) == {"hot": "rate"}


def test_a_backlog_taken_fast_is_not_a_hot_key() -> None:
    """A bucket draining a backlog takes a key's old events faster than they were published:
    500 events published 20 ms apart (50 a second) taken within half a second."""
    watch = RouteWatch(rate=100, backlog=1000)
    backlog = published(0, 500, 20)
    for n, start in enumerate(range(0, 500, 100)):
        assert due(watch, {"cold": backlog[start : start + 100]}, now=30.0 + n * 0.1) == {}
    # Published 5 ms apart (200 a second), the first 100 are a hot key's.
    assert due(watch, {"hot": published(0, 100, 5)}, now=40.0) == {"hot": "rate"}


def test_a_hot_key_in_a_bucket_far_behind_is_promoted_by_its_backlog_only() -> None:
    """Its producers' switch would wait for the bucket's holder to reach their last events
    there, longer than they wait: a promotion would only forward its events."""
    watch = RouteWatch(rate=100, backlog=300)
    behind = round(CURRENT_S * 1000) + 500
    hot = published(0, 200, 2)  # 500 a second
    assert due(watch, {"k": hot}, now=80.0, behind_ms=behind) == {}
    more = published(400, 200, 2, first_seq=201)
    assert due(watch, {"k": more}, now=80.1, behind_ms=behind - 1000) == {"k": "rate"}
    backlog = published(0, 300, 2)
    assert due(watch, {"b": backlog}, now=81.0, behind_ms=60_000) == {"b": "backlog"}


def test_a_slow_hot_key_is_promoted_by_its_rate_however_far_behind_its_bucket() -> None:
    """Forwarding a slow key's events costs far less than applying them: a bucket behind
    because of it, or taken over behind, gets its other keys back at once."""
    cost: list[float | None] = [None]
    watch = RouteWatch(rate=100, backlog=1000, event_cost=lambda: cost[0])
    behind = round(CURRENT_S * 1000) + 5000
    assert due(watch, {"k": published(0, 200, 2)}, now=90.0, behind_ms=behind) == {}
    cost[0] = SLOW_EVENT_S / 10  # cheap: forwarding would cost about what applying does
    more = published(400, 200, 2, first_seq=201)
    assert due(watch, {"k": more}, now=90.1, behind_ms=behind) == {}
    cost[0] = SLOW_EVENT_S
    again = published(800, 200, 2, first_seq=401)
    assert due(watch, {"k": again}, now=90.2, behind_ms=behind) == {"k": "rate"}


def test_each_event_counts_once_and_producers_clocks_need_not_agree() -> None:
    watch = RouteWatch(rate=100, backlog=1000)
    # The same 45 events taken again and again (a rerun attempt, deferred behind a gap).
    again = published(0, 45, 5)
    for n in range(5):
        assert due(watch, {"k": again}, now=50.0 + n * 0.1) == {}
    # Two producers at 50 a second each, their clocks 5 s apart: 100 a second.
    ahead = published(5000, 50, 20, producer="b")
    assert due(watch, {"two": published(0, 50, 20, producer="a")}, now=60.0) == {}
    assert due(watch, {"two": ahead}, now=60.1) == {"two": "rate"}
    # A producer's clock stepped back 10 s: its events count again from there.
    assert due(watch, {"step": published(20_000, 50, 20)}, now=70.0) == {}
    stepped = published(10_000, 50, 20, first_seq=51)
    assert due(watch, {"step": stepped}, now=70.1) == {}  # 50 a second, not 100
    faster = published(11_000, 80, 5, first_seq=101)
    assert due(watch, {"step": faster}, now=70.2) == {"step": "rate"}


def test_a_put_off_switch_is_tried_again_once_its_bucket_passes_events_soon_after() -> None:
    put_off = PutOff(until=100.0, sent=10)
    assert not put_off.caught_up(passed=5, now=0.0)  # marks seq 10, sent by now
    put_off.sent = 40
    assert not put_off.caught_up(passed=9, now=0.5)
    late = CAUGHT_UP_S + 1
    assert not put_off.caught_up(passed=10, now=late)  # passed, but late: marks seq 40
    put_off.sent = 60
    assert put_off.caught_up(passed=40, now=late + CAUGHT_UP_S / 2)
    assert PutOff(until=100.0, sent=10).caught_up(passed=10, now=0.0)  # nothing left in it


class _Book:
    """A route book with one promoted key, and how far its bucket has passed."""

    def __init__(self, key: str, queue: str) -> None:
        self.own = {key: SimpleNamespace(queue=queue)}
        self.passed_seq = 0

    def version(self) -> tuple[int, int]:
        return (1, 0)

    def promoted(self) -> dict[str, Any]:
        return self.own

    def passed(self, keys: Any, producer: str) -> dict[str, int]:
        return dict.fromkeys(keys, self.passed_seq)


def test_a_put_off_lasts_until_the_bucket_passes_the_events_held_while_switching() -> None:
    config = StreamConfig("units-follow", Mode.AUTO, buckets=4)
    key = "k-1"
    book = _Book(key, config.own_queue_for(key))
    follower = RouteFollower(cast(RouteBook, book), config, "p-1")
    follower.step()  # reads the route
    own = config.own_queue_for(key)
    assert follower.queue_for(key, 10) == own  # seq 11: the switch
    follower.queue_for(key, 11)  # seq 12, held too
    assert follower.switched(key, done=False)  # put off: 11 and 12 go to the bucket
    # the bucket has passed what went there before the switch only, then everything sent there
    for passed, seq, queue in ((10, 12, config.queue_for(key)), (13, 13, own)):
        book.passed_seq = passed
        follower._refresh_due = 0.0  # the next read, without waiting for it
        follower.step()
        assert follower.queue_for(key, seq) == queue, f"bucket passed {passed}"


def test_backlog_held_back_and_rate_limited_keys_are_promoted_at_once() -> None:
    watch = RouteWatch(rate=1e9, backlog=500)
    paused = KeyStatus(paused_since_ms=1)
    parked_with_aside = KeyStatus(parked=ParkedKey(1, "poison", "p", 3), aside=("q",))
    promoted = KeyStatus(route=route(open_move=False))
    watch.limited(["limited"], now=5.0)
    found = due(
        watch,
        {
            "big": published(0, 500, 0),
            "paused": published(0, 1, 0),
            "aside": published(0, 1, 0),
            "limited": published(0, 1, 0),
            "promoted": published(0, 900, 0),
            "small": published(0, 3, 0),
        },
        now=5.1,
        statuses={"paused": paused, "aside": parked_with_aside, "promoted": promoted},
    )
    assert found == {"big": "backlog", "paused": "stopped", "limited": "rate-limited"}
    again = {"limited": published(0, 1, 0, first_seq=2)}
    assert due(watch, again, now=7.0) == {}  # given once, and forgotten


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
    assert shared_cap(settings, bucket, cost, 0) is None  # buckets are never capped
    # Until its cost is known: 200, or as many as the other queues have.
    assert shared_cap(settings, own, cost, 50) == 200
    assert shared_cap(settings, own, cost, 3000) == 3000
    cost.note({bucket: 10}, 0.1)  # a job's fixed cost
    for _ in range(50):
        cost.note({bucket: 1000}, 0.2)  # 0.1 ms an event of the buckets
    assert cost.bucket_s is not None and abs(cost.bucket_s - 0.0001) < 1e-9
    for _ in range(50):  # 1 ms an event of the own queue
        cost.note({own: 200, bucket: 1000}, 0.4)
    assert 245 <= (shared_cap(settings, own, cost, 0) or 0) <= 255
    cost.note({own: 200, bucket: 1000}, 3.0)
    assert 245 <= (shared_cap(settings, own, cost, 0) or 0) <= 255  # one slow batch is not it
    # Known, it holds however many the buckets have: some may be the key's own, forwarded.
    assert 245 <= (shared_cap(settings, own, cost, 3000) or 0) <= 255


def test_only_the_events_a_job_applied_tell_what_they_cost() -> None:
    """A batch of the own queue's events waiting for their key's move applies none of them:
    its job says nothing of their cost."""
    config = StreamConfig.from_json("s", '{"mode":"auto","buckets":4}')
    own, bucket = config.own_queue_for("hot"), config.queue_for("hot")
    cost = OwnEventCost(config)
    cost.note({bucket: 10}, 0.1)
    for _ in range(20):
        cost.note({bucket: 50}, 0.1)  # the own queue's 500 waited: nothing of them applied
        cost.note({}, 0.0)  # a commit of forwards only: no job, so no job's fixed cost
    assert cost.own_s is None
    assert cost.bucket_s is None  # no batch of 100 bucket events
    for _ in range(20):
        cost.note({own: 500}, 0.6)
    assert cost.own_s is not None and abs(cost.own_s - 0.001) < 1e-6
    capped = shared_cap(WorkerSettings(auto_key_batch_max=10), own, cost, 5000)
    assert capped == round(SHARED_BATCH_S / 0.001)


def test_an_auto_share_leaves_room_for_every_own_queue_whoever_holds_the_buckets() -> None:
    queues = [f"keyq.s.b.{b:05d}" for b in range(64)] + ["keyq.s.k.a", "keyq.s.k.b", "keyq.s.k.c"]
    for members in (["w1"], ["w1", "w2"], ["w1", "w2", "w3"]):
        shares = [auto_share(STREAM, queues, members, worker) for worker in members]
        assert sum(shares) >= len(queues)
        assert max(shares) - min(shares) <= 1
    assert auto_share(STREAM, queues[:64], ["w1", "w2"], "w2") == 32  # no own queue: no slack


def test_the_holder_of_a_keys_bucket_leaves_its_own_queue_to_a_peer_for_a_while(
    stream: StreamFixture,
) -> None:
    config = ensure_stream_config(stream.redis, stream.name, mode="auto", buckets=4)
    book = RouteBook(stream.redis, stream.name)
    key = "hot-1"
    own, bucket = config.own_queue_for(key), config.queue_for(key)
    other_bucket = next(q for q in (config.queue_for(f"k{n}") for n in range(100)) if q != bucket)
    assert book.promote(key, own, bucket, "operator") is not None
    spread = Placement(stream.redis, stream.name, config.mode, "w1", None)
    assert spread.left_to_peers([own, other_bucket], [bucket], 2, now=100.0) == {own}
    assert spread.left_to_peers([own], [bucket], 2, now=100.0 + SPREAD_WAIT_S - 0.1) == {own}
    assert spread.left_to_peers([own], [bucket], 2, now=100.0 + SPREAD_WAIT_S) == set()
    assert spread.left_to_peers([own], [other_bucket], 2, now=200.0) == set()  # not its bucket
    assert spread.left_to_peers([own], [bucket], 1, now=300.0) == set()  # no peer to leave it to
