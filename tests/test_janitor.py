"""The janitor on the real services: it deletes drained, idle, unheld, unused key-mode queues
(and only those), cleans up keyq's stale Redis state, leads each stream alone, and never loses
a confirmed event while producers and workers race its deletes."""

from __future__ import annotations

import logging
import random
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import orjson
import pika
import pytest

from keyq import Producer
from keyq.broker.clock import now_ms
from keyq.broker.errors import BrokerUnavailable
from keyq.broker.locks import FencedLocks
from keyq.broker.metrics import MetricsServer
from keyq.broker.naming import dead_letter_queue_name, key_queue_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.registry import QueueRegistry
from keyq.broker.retirement import RetirementFence
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import ensure_stream_config
from keyq.broker.topology import keyed_queue_arguments
from keyq.janitor import janitor as janitor_module
from keyq.janitor.config import JanitorSettings
from keyq.janitor.deleter import Outcome, QueueDeleter
from keyq.janitor.inventory import NOT_SET, InventoryUnavailable, list_queues
from keyq.janitor.janitor import Janitor
from keyq.janitor.metrics import JanitorMetrics
from keyq.worker.batch.state_store import StateStore
from tests.conftest import StreamFixture
from tests.faults import FaultProxy
from tests.helpers import drain, queue_depth, unpacked
from tests.scrapes import scrape_families
from tests.servers import free_port
from tests.workers import WorkerProcess, wait_until

LEASE_MS = 200
GRACE_MS = 500  # at least 2 x LEASE_MS, as the settings demand
# A flush waits at most for one retirement (grace + delete) and the re-declare after it.
FLUSH_TIMEOUT_S = 15


def fast_settings() -> Settings:
    """Producer settings with the same small lease and grace as the janitor's."""
    return load_settings(publish_lease_ms=LEASE_MS, retire_grace_ms=GRACE_MS)


def janitor_settings(**overrides: Any) -> JanitorSettings:
    fast = {"idle_ttl_s": 0, "publish_lease_ms": LEASE_MS, "retire_grace_ms": GRACE_MS}
    return load_settings(JanitorSettings, **{**fast, "janitor_interval_s": 0.2, **overrides})


def publish_one_each(
    stream: StreamFixture, keys: list[str], *, mode: str = "key", queue_type: str = "classic"
) -> list[str]:
    """One event per key, confirmed and registered; returns each key's queue, in key order.
    Under the default lease: with the tests' 200 ms one, a slow confirm sent an event again."""
    buckets = 4 if mode == "bucket" else None
    with Producer(
        stream.name, mode=mode, buckets=buckets, queue_type=queue_type, settings=load_settings()
    ) as producer:
        queues = [producer.publish(key, {"n": 1, "producer": "p"}).queue for key in keys]
        producer.flush(30)
    return queues


def drain_all(
    amqp: pika.BlockingConnection, queues: list[str], consume: bool = False, wait: float = 0.5
) -> list[Any]:
    """Every event in the queues, acked, as JSON; the channel is closed so every ack has been
    handled. ``consume`` for quorum queues, which refuse ``basic.get`` with a single active
    consumer."""
    channel = amqp.channel()
    try:
        if not consume:
            return [event.json() for queue in queues for event in drain(channel, queue)]
        events = []
        for queue in queues:
            for method, properties, body in channel.consume(queue, inactivity_timeout=wait):
                if method is None:
                    break
                events.extend(orjson.loads(event[3]) for event in unpacked(properties, body))
                channel.basic_ack(method.delivery_tag)
            channel.cancel()
        return events
    finally:
        channel.close()


def exists(amqp: pika.BlockingConnection, queue: str) -> bool:
    return queue_depth(amqp, queue) is not None


def has(janitor: Janitor, **expected: int) -> None:
    """The janitor's stats include ``expected``."""
    assert {name: janitor.stats[name] for name in expected} == expected, janitor.stats


