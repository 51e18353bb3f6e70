"""Auto mode: keys moved between their bucket and a queue of their own keep their order and are
applied exactly once, with workers killed -9 before, during and after a move, two producers
publishing throughout, and the janitor demoting idle own queues.

Every event carries its producer and number; the ledger pipeline records, per key and producer,
the numbers in the order applied, so a lost, reordered or twice-applied event shows."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keyq import Producer
from keyq.broker.key_control import KeyControl
from keyq.broker.locks import FencedLocks
from keyq.broker.membership import Membership
from keyq.broker.routes import WHY_OPERATOR, RouteBook
from keyq.broker.streams import ensure_stream_config
from keyq.producer import route_follow
from keyq.producer.route_follow import SWITCH_BACKOFF_S, SWITCH_WAIT_S
from keyq.worker.batch.route_watch import CURRENT_S
from keyq.worker.batch.state_store import StateStore
from tests.conftest import StreamFixture
from tests.workers import idle_janitor, run_keyq, wait_until

pytestmark = pytest.mark.slow

BUCKETS = 4
QUIET = {"KEYQ_AUTO_PROMOTE_RATE": "1000000", "KEYQ_AUTO_PROMOTE_BACKLOG": "1000000"}


class Moves:
    """An auto stream, its workers, producers and janitors, its routes, and what was applied;
    the producers and janitors are closed by the ``moves`` fixture, the workers by ``workers``."""

    def __init__(self, stream: StreamFixture, workers: Any, tmp: Path, env: dict[str, str]) -> None:
        self.stream = stream
        self.config = ensure_stream_config(stream.redis, stream.name, mode="auto", buckets=BUCKETS)
        self.book = RouteBook(stream.redis, stream.name)
        self.store = StateStore(stream.redis, stream.name)
        self._start, self._tmp = workers, tmp
        self.env = {"KEYQ_BATCH_MAX_EVENTS": "50", "KEYQ_IDLE_RELEASE_MS": "1000", **env}
        self.running: list[Any] = []
        self.producers: list[Producer] = []
        self.janitors: list[Any] = []

    def worker(self, pipeline: str = "tests.pipelines:ledger") -> Any:
        started = self._start(self.stream.name, pipeline=pipeline, env=self.env)
        self.running.append(started)
        return started

    def kill_all(self) -> None:
        while self.running:
            self.running.pop().kill()

    def producer(self) -> Producer:
        settings = self.stream.settings
        self.producers.append(
            Producer(self.stream.name, mode="auto", buckets=BUCKETS, settings=settings)
        )
        return self.producers[-1]

    def janitor(self, **timing: Any) -> Any:
        s = self.stream
        self.janitors.append(idle_janitor(s.settings, self._tmp, s.name, **timing))
        return self.janitors[-1]

    def close(self) -> None:
        for producer in self.producers:
            producer.close(timeout=10)
        for janitor in self.janitors:
            janitor.terminate()
            janitor.close()

    def promote(self, key: str) -> None:
        config = self.config
        route = self.book.promote(key, config.own_queue_for(key), config.queue_for(key), "operator")
        assert route is not None and route.why == WHY_OPERATOR

    def routed(self, key: str) -> bool:
        route = self.book.route(key)
        return route is not None and not route.open

    def reported(self, figure: str) -> int:
        """The sum of a figure over the live workers' reports."""
        reports = Membership(self.stream.redis, self.stream.name, 1).info().values()
        return sum(int(str(report.get(figure, 0))) for report in reports)

    def seen(self, key: str, producer: str) -> list[int]:
        state = self.store.get(key) or {"seen": {}}
        return list(state["seen"].get(producer, []))

    def wrong(self, keys: list[str], producers: dict[str, int]) -> str:
        """The keys whose events are not each applied once, in order."""
        return ", ".join(
            f"{key}/{producer[-6:]}: {len(self.seen(key, producer))} of {total}"
            for key in keys
            for producer, total in producers.items()
            if self.seen(key, producer) != list(range(1, total + 1))
        )

    def wait_applied(self, keys: list[str], totals: dict[str, int], wait: float, what: str) -> None:
        wait_until(lambda: not self.wrong(keys, totals), wait, what)


@pytest.fixture
def moves(stream: StreamFixture, workers: Any, tmp_path: Path) -> Iterator[Any]:
    made: list[Moves] = []

    def make(env: dict[str, str]) -> Moves:
        made.append(Moves(stream, workers, tmp_path, env))
        return made[-1]

    yield make
    for run in made:
        run.close()