@contextmanager
def running(*janitors: Janitor) -> Iterator[None]:
    """Run the janitors in threads; they are stopped (and must stop cleanly) on the way out."""
    errors: dict[str, BaseException] = {}

    def run(janitor: Janitor) -> None:
        try:
            janitor.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors[janitor.janitor_id] = exc

    threads = [threading.Thread(target=run, args=(janitor,), daemon=True) for janitor in janitors]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        for janitor in janitors:
            janitor.stop()
        for thread in threads:
            thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "a janitor did not stop"
    assert errors == {}


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_deletes_drained_idle_queue_and_spares_busy_ones(
    stream: StreamFixture, amqp: pika.BlockingConnection, queue_type: str
) -> None:
    """Quorum queues refuse conditional deletes: the janitor locks and checks them instead,
    with the same outcomes."""
    keys = ["drained", "backlog", "held", "consumed"]
    drained, backlog, held, consumed = queues = publish_one_each(
        stream, keys, queue_type=queue_type
    )
    quorum = queue_type == "quorum"
    assert len(drain_all(amqp, [drained, held, consumed], consume=quorum)) >= 3
    assert queue_depth(amqp, backlog) == 1

    locks = FencedLocks(stream.redis, stream.name)
    # The drained queue was held by a worker once.
    earlier = locks.acquire(drained, "earlier-worker", 10_000)
    assert earlier is not None and locks.release([earlier]) == 1
    holder = locks.acquire(held, "fake-owner", 60_000)
    assert holder is not None
    consumer = amqp.channel()
    consumer.basic_consume(consumed, lambda *_: None)

    registry = QueueRegistry(stream.redis, stream.name)
    before = registry.queues()
    assert set(before) == set(queues)
    assert registry.original_keys([drained]) == {drained: "drained"}
    time.sleep(0.01)  # so that a touch is visibly later

    janitor = Janitor([stream.name], settings=janitor_settings(), janitor_id="janitor-basic")
    labels = {"janitor": janitor.janitor_id}
    with MetricsServer(0, "127.0.0.1", registry=JanitorMetrics(janitor).registry) as server:
        assert scrape_families(server.port)["keyq_janitor_deletions_total"].value(**labels) == 0
        janitor.run(once=True)
        families = scrape_families(server.port)

    has(janitor, deleted=1, forgotten=1, skipped_not_empty=1, revived=1, skipped_held=1)
    has(janitor, skipped_in_use=1, already_gone=0, adopted=0, not_leader=0, errors=0)
    # Its scrape counts the same.
    assert families["keyq_janitor_deletions_total"].value(**labels) == 1
    assert families["keyq_janitor_passes_total"].value(**labels) == 1
    skipped = families["keyq_janitor_skipped_total"].samples
    assert {sample[1]["janitor"] for sample in skipped} == {janitor.janitor_id}
    by_reason = {sample[1]["reason"]: sample[2] for sample in skipped}
    nothing = dict.fromkeys(["unreachable", "mark_lapsed", "aside"], 0)
    assert by_reason == {"held": 1, "not_empty": 1, "in_use": 1} | nothing
    for name in ("adopted", "members_pruned", "errors"):
        assert families[f"keyq_janitor_{name}_total"].kind == "counter"
        assert families[f"keyq_janitor_{name}_total"].value(**labels) == 0

    assert queue_depth(amqp, drained) is None  # gone everywhere
    after = registry.queues()
    assert drained not in after
    assert registry.original_keys([drained]) == {drained: None}
    # Fencing tokens are never issued twice: the same worker taking the queue's lock again
    # (its key spoke again) gets a new token, so a batch of its first holding cannot commit
    # under its second.
    again = locks.acquire(drained, "earlier-worker", 10_000)
    assert again is not None and again.token > earlier.token
    assert locks.commit([earlier], {stream.keys.state: {"k": "stale"}}) == {drained}
    assert locks.release([again]) == 1
    # The others are all still there, as they were.
    assert [queue_depth(amqp, queue) for queue in (backlog, held, consumed)] == [1, 0, 0]
    assert set(after) == {backlog, held, consumed}
    assert after[backlog] > before[backlog], "a refused backlog must be made active again"
    assert (after[held], after[consumed]) == (before[held], before[consumed])
    assert locks.holder(held) == holder
    assert locks.holders([backlog, consumed]) == {backlog: None, consumed: None}
    assert RetirementFence(stream.redis, stream.name).marked(queues) == []

    # Once nothing stands in the way, a later pass reclaims them too.
    assert locks.release([holder]) == 1
    consumer.close()
    assert len(drain_all(amqp, [backlog], consume=quorum)) >= 1
    janitor.run(once=True)
    has(janitor, deleted=4, forgotten=4)
    assert [queue for queue in queues if exists(amqp, queue)] == []
    assert registry.queues() == {}
    assert stream.redis.hlen(stream.keys.queue_keys) == 0
    assert RetirementFence(stream.redis, stream.name).marked(queues) == []