def publish(producer: Producer, keys: list[str], first: int, last: int, pause: float) -> list[Any]:
    receipts = []
    for n in range(first, last + 1):
        for key in keys:
            receipts.append(producer.publish(key, {"n": n, "producer": producer.producer_id}))
        time.sleep(pause)
    return receipts


def test_moves_keep_order_and_apply_once_with_kills_before_during_and_after(
    stream: StreamFixture, moves: Any
) -> None:
    run = moves(QUIET)
    keys = [f"order-{i}" for i in range(8)]
    moved = keys[:3]
    first, second = run.producer(), run.producer()
    run.worker().wait_ready()
    run.worker()
    run.janitor(idle_ttl_s=2, every_s=0.5)
    totals = {first.producer_id: 240, second.producer_id: 240}
    try:
        # The second producer runs on its own thread: the two switch at different moments.
        other = threading.Thread(target=publish, args=(second, keys, 1, 240, 0.02))
        other.start()
        publish(first, keys, 1, 40, 0.02)
        run.promote(moved[0])  # before a kill: the move closes on a live bucket holder
        publish(first, keys, 41, 80, 0.02)
        run.kill_all()  # during: the second key's move opens with nobody holding its bucket
        run.promote(moved[1])
        run.worker().wait_ready()
        run.worker()
        publish(first, keys, 81, 160, 0.02)
        # What reached the second key's bucket before the producers read its route, while
        # nobody held the bucket, is forwarded by the bucket's new holder.
        wait_until(lambda: run.reported("forwarded") > 0, 60, "events forwarded")
        run.promote(moved[2])
        publish(first, keys, 161, 200, 0.02)
        run.kill_all()  # after: forwarded copies and own queues are taken over
        run.worker().wait_ready()
        run.worker()
        publish(first, keys, 201, 240, 0.02)
        other.join(120)
        first.flush(timeout=60)
        second.flush(timeout=60)
        run.wait_applied(keys, totals, 240, "every key applied 1..N once")
        for key in moved:
            route = run.book.route(key)
            assert route is None or not route.open, (key, route)
        # Idle now: the janitor deletes the own queues and demotes their keys.
        wait_until(lambda: run.book.count() == 0, 120, "every moved key demoted")
        assert run.book.counts().get("demoted", 0) >= len(moved)
        # Back in their buckets, the keys flow on.
        publish(first, keys, 241, 260, 0.01)
        first.flush(timeout=60)
        totals[first.producer_id] = 260
        run.wait_applied(keys, totals, 120, "events after the demotion")
        history = [row["what"] for row in run.book.history(limit=100, key=moved[0])]
        assert history[:3] == ["demoted", "closed", "promoted"], history
    except AssertionError:
        for key in keys:
            found = run_keyq(stream.settings, "inspect", "--stream", stream.name, "--key", key)
            print(found.stdout)
        raise


def test_a_hot_key_is_promoted_by_its_rate_and_a_paused_one_when_held_back(
    stream: StreamFixture, moves: Any
) -> None:
    # Batches of up to 500 keep up with the publishing below: a key is promoted by its rate
    # only while its bucket does.
    run = moves({"KEYQ_AUTO_PROMOTE_RATE": "100", "KEYQ_BATCH_MAX_EVENTS": "500"})
    hot, paused, cold = "hot-1", "paused-1", [f"cold-{i}" for i in range(5)]
    producer = run.producer()
    control = KeyControl(stream.redis, stream.name)
    control.pause([paused])
    run.worker().wait_ready()
    # About 250 events a second, published until the key is promoted.
    n = 0
    while n < 600 or (n < 6000 and run.book.route(hot) is None):
        n += 1
        producer.publish(hot, {"n": n, "producer": producer.producer_id})
        if n % 20 == 0:
            for key in [paused, *cold]:
                producer.publish(key, {"n": n // 20, "producer": producer.producer_id})
        time.sleep(0.004)
    producer.flush(timeout=60)
    wait_until(lambda: run.book.route(hot) is not None, 60, "the hot key promoted")
    wait_until(lambda: run.book.route(paused) is not None, 60, "the paused key promoted")
    wait_until(lambda: run.reported("promoted") >= 2, 30, "the promotions reported")
    hot_route, paused_route = run.book.route(hot), run.book.route(paused)
    assert hot_route is not None and hot_route.why == "rate", hot_route  # not 1,000 in one
    assert paused_route is not None and paused_route.why == "stopped", paused_route
    for key in cold:
        assert run.book.route(key) is None, key
    totals, each = {producer.producer_id: n}, {producer.producer_id: n // 20}
    run.wait_applied([hot], totals, 120, "the hot key applied")
    run.wait_applied(cold, each, 60, "cold keys")
    assert run.seen(paused, producer.producer_id) == []  # paused: nothing applied
    control.resume([paused])
    run.wait_applied([paused], each, 120, "resumed key")
    # The drained aside queue is dropped from the key's list after its events are applied.
    wait_until(lambda: not control.keys_aside(), 30, "the resumed key's aside list emptied")


def test_own_queues_switches_and_demotion_under_two_workers(
    stream: StreamFixture, moves: Any
) -> None:
    """Three behaviours on one pair of workers, each on keys (and a producer) of its own:

    switch: a producer sends nothing of a key to its own queue while its earlier events of the
    key are still in the bucket: with nobody holding the bucket the switch is put off and the
    events go to the bucket; once they have been forwarded the producer switches.

    follow: once a producer has read a key's route, the key's events go straight to its own
    queue: its bucket's holder forwards only what came before. When the janitor retires the
    idle own queue, events that wait for its lease go to the bucket instead (the lease needs
    the route).

    peer: a promoted key's own queue is held by the worker that does not hold its bucket, so
    the key's events never share a batch with its bucket-mates (one key per bucket, so both
    workers' buckets are tried). Every event of every key is applied once, in order."""
    run = moves(QUIET)
    late, late_producer = "late-1", run.producer()
    publish(late_producer, [late], 1, 20, 0.0)
    late_producer.flush(timeout=30)
    run.promote(late)  # nobody holds the bucket: nothing can be forwarded yet
    time.sleep(0.5)  # the producer reads routes every 0.25 s
    publish(late_producer, [late], 21, 40, 0.0)
    late_producer.flush(timeout=30)  # confirmed only once they went to the bucket
    assert late_producer.stats["rerouted"] == 20, "switch: events put off to the bucket"
    for started in (run.worker(), run.worker()):
        started.wait_ready()
    run.wait_applied([late], {late_producer.producer_id: 40}, 60, "switch: the key applied")
    time.sleep(SWITCH_BACKOFF_S)  # the switch was put off
    receipts = publish(late_producer, [late], 41, 60, 0.0)
    late_producer.flush(timeout=30)
    assert receipts[-1].queue == run.config.own_queue_for(late), "switch: not made after it"
    assert late_producer.stats["rerouted"] == 20, "switch: put off again"
    run.wait_applied([late], {late_producer.producer_id: 60}, 60, "switch: after it")

    hot, cold, producer = "hot-7", "cold-7", run.producer()
    forwarded = run.reported("forwarded")
    publish(producer, [hot, cold], 1, 20, 0.01)
    run.promote(hot)
    wait_until(lambda: run.routed(hot), 30, "follow: the move closed")
    time.sleep(0.5)  # the producer reads routes every 0.25 s
    receipts = publish(producer, [hot], 21, 220, 0.0)
    producer.flush(timeout=60)
    assert {r.queue for r in receipts} == {run.config.own_queue_for(hot)}, "follow: not direct"
    run.wait_applied([hot], {producer.producer_id: 220}, 120, "follow: the hot key applied")
    assert run.reported("forwarded") - forwarded < 200, "follow: the direct events forwarded"
    janitor = run.janitor(idle_ttl_s=1, every_s=0.3)
    # One event every 3 s: the own queue goes idle in between, is marked, and the event
    # published during the mark waits until the key is demoted, then goes to the bucket.
    deadline = time.monotonic() + 90
    n = 220
    while producer.stats["rerouted"] == 0:
        assert time.monotonic() < deadline, "follow: no event left the own queue for the bucket"
        n += 1
        producer.publish(hot, {"n": n, "producer": producer.producer_id})
        time.sleep(3)
    producer.flush(timeout=60)
    assert run.book.route(hot) is None, "follow: the key not demoted"
    run.wait_applied([hot], {producer.producer_id: n}, 120, "follow: the events after demotion")
    after = producer.publish(hot, {"n": n + 1, "producer": producer.producer_id})
    assert after.queue == run.config.queue_for(hot), "follow: not back to the bucket"
    # The peer check counts on room for one own queue per bucket: the own queues of the keys
    # above go first (demoted, idle), and the janitor stops before new ones come.
    wait_until(lambda: run.book.count() == 0, 60, "follow: every key demoted")
    janitor.terminate()

    locks = FencedLocks(stream.redis, stream.name)
    keys: dict[str, str] = {}  # bucket -> one key of it
    for n in range(200):
        keys.setdefault(run.config.queue_for(f"spread-{n}"), f"spread-{n}")
    assert len(keys) == BUCKETS

    def owners(queues: list[str]) -> dict[str, str | None]:
        held = locks.holders(queues).items()
        return {queue: None if lease is None else lease.owner for queue, lease in held}

    spread = run.producer()
    own = {run.config.own_queue_for(key): bucket for bucket, key in keys.items()}
    placed: dict[str, tuple[str, str]] = {}  # own queue -> (its holder, its bucket's holder)
    publish(spread, list(keys.values()), 1, 5, 0.01)  # the buckets are declared

    def split() -> bool:
        holders = owners(list(keys)).values()
        return len({o for o in holders if o}) == 2 and all(holders)

    wait_until(split, 30, "peer: the buckets split between both workers")
    for key in keys.values():
        run.promote(key)
    n = 5
    deadline = time.monotonic() + 60
    while len(placed) < len(own):
        assert time.monotonic() < deadline, f"peer: own queues held: {sorted(placed)}"
        n += 1
        publish(spread, list(keys.values()), n, n, 0.05)
        holders = owners([*own, *keys])
        for queue, bucket in own.items():
            if holders[queue] and queue not in placed:
                placed[queue] = (str(holders[queue]), str(holders[bucket]))
    spread.flush(timeout=60)
    beside = [queue for queue, (holder, beside) in placed.items() if holder == beside]
    assert not beside, f"peer: held beside their bucket: {beside} of {placed}"
    run.wait_applied(list(keys.values()), {spread.producer_id: n}, 120, "peer: every event")


@pytest.mark.alone
def test_a_put_off_switch_is_made_once_its_bucket_has_caught_up(
    moves: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A switch put off because nobody applied the bucket (its holder stopped with SIGSTOP) is
    tried again once the holder is back and through the backlog, not only when the put-off runs
    out: the key's events go to its own queue within seconds of the holder's return, none is
    put off again, and every event is applied once, in order."""
    slow_ttls = {"KEYQ_LOCK_TTL_MS": "15000", "KEYQ_MEMBER_TTL_MS": "15000"}  # outlast the stop
    # The put-off this producer waits out, long enough that a loaded machine's holder gets
    # through its backlog well before it: a switch made before it ran out was not its doing.
    backoff_s = 30.0
    monkeypatch.setattr(route_follow, "SWITCH_BACKOFF_S", backoff_s)
    run = moves({**QUIET, **slow_ttls})
    key = "stalled-1"
    own = run.config.own_queue_for(key)
    sent: list[tuple[float, str]] = []  # (when published, the queue it was addressed to)
    failures: list[Exception] = []
    stop = threading.Event()
    producer = run.producer()

    def paced() -> None:
        try:
            while not stop.is_set():
                event = {"n": len(sent) + 1, "producer": producer.producer_id}
                sent.append((time.monotonic(), producer.publish(key, event).queue))
                time.sleep(0.02)
        except Exception as exc:  # noqa: BLE001 - reported by the test, not lost with the thread
            failures.append(exc)

    publishing = threading.Thread(target=paced)
    holder = run.worker().wait_ready()
    publishing.start()
    try:
        wait_until(lambda: run.seen(key, producer.producer_id), 30, "the key applied")
        holder.pause()
        run.promote(key)
        wait_until(lambda: producer.stats["rerouted"] > 0, 15, "the switch put off")
        holder.resume()
        back = time.monotonic()
        time.sleep(0.5)
        rerouted = producer.stats["rerouted"]
        wait_until(
            lambda: any(at > back and queue == own for at, queue in sent),
            backoff_s - 2.5,  # the put-off runs out about backoff_s after the resume
            "events addressed to the own queue again, before the put-off ran out",
        )
        time.sleep(SWITCH_WAIT_S + 1)  # a switch that waited in vain is put off by now
        assert producer.stats["rerouted"] == rerouted
    finally:
        stop.set()
        holder.resume()
        publishing.join(timeout=30)
        producer.flush(timeout=30)
    assert not failures, failures
    totals = {producer.producer_id: len(sent)}
    run.wait_applied([key], totals, 60, "every event applied once, in order")


def test_a_backlog_of_one_key_is_promoted_and_forwarded_whole(moves: Any) -> None:
    """Thousands of one key's events wait in its bucket when the worker starts: the attempt
    that shows them promotes the key by its backlog (published fast, but long before: not by
    its rate; the backlog lowered to 400, since at the defaults one batch takes at most the
    bucket's prefetch of 1,000 events and the cold keys' share) and forwards them at once,
    within the own queue's publish lease (at the default batch size), while its bucket-mates
    are applied in the bucket."""
    run = moves({"KEYQ_AUTO_PROMOTE_BACKLOG": "400"})
    run.env.pop("KEYQ_BATCH_MAX_EVENTS")
    big, cold = "big-1", [f"cold-{i}" for i in range(20)]
    producer = run.producer()
    for n in range(1, 3001):
        producer.publish(big, {"n": n, "producer": producer.producer_id})
        if n % 100 == 0:
            for key in cold:
                producer.publish(key, {"n": n // 100, "producer": producer.producer_id})
    producer.flush(timeout=60)
    run.worker().wait_ready()
    run.wait_applied([big], {producer.producer_id: 3000}, 180, "the big key applied")
    run.wait_applied(cold, {producer.producer_id: 30}, 60, "cold keys")
    route = run.book.route(big)
    assert route is not None and route.why == "backlog", route
    assert all(run.book.route(key) is None for key in cold)
    assert run.reported("forwarded") >= 1000


@pytest.mark.alone
def test_a_slow_hot_key_is_promoted_by_its_rate_in_a_bucket_far_behind(moves: Any) -> None:
    """A worker stopped for seconds (SIGSTOP) while a key is published fast finds it in its
    bucket far behind. Its events are slow to apply (1 ms each), so forwarding them pays
    whether or not producers can switch: once the worker has measured what its bucket's
    events cost it promotes the key by its rate, and applies its bucket-mates in the bucket."""
    pace = {"KEYQ_AUTO_PROMOTE_RATE": "150", "KEYQ_TEST_EVENT_PAUSE": "0.001"}
    run = moves({**pace, "KEYQ_BATCH_MAX_EVENTS": "500"})  # 100 events or more tell the cost
    hot, cold = "slow-hot-1", [f"cold-{i}" for i in range(5)]
    producer = run.producer()
    worker = run.worker(pipeline="tests.pipelines:ledger_paced").wait_ready()
    try:
        for n in range(1, 21):  # small batches first: they tell a job's fixed cost
            for key in cold:
                producer.publish(key, {"n": n, "producer": producer.producer_id})
            time.sleep(0.05)
        producer.flush(timeout=60)
        run.wait_applied(cold, {producer.producer_id: 20}, 60, "warm-up")
        worker.pause()
        for n in range(1, 1501):
            producer.publish(hot, {"n": n, "producer": producer.producer_id})
            if n % 50 == 0:
                for key in cold:
                    producer.publish(key, {"n": 20 + n // 50, "producer": producer.producer_id})
        producer.flush(timeout=60)
        time.sleep(2 * CURRENT_S)  # behind by more than CURRENT_S when taken
    finally:
        worker.resume()
    wait_until(lambda: run.book.route(hot) is not None, 60, "the slow hot key promoted")
    route = run.book.route(hot)
    assert route is not None and route.why == "rate", route
    run.wait_applied([hot], {producer.producer_id: 1500}, 120, "the slow hot key applied")
    run.wait_applied(cold, {producer.producer_id: 50}, 60, "cold keys")
    assert all(run.book.route(key) is None for key in cold)


def test_the_bucket_holder_alone_may_close_a_move(stream: StreamFixture) -> None:
    """A close is fenced by the bucket's lock: a stale holder's close is refused."""
    config = ensure_stream_config(stream.redis, stream.name, mode="auto", buckets=BUCKETS)
    book = RouteBook(stream.redis, stream.name)
    key = "k-1"
    bucket = config.queue_for(key)
    route = book.promote(key, config.own_queue_for(key), bucket, "operator")
    assert route is not None and route.open and book.open_moves() == {key: bucket}
    assert book.promote(key, config.own_queue_for(key), bucket, "rate") == route  # idempotent
    locks = FencedLocks(stream.redis, stream.name)
    stale = locks.acquire(bucket, "w1", 10_000)
    assert stale is not None
    locks.release([stale])
    current = locks.acquire(bucket, "w2", 10_000)
    assert current is not None
    assert book.close(key, route.epoch, stale) is None
    assert book.demote(key, route.queue) is False  # never while open
    assert book.close(key, route.epoch, current) is True
    assert book.close(key, route.epoch, current) is False
    assert book.demote(key, "keyq.other.k.k-1") is False  # names another queue
    stream.redis.hset(stream.keys.aside, key, '["q"]')
    assert book.demote(key, route.queue) is False  # its events wait aside
    stream.redis.hdel(stream.keys.aside, key)
    assert book.demote(key, route.queue) is True
    assert book.route(key) is None and book.open_moves() == {}
    stream.redis.hset(stream.keys.aside, key, '["q"]')
    assert book.promote(key, config.own_queue_for(key), bucket, "rate") is None
    again = book.counts()
    assert again == {"promoted:operator": 1, "demoted": 1}, again