def test_repairs_bad_states_and_keeps_a_queue_whose_mark_lapsed_before_its_delete(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    """A retirement mark that lapses before its queue's delete (a janitor slower than the
    mark's ttl: under load a pass's later chunks waited past it) lets producers publish to the
    queue again; deleting it then could take an event on its way in. It is kept for a later
    pass, and the queue whose mark stood is deleted as usual."""
    lapsing, marked = publish_one_each(stream, ["lapsing", "marked"])
    assert len(drain_all(amqp, [lapsing, marked])) >= 2
    janitor = Janitor(
        [stream.name], settings=janitor_settings(retire_grace_ms=1500), janitor_id="janitor-lapse"
    )
    mark = stream.keys.retiring(lapsing)
    passing = threading.Thread(target=janitor.run, kwargs={"once": True}, daemon=True)
    passing.start()
    wait_until(lambda: bool(stream.redis.exists(mark)), 10, "the janitor's mark", every=0.01)
    stream.redis.delete(mark)  # as its ttl would, had the janitor been slow to delete
    passing.join(30)
    assert not passing.is_alive()
    has(janitor, skipped_lapsed=1, deleted=1)
    assert exists(amqp, lapsing) and not exists(amqp, marked)
    assert set(QueueRegistry(stream.redis, stream.name).queues()) == {lapsing}
    janitor.run(once=True)  # a later pass, whose mark stands, reclaims it
    assert not exists(amqp, lapsing)
    has(janitor, deleted=2)

    ensure_stream_config(stream.redis, stream.name, "key")
    registry = QueueRegistry(stream.redis, stream.name)
    # A registry entry whose queue does not exist (it was never declared).
    ghost = key_queue_name(stream.name, "ghost")
    registry.register({ghost: "ghost"}, announce=False)
    assert queue_depth(amqp, ghost) is None
    # A worker that stopped heartbeating a minute ago, and one that is alive.
    keys = stream.keys
    stream.redis.zadd(keys.members, {"dead-worker": now_ms() - 60_000})
    stream.redis.zadd(keys.members, {"live-worker": now_ms() + 60_000})
    for worker in ("dead-worker", "live-worker"):
        stream.redis.hset(keys.member_info, worker, orjson.dumps({"pid": 1}).decode())

    janitor = Janitor([stream.name], settings=janitor_settings(), janitor_id="janitor-repair")
    janitor.run(once=True)
    stats = janitor.stats
    has(janitor, members_pruned=1, forgotten=1, errors=0)
    assert ghost not in registry.queues()
    assert registry.original_keys([ghost]) == {ghost: None}
    assert queue_depth(amqp, ghost) is None
    assert stream.redis.zscore(keys.members, "dead-worker") is None
    assert not stream.redis.hexists(keys.member_info, "dead-worker")
    assert stream.redis.zscore(keys.members, "live-worker") is not None
    assert stream.redis.hexists(keys.member_info, "live-worker")
    assert registry.queues() == {}
    assert RetirementFence(stream.redis, stream.name).marked([ghost]) == []
    # RabbitMQ answers queue.delete of a missing queue with delete-ok (3.10) or 404 (others):
    # either way the entry is gone, and counted once.
    assert stats["deleted"] + stats["already_gone"] == 1, stats


@pytest.mark.broker_versions
@pytest.mark.parametrize("source", ["prometheus", "management", "management, prometheus down"])
def test_queues_a_crash_left_unregistered_are_found_on_the_brokers_own_listing(
    source: str, stream: StreamFixture, private_rabbit: Any
) -> None:
    """A keyq queue on the broker that nobody registered (a crash between declare and
    register) is adopted from the listing of the broker of KEYQ_AMQP_URL: its
    rabbitmq_prometheus or, on 3.x and 4.x alike (``/api/queues`` answers with the metrics
    collection off), its management API, also when prometheus is set and does not answer;
    the next pass reclaims it like any other."""
    dead = "http://127.0.0.1:1"  # nothing listens on port 1
    prometheus = {"prometheus": private_rabbit.prometheus_url, "management": ""}.get(source, dead)
    settings = janitor_settings(
        amqp_url=private_rabbit.url,
        prometheus_url=prometheus,
        management_url="" if source == "prometheus" else private_rabbit.management_url,
    )
    if source != "prometheus":  # neither answers: said, not guessed
        for management in (dead, None):
            unlisted = settings.model_copy(
                update={"prometheus_url": dead, "management_url": management}
            )
            with pytest.raises(InventoryUnavailable):
                list_queues(unlisted)
    ensure_stream_config(stream.redis, stream.name, "key")
    registry = QueueRegistry(stream.redis, stream.name)
    leftover = key_queue_name(stream.name, "leftover")
    elsewhere = key_queue_name(f"{stream.name}-other", "leftover")  # another stream's
    node = pika.BlockingConnection(pika.URLParameters(private_rabbit.url))
    try:
        channel = node.channel()
        for queue in (leftover, elsewhere):
            channel.queue_declare(queue, durable=True, arguments=keyed_queue_arguments(stream.name))
        # The broker lists a queue once it has reported on it (within a second here).
        wait_until(lambda: leftover in list_queues(settings), 15, "the queue to be listed")
        janitor = Janitor([stream.name], settings=settings, janitor_id=f"janitor-{source}")
        janitor.run(once=True)
        has(janitor, adopted=1)
        janitor.run(once=True)  # adopted, it is reclaimed like any other (by now)
        assert queue_depth(node, leftover) is None
        assert queue_depth(node, elsewhere) == 0
        assert registry.queues() == {}
        has(janitor, deleted=1, errors=0)
    finally:
        for queue in (leftover, elsewhere):  # a channel each: 4.x answers a missing one 404
            with suppress(pika.exceptions.ChannelClosedByBroker):
                node.channel().queue_delete(queue)
        node.close()


def test_without_a_listing_the_janitor_reads_no_other_broker(
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    private_rabbit: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pointed at one broker without KEYQ_PROMETHEUS_URL or KEYQ_MANAGEMENT_URL, the janitor
    skips looking for unregistered queues and says why, once: it lists no other broker, not
    even this machine's own node (which ``rabbitmqctl`` reads), where this stream has a
    leftover queue."""
    ensure_stream_config(stream.redis, stream.name, "key")
    leftover = key_queue_name(stream.name, "leftover")
    stream.track(leftover)
    channel = amqp.channel()  # the shared broker, this machine's default node
    channel.queue_declare(leftover, durable=True, arguments=keyed_queue_arguments(stream.name))
    channel.close()
    commands: list[str] = []

    def spying(real: Any) -> Any:
        def spy(args: Any, *more: Any, **options: Any) -> Any:
            commands.append(str(args))
            return real(args, *more, **options)

        return spy

    for name in ("run", "Popen"):
        monkeypatch.setattr(subprocess, name, spying(getattr(subprocess, name)))
    monkeypatch.setattr(janitor_module, "ADOPT_EVERY_S", 0.0)  # look at every pass
    caplog.set_level(logging.INFO, logger="keyq.janitor")
    settings = janitor_settings(amqp_url=private_rabbit.url, prometheus_url="", management_url="")
    janitor = Janitor([stream.name], settings=settings, janitor_id="janitor-unlisted")
    for _ in range(3):
        janitor.run(once=True)
    has(janitor, adopted=0)
    assert leftover not in QueueRegistry(stream.redis, stream.name).queues()
    assert queue_depth(amqp, leftover) == 0
    said = [r.getMessage() for r in caplog.records if "unregistered" in r.getMessage()]
    assert said == [f"not looking for unregistered queues: {NOT_SET}"]
    assert [command for command in commands if "rabbitmqctl" in command] == []


def test_bucket_mode_queues_are_never_deleted(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    keys = [f"k{i}" for i in range(16)]
    buckets = sorted(set(publish_one_each(stream, keys, mode="bucket")))
    assert len(buckets) >= 2
    assert len(drain_all(amqp, buckets)) >= len(keys)
    registry = QueueRegistry(stream.redis, stream.name)
    before = registry.queues()
    assert set(before) == set(buckets)

    janitor = Janitor([stream.name], settings=janitor_settings(), janitor_id="janitor-bucket")
    janitor.run(once=True)
    janitor.run(once=True)

    has(janitor, passes=2, deleted=0, already_gone=0, forgotten=0, adopted=0, errors=0)
    assert {queue: queue_depth(amqp, queue) for queue in buckets} == dict.fromkeys(buckets, 0)
    assert registry.queues() == before
    assert RetirementFence(stream.redis, stream.name).marked(buckets) == []


def test_two_janitors_delete_each_queue_once(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    keys = [f"idle-{i}" for i in range(200)] + [f"live-{i}" for i in range(5)]
    queues = publish_one_each(stream, keys)
    idle, live = queues[:200], queues[200:]
    assert len(drain_all(amqp, idle)) >= 200
    registry = QueueRegistry(stream.redis, stream.name)
    assert len(registry.queues()) == 205

    first = Janitor([stream.name], settings=janitor_settings(), janitor_id="janitor-a")
    second = Janitor([stream.name], settings=janitor_settings(), janitor_id="janitor-b")
    with running(first, second):
        wait_until(lambda: set(registry.queues()) == set(live), 30, "idle ones gone", every=0.2)
        time.sleep(1.5)  # a few more passes by both, with nothing left to delete

    both = first.stats + second.stats
    assert both["deleted"] == 200, (first.stats, second.stats)
    assert both["forgotten"] == 200 + both["already_gone"], (first.stats, second.stats)
    assert both["errors"] == 0, (first.stats, second.stats)
    leader, standby = (first, second) if first.stats["deleted"] else (second, first)
    assert leader.stats["deleted"] == 200 and leader.stats["not_leader"] == 0, leader.stats
    assert standby.stats["deleted"] == 0 and standby.stats["not_leader"] > 0, standby.stats
    assert leader.stats["skipped_not_empty"] >= len(live), leader.stats

    assert [queue for queue in idle if exists(amqp, queue)] == []
    assert {queue: queue_depth(amqp, queue) for queue in live} == dict.fromkeys(live, 1)
    assert set(registry.queues()) == set(live)
    assert RetirementFence(stream.redis, stream.name).marked(queues) == []
    assert not stream.redis.exists(stream.keys.janitor_lease), "leaders resign when stopped"


def publish_in_rounds(
    stream: str, keys: list[str], queue_type: str, progress: dict[str, Any]
) -> Counter[str]:
    """Publishes to random keys in rounds for 20 s, pausing between rounds: briefly (so
    publishes meet the janitor's marks and deletes) or long enough for queues to go idle, be
    released by the workers and be deleted. Returns each key's count of events."""
    rng = random.Random(20240611)
    published: Counter[str] = Counter()
    with Producer(stream, mode="key", queue_type=queue_type, settings=fast_settings()) as producer:
        progress["producer"] = producer
        end = time.monotonic() + 20
        while time.monotonic() < end:
            for key in rng.sample(keys, rng.randint(1, len(keys))):
                for _ in range(rng.randint(1, 5)):
                    published[key] += 1
                    producer.publish(key, {"n": published[key], "producer": "p"})
            progress["rounds"] += 1
            if rng.random() < 0.5:
                time.sleep(rng.uniform(0.02, 0.4))
            else:
                producer.flush(FLUSH_TIMEOUT_S)
                time.sleep(rng.uniform(1.5, 2.5))
        producer.flush(FLUSH_TIMEOUT_S)
    return published


@pytest.mark.slow
@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_no_event_lost_while_janitor_deletes_under_load(
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    workers: Callable[..., WorkerProcess],
    queue_type: str,
) -> None:
    """Producers keep publishing to keys the janitor keeps deleting (and, on quorum streams,
    moving on to their next incarnation), while two workers apply them: every key's state is
    exactly what was published."""
    env = {
        "KEYQ_PUBLISH_LEASE_MS": str(LEASE_MS),
        "KEYQ_RETIRE_GRACE_MS": str(GRACE_MS),
        "KEYQ_IDLE_RELEASE_MS": "500",
        "KEYQ_QUEUE_TYPE": queue_type,
    }
    started = [workers(stream.name, mode="key", env=env) for _ in range(2)]
    for worker in started:
        worker.wait_ready()
    keys = [f"acct-{i}" for i in range(20)]
    store = StateStore(stream.redis, stream.name)
    janitor = Janitor([stream.name], settings=janitor_settings(), janitor_id="janitor-race")
    progress: dict[str, Any] = {"rounds": 0, "producer": None}
    with running(janitor):
        try:
            published = publish_in_rounds(stream.name, keys, queue_type, progress)
        except Exception as exc:
            raise AssertionError(
                f"publishing failed in round {progress['rounds'] + 1} "
                f"({getattr(progress['producer'], 'stats', None)}, "
                f"janitor {dict(janitor.stats)}): {exc!r}"
            ) from exc
        assert set(published) == set(keys)

        def all_applied() -> bool:
            return all((store.get(k) or {"applied": 0})["applied"] >= published[k] for k in keys)

        with suppress(AssertionError):  # the audit below says which keys are short
            wait_until(all_applied, 60, "every confirmed event to be applied", every=0.5)
        problems = {
            key: {"published": count, "state": store.get(key)}
            for key, count in published.items()
            if store.get(key) != {"applied": count, "last": {"p": count}, "violations": []}
        }
        assert not problems, (
            f"{len(problems)} keys wrong after {progress['rounds']} rounds, "
            f"janitor {dict(janitor.stats)}, producer {progress['producer'].stats}: "
            f"{dict(list(problems.items())[:5])}"
        )
    assert janitor.stats["deleted"] >= 10, janitor.stats
    has(janitor, errors=0)
    if queue_type == "quorum":  # each deleted queue came back under a new name
        assert stream.redis.hlen(StreamKeys(stream.name).incarnations) >= 10
    assert queue_depth(amqp, dead_letter_queue_name(stream.name)) in (0, None)
    for worker in started:
        assert worker.process.poll() is None, worker.log()[-3000:]


def test_a_cut_connection_does_not_fail_the_deletes(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    """A lane whose connection was cut retries on a fresh one (a node restarting or a proxy
    is not a broker that is down); a broker that refuses connections still fails the pass."""

    queues = [key_queue_name(stream.name, f"cut-{n}") for n in range(3)]
    stream.track(*queues)
    channel = amqp.channel()
    for queue in queues:
        channel.queue_declare(queue, durable=True, arguments=keyed_queue_arguments(stream.name))
    channel.close()
    parts = pika.URLParameters(stream.settings.amqp_url)
    with FaultProxy(parts.host, parts.port) as proxy:
        settings = load_settings(amqp_url=proxy.url_for(stream.settings.amqp_url))
        deleter = QueueDeleter(settings, 1, "cut-test")
        try:
            deleter.check()
            assert proxy.wait_connections(1)
            proxy.cut()
            assert deleter.delete(queues[:2]) == {q: Outcome.DELETED for q in queues[:2]}
            proxy.cut()
            proxy.refuse()
            with pytest.raises(BrokerUnavailable):
                deleter.delete(queues[2:])
        finally:
            deleter.close()
    assert not exists(amqp, queues[0]) and not exists(amqp, queues[1])
    assert exists(amqp, queues[2])


def test_quorum_queues_are_kept_while_a_listed_node_does_not_answer_and_named_if_it_stops(
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While a node of ``KEYQ_AMQP_URL`` is down, an idle quorum queue is not deleted (a
    producer would declare it again at once, short of that node's replica for good on
    RabbitMQ 3.10). A proxy in front of a dead node accepts TCP, so only a handshake tells.
    The probe at the start of a pass is a grace period old when the deletes come: a node that
    went down in between must still stop them (a quorum queue deleted while a node restarted
    was left broken on 3.10). Once every node answers, they are deleted, and every node is
    probed after each slice of deletes: one that stopped answering meanwhile (RabbitMQ may
    leave the replicas behind on it) is named with each of those queues at ERROR, and counted."""
    queues = publish_one_each(stream, ["first", "second"], queue_type="quorum")
    assert len(drain_all(amqp, queues, consume=True)) >= 2
    fence = RetirementFence(stream.redis, stream.name)
    for down_as in ("closed port", "proxy to a dead node"):
        with FaultProxy("127.0.0.1", free_port()) as dead:
            port = dead.port if down_as == "proxy to a dead node" else free_port()
            down = f"amqp://guest:guest@127.0.0.1:{port}/%2F"
            degraded = janitor_settings(amqp_url=f"{stream.settings.amqp_url},{down}")
            janitor = Janitor([stream.name], settings=degraded, janitor_id="janitor-degraded")
            janitor.run(once=True)
        has(janitor, skipped_unreachable=2, deleted=0)
        assert all(exists(amqp, queue) for queue in queues), down_as
        assert fence.marked(queues) == [], down_as

    parts = pika.URLParameters(stream.settings.amqp_url)
    with FaultProxy(parts.host, parts.port) as proxy:
        settings = janitor_settings(
            amqp_url=f"{stream.settings.amqp_url},{proxy.url_for(stream.settings.amqp_url)}",
            retire_grace_ms=3000,
        )
        janitor = Janitor([stream.name], settings=settings, janitor_id="janitor-grace")
        passing = threading.Thread(target=janitor.run, kwargs={"once": True})
        passing.start()
        try:
            wait_until(lambda: len(fence.marked(queues)) == 2, 10, "both queues marked")
            proxy.refuse()  # the second node goes down during the grace
        finally:
            passing.join(30)
    assert not passing.is_alive()
    has(janitor, deleted=0, skipped_unreachable=2)
    assert all(exists(amqp, queue) for queue in queues), "deleted after a node went down"
    assert fence.marked(queues) == []

    real_delete = QueueDeleter.delete
    deleted: list[str] = []
    with FaultProxy(parts.host, parts.port) as proxy:

        def delete_then_lose_a_node(
            self: QueueDeleter, batch: list[str], checked: bool = False
        ) -> dict[str, Outcome]:
            outcomes = real_delete(self, batch, checked)
            deleted.extend(batch)
            proxy.refuse()  # the second node is lost during the deletes
            return outcomes

        monkeypatch.setattr(QueueDeleter, "delete", delete_then_lose_a_node)
        settings = janitor_settings(
            amqp_url=f"{stream.settings.amqp_url},{proxy.url_for(stream.settings.amqp_url)}"
        )
        janitor = Janitor([stream.name], settings=settings, janitor_id="janitor-lost-node")
        with caplog.at_level(logging.ERROR, logger="keyq.janitor"):
            janitor.run(once=True)
    assert sorted(deleted) == sorted(queues)
    has(janitor, deleted=2, deleted_during_outage=2)
    assert not any(exists(amqp, queue) for queue in queues)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    for queue in queues:
        assert any(queue in text and "stopped answering" in text for text in errors), errors
    assert "guest:guest" not in " ".join(errors)


def test_a_deleted_quorum_queue_is_never_declared_again_and_its_emptiness_check_hands_back(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    """RabbitMQ can bring a deleted quorum queue's leftover replica back over a queue declared
    later under the same name. So each delete moves the key on to a new incarnation:
    ``<queue>~1``, then ``<queue>~2``; the producer follows, and the registry lists the
    incarnation that exists. Nothing is lost or reordered across them."""
    [base] = publish_one_each(stream, ["k"], queue_type="quorum")
    assert len(drain_all(amqp, [base], consume=True)) >= 1
    janitor = Janitor([stream.name], settings=janitor_settings(), janitor_id="janitor-next")
    registry = QueueRegistry(stream.redis, stream.name)
    landed: list[int] = []
    with Producer(stream.name, settings=fast_settings()) as producer:
        for incarnation in (1, 2):
            janitor.run(once=True)
            has(janitor, deleted=incarnation)
            previous = base if incarnation == 1 else f"{base}~{incarnation - 1}"
            assert not exists(amqp, previous)
            for n in range(3):
                receipt = producer.publish("k", {"n": n, "incarnation": incarnation})
                assert receipt.queue == base  # the receipt names the base queue
            producer.flush(30)
            current = f"{base}~{incarnation}"
            assert exists(amqp, current) and not exists(amqp, previous)
            assert set(registry.queues()) == {current}
            landed.extend(event["n"] for event in drain_all(amqp, [current], consume=True))
    assert landed == [0, 1, 2, 0, 1, 2]
    stream.track(f"{base}~2")

    # The consume that confirms a quorum queue is empty before its delete returns any message
    # it finds to the queue, unchanged; a consumer attached makes the queue in use; a queue
    # deleted meanwhile (by another janitor, or an operator) is GONE, not a failure.
    [queue] = publish_one_each(stream, ["kept"], queue_type="quorum")
    deleter = QueueDeleter(stream.settings, 1, "check-test")
    try:
        lane = deleter._lanes[0]
        assert lane._finds_a_message(lane._open_channel(), queue)
        taken = drain_all(amqp, [queue], consume=True, wait=1.0)
        assert [event["n"] for event in taken] == [1]  # handed back whole, and only once
        assert not lane._finds_a_message(lane._open_channel(), queue)
        holder = amqp.channel()
        holder.basic_consume(queue, lambda *_: None, exclusive=True)
        assert lane._delete_once(queue, checked=True) is Outcome.IN_USE
        holder.close()
        # A quorum queue's counts lag a cancel too: "in use" until they catch up.
        wait_until(
            lambda: deleter.delete([queue], checked=True) == {queue: Outcome.DELETED},
            10,
            "the queue deleted once its consumer is gone",
        )
        assert deleter.delete([queue], checked=True) == {queue: Outcome.GONE}
    finally:
        deleter.close()
    assert not exists(amqp, queue)
