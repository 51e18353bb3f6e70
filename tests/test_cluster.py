"""The private 3-node RabbitMQ cluster (tests/cluster.py) and its node faults, on real nodes:
one cluster for each of the module's two groups, and every test leaves its three nodes running.
"""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pika
import pika.exceptions
import pytest
import redis
from pika.adapters.blocking_connection import BlockingChannel

from keyq import Janitor, Producer
from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.broker.naming import bucket_queue_name, dead_letter_queue_name, key_queue_name
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import load_settings
from keyq.broker.topology import keyed_queue_arguments
from keyq.janitor.config import JanitorSettings
from keyq.worker.batch.state_store import StateStore
from tests.cluster import RabbitCluster, cluster_available
from tests.conftest import TEST_STREAM_PREFIX, StreamFixture
from tests.faults import FaultProxy
from tests.helpers import drain
from tests.workers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.services, pytest.mark.broker_versions]

# The tests come in two groups of about equal length, each run by one process on a cluster of
# its own (module scope): the file is the longest part of a run of the broker-dependent tests,
# and two clusters side by side halve it.
CLUSTER_A = pytest.mark.xdist_group("cluster-a")
CLUSTER_B = pytest.mark.xdist_group("cluster-b")


@pytest.fixture(scope="module")
def rabbit_cluster() -> Iterator[RabbitCluster]:
    reason = cluster_available()
    if reason is not None:
        pytest.skip(reason)
    with RabbitCluster() as cluster:
        yield cluster


MESSAGES = 200
LEDGER = "tests.pipelines:ledger"


def _connect(url: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.URLParameters(url))


def _close(connection: pika.BlockingConnection) -> None:
    with suppress(Exception):
        connection.close()


@contextmanager
def _channel(url: str) -> Iterator[BlockingChannel]:
    connection = _connect(url)
    try:
        yield connection.channel()
    finally:
        _close(connection)


def _seen(store: StateStore, key: str) -> list[int]:
    """The numbers of producer "p"'s events the ledger pipeline applied to ``key``, in order."""
    return list((store.get(key) or {"seen": {}})["seen"].get("p", []))


@pytest.fixture
def queue_name(rabbit_cluster: RabbitCluster) -> Iterator[str]:
    name = f"kq-cluster-test-{uuid.uuid4().hex[:8]}"
    yield name
    for url in rabbit_cluster.urls:  # through any node that answers
        with suppress(Exception), _channel(url) as channel:
            channel.queue_delete(name)
            return


@pytest.fixture
def on_cluster(rabbit_cluster: RabbitCluster, redis_client: redis.Redis) -> Iterator[StreamFixture]:
    """A stream of the test's own whose queues are cleaned up on the cluster."""
    name = f"{TEST_STREAM_PREFIX}cluster-{uuid.uuid4().hex[:8]}"
    stream = StreamFixture(name, load_settings(amqp_url=rabbit_cluster.urls[0]), redis_client)
    yield stream.own()
    stream.cleanup()


@CLUSTER_A
def test_the_cluster_runs_three_nodes_of_its_own_and_cut_drops_one_nodes_clients_only(
    rabbit_cluster: RabbitCluster,
) -> None:
    cluster = rabbit_cluster
    cut, spared = _connect(cluster.proxied_urls[0]), _connect(cluster.proxied_urls[1])
    try:
        assert cluster.proxy(0).wait_connections(1)
        cluster.cut(0)
        with pytest.raises(pika.exceptions.AMQPConnectionError):
            cut.channel().queue_declare("", exclusive=True)
        assert not cut.is_open
        spared.channel().queue_declare("", exclusive=True)  # another node's client: unaffected
        assert spared.is_open
        _close(_connect(cluster.proxied_urls[0]))  # a cut is not a refusal: reconnecting works
    finally:
        _close(cut)
        _close(spared)
    assert len(set(cluster.nodes)) == 3
    assert all(name.startswith("kq") for name in cluster.nodes)
    assert "rabbit@localhost" not in cluster.nodes
    assert 5672 not in cluster.ports
    for index in range(3):
        assert cluster.running_nodes(index) == sorted(cluster.nodes)
    for url in cluster.urls + cluster.proxied_urls:  # guest works on loopback
        _close(_connect(url))


@CLUSTER_A
def test_a_quorum_queue_keeps_every_message_when_its_leader_is_killed(
    rabbit_cluster: RabbitCluster, queue_name: str
) -> None:
    cluster = rabbit_cluster
    with _channel(cluster.urls[0]) as channel:
        channel.queue_declare(queue_name, durable=True, arguments={"x-queue-type": "quorum"})
        channel.confirm_delivery()
        for n in range(MESSAGES):  # each confirmed, or basic_publish raises
            persistent = pika.BasicProperties(delivery_mode=2)
            channel.basic_publish("", queue_name, str(n).encode(), persistent)
    info = cluster.queue_info(queue_name)
    assert info.type == "quorum"
    assert info.members == sorted(cluster.nodes)
    leader = cluster.leader_of(queue_name)

    killed_in = cluster.kill(leader)
    began = time.monotonic()
    new_leader = cluster.await_leader(queue_name, not_on=leader, timeout=60)
    elected_in = time.monotonic() - began
    try:
        assert new_leader != leader
        assert leader not in cluster.queue_info(queue_name).online
        other = next(n for n in cluster.nodes if n != leader)
        got: list[bytes] = []
        with _channel(cluster.url(other)) as channel:
            for method, _, body in channel.consume(queue_name, inactivity_timeout=5):
                if method is None:
                    break
                got.append(body)
                channel.basic_ack(method.delivery_tag)
                if len(got) == MESSAGES:
                    break
            channel.cancel()
        assert got == [str(n).encode() for n in range(MESSAGES)]
    finally:
        restarted_in = cluster.restart(leader)
    for node in cluster.nodes:
        assert cluster.running_nodes(node) == sorted(cluster.nodes)
    wait_until(lambda: leader in cluster.queue_info(queue_name).online, 30, "its replica back")
    print(
        f"timings: {cluster.timings} kill {killed_in:.2f}s, new leader seen "
        f"{elected_in:.2f}s after, restart and rejoin {restarted_in:.2f}s"
    )


@CLUSTER_B
def test_a_classic_queue_is_unreachable_while_its_home_node_is_stopped(
    rabbit_cluster: RabbitCluster, queue_name: str
) -> None:
    cluster = rabbit_cluster
    home = cluster.nodes[2]
    with _channel(cluster.url(home)) as channel:
        channel.queue_declare(queue_name, durable=True)  # lives where it was declared
        channel.confirm_delivery()
        channel.basic_publish("", queue_name, b"kept", pika.BasicProperties(delivery_mode=2))
    assert cluster.leader_of(queue_name) == home

    stopped_in = cluster.stop(home)
    try:
        assert not cluster.is_up(home)
        assert home not in cluster.running_nodes(0)
        info = cluster.queue_info(queue_name)  # 3.10 types it rabbit_classic_queue now
        assert (info.type, info.leader) == ("classic", home)
        with _channel(cluster.urls[0]) as channel:
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
                channel.queue_declare(queue_name, passive=True)
            assert refused.value.reply_code == 404
    finally:
        restarted_in = cluster.restart(home)
    with _channel(cluster.urls[0]) as channel:
        method, _, body = channel.basic_get(queue_name, auto_ack=True)
        assert method is not None
        assert body == b"kept"
    print(f"stop {stopped_in:.2f}s, restart and rejoin {restarted_in:.2f}s")


@CLUSTER_B
def test_the_janitor_keeps_a_queue_whose_node_is_down(
    rabbit_cluster: RabbitCluster, on_cluster: StreamFixture
) -> None:
    """A 404 (or 4.3's 541 for the delete) for a queue whose node is down is not "gone": the
    janitor must not forget it, or its confirmed events would sit unclaimed once the node is
    back. Two such queues, so that after the broker failed on one the rest are looked up."""
    cluster, stream = rabbit_cluster, on_cluster
    home = cluster.nodes[2]
    on_home = load_settings(amqp_url=cluster.url(home), publish_lease_ms=200)
    with Producer(stream.name, mode="key", settings=on_home) as producer:
        producer.publish("parked", {"n": 1})
        producer.publish("parked-too", {"n": 1})
    queue, queue_too = (key_queue_name(stream.name, key) for key in ("parked", "parked-too"))
    assert cluster.leader_of(queue) == cluster.leader_of(queue_too) == home
    # Drained idle queues on a live node: the same pass must delete them, whatever the broker
    # answers for the unreachable one (4.3.6 closes the connection with 541 INTERNAL_ERROR).
    on_live = load_settings(amqp_url=cluster.urls[0], publish_lease_ms=200)
    drained = [key_queue_name(stream.name, f"drained-{n}") for n in range(3)]
    with Producer(stream.name, mode="key", settings=on_live) as producer:
        for n in range(3):
            producer.publish(f"drained-{n}", {"n": 1})
    with _channel(cluster.urls[0]) as channel:
        for name in drained:
            assert channel.basic_get(name, auto_ack=True)[0] is not None
    settings = load_settings(
        JanitorSettings,
        amqp_url=cluster.urls[0],
        idle_ttl_s=0,
        publish_lease_ms=200,
        retire_grace_ms=500,
    )
    janitor = Janitor([stream.name], settings=settings)
    cluster.stop(home)
    try:
        janitor.run(once=True)
        assert janitor.stats["skipped_unreachable"] == 2, janitor.stats
        assert janitor.stats["errors"] == 0, janitor.stats
        assert janitor.stats["forgotten"] == len(drained), janitor.stats  # only those deleted
        registered = QueueRegistry(stream.redis, stream.name).queues()
        assert {queue, queue_too} <= set(registered)
        assert not set(drained) & set(registered), janitor.stats
        assert janitor.stats["deleted"] >= len(drained), janitor.stats
    finally:
        cluster.restart(home)
    with _channel(cluster.urls[0]) as channel:
        for kept in (queue, queue_too):
            method, _, body = channel.basic_get(kept, auto_ack=False)
            assert method is not None and b'"n":1' in body.replace(b" ", b"")


# A quorum stream end to end: while a producer publishes, the node leading most of the
# stream's queues is killed -9 and restarted, and a worker is killed -9 and replaced.

KEYS = 24
PER_KEY = 40
ROUND_PAUSE_S = 0.3  # a round publishes one event of every key: ~12 s in all


@CLUSTER_A
@pytest.mark.parametrize("mode", ["key", "bucket"])
def test_a_quorum_stream_loses_nothing_when_a_leader_node_and_a_worker_are_killed(
    rabbit_cluster: RabbitCluster, on_cluster: StreamFixture, workers: Any, mode: str
) -> None:
    """Every key's ledger is checked against what was published: nothing lost, reordered or
    applied twice, and exactly the planted poison events dead-lettered."""
    cluster, name = rabbit_cluster, on_cluster.name
    every_node = ",".join(cluster.urls)
    env = {"KEYQ_AMQP_URL": every_node, "KEYQ_QUEUE_TYPE": "quorum"}
    keys = [f"acct-{index:02d}" for index in range(KEYS)]
    poison = {(keys[3], 17), (keys[10], 40), (keys[20], 5)}
    with Producer(
        name,
        mode=mode,
        buckets=6 if mode == "bucket" else None,
        queue_type="quorum",
        settings=load_settings(amqp_url=every_node),
        publish_timeout=120,
    ) as producer:
        started = [workers(name, env=env, pipeline=LEDGER) for _ in range(2)]
        for worker in started:
            worker.wait_ready(120)
        published = collections.Counter[str]()

        def publish() -> None:
            for n in range(1, PER_KEY + 1):
                for key in keys:
                    producer.publish(key, {"producer": "p", "n": n, "poison": (key, n) in poison})
                    published[key] += 1
                time.sleep(ROUND_PAUSE_S)

        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        wait_until(lambda: sum(published.values()) >= KEYS * PER_KEY // 5, 60, "publishing")

        leaders = collections.Counter(cluster.leaders(f"keyq.{name}.").values())
        busiest = leaders.most_common(1)[0][0]
        print(f"leaders {dict(leaders)}: killing {busiest}")
        cluster.kill(busiest)
        time.sleep(2)
        print(f"restarted {busiest} in {cluster.restart(busiest):.1f}s")
        started[0].kill()
        # The replacement joins before the judging: a SIGTERM while it still starts Python
        # could otherwise come before its handler is installed.
        started.append(workers(name, env=env, pipeline=LEDGER).wait_ready(120))

        publisher.join(180)
        assert not publisher.is_alive(), "publishing did not finish"
        producer.flush(timeout=120)

        store = StateStore(on_cluster.redis, name)
        expected = {
            key: [n for n in range(1, PER_KEY + 1) if (key, n) not in poison] for key in keys
        }
        try:
            wait_until(
                lambda: all(len(_seen(store, key)) >= len(expected[key]) for key in keys),
                240,
                "every key's events applied",
                every=1.0,
            )
        finally:
            for worker in started[1:]:
                print(worker.log()[-2000:])
        wrong = {key: _seen(store, key) for key in keys if _seen(store, key) != expected[key]}
        assert not wrong, f"lost, reordered or applied twice: {wrong}"

        for worker in started[1:]:
            assert worker.terminate() == 0, worker.log()[-3000:]
        with _channel(cluster.urls[0]) as channel:
            letters = drain(channel, dead_letter_queue_name(name))
        # Dead letters are at least once (docs/architecture.md, the guarantees): a letter is
        # confirmed before the commit that marks its event handled, so a worker or a node
        # killed between the two leaves one copy more, never none. The index counts copies.
        copies = collections.Counter((letter.key, letter.json()["n"]) for letter in letters)
        assert set(copies) == poison, f"letters {dict(copies)}, poisoned {sorted(poison)}"
        index = DeadLetterIndex(on_cluster.redis, name)
        assert index.page(None).matched == len(poison), index.page(None).rows


@CLUSTER_B
def test_a_classic_stream_serves_live_nodes_keys_while_another_node_is_down(
    rabbit_cluster: RabbitCluster, on_cluster: StreamFixture, workers: Any
) -> None:
    """Classic queues (and the dead-letter queue) on a stopped node: the producer and a worker
    started meanwhile serve every key on a live node; the others wait until the node is back."""
    cluster, name = rabbit_cluster, on_cluster.name
    live_nodes = f"{cluster.urls[0]},{cluster.urls[2]}"  # clients never connect to node 1
    down_keys, live_keys = ["down-a", "down-b"], ["live-a", "live-b", "live-c"]
    with _channel(cluster.urls[1]) as channel:  # the down keys' and dead letters' queues
        for queue in [key_queue_name(name, key) for key in down_keys]:
            channel.queue_declare(queue, durable=True, arguments=keyed_queue_arguments(name))
        channel.queue_declare(dead_letter_queue_name(name), durable=True)
    store = StateStore(on_cluster.redis, name)
    every_event = list(range(1, 11))
    with Producer(name, mode="key", settings=load_settings(amqp_url=live_nodes)) as producer:
        sent = collections.Counter[str]()

        def publish_five_rounds() -> None:
            for _ in range(5):
                for key in down_keys + live_keys:
                    sent[key] += 1
                    producer.publish(key, {"producer": "p", "n": sent[key]})

        publish_five_rounds()
        producer.flush(timeout=30)
        reconnects_before = producer.stats["reconnects"]
        cluster.stop(1)
        try:
            publish_five_rounds()
            # The down keys' queues were last active before node 1 stopped: a worker claims
            # only recently active queues (an idle one is looked into, and one that cannot be
            # counted is left), so on a slow start it would not try them at all.
            quiet_for_long = {"KEYQ_AMQP_URL": live_nodes, "KEYQ_IDLE_RELEASE_MS": "600000"}
            worker = workers(name, env=quiet_for_long, pipeline=LEDGER)
            wait_until(
                lambda: all(_seen(store, key) == every_event for key in live_keys),
                120,
                "the live keys' events applied while node 1 is down",
            )
            assert all(_seen(store, key) == [] for key in down_keys)
            # Each down queue is recognised as unreachable (not missing) by its 404, on every
            # release: the producer sets it aside after at most one reconnect per queue,
            # instead of reconnecting again and again, and the worker says so once each.
            reconnects = producer.stats["reconnects"] - reconnects_before
            print(f"producer reconnects while node 1 was down: {reconnects}")
            assert reconnects <= len(down_keys), producer.stats
            unreachable = [f"queue {key_queue_name(name, key)} is unreachable" for key in down_keys]
            # The worker may apply the live keys before its claim round reaches the down ones.
            wait_until(
                lambda: all(line in worker.log() for line in unreachable),
                60,
                "the worker saying each down queue is unreachable",
            )
        finally:
            cluster.restart(1)
        producer.flush(timeout=60)
        wait_until(
            lambda: all(_seen(store, key) == every_event for key in down_keys),
            120,
            "the down keys' events applied once node 1 is back",
        )
        for key in down_keys + live_keys:
            assert _seen(store, key) == every_event, key
        assert worker.terminate() == 0, worker.log()[-3000:]
        assert "dead-letter queue" in worker.log()  # it said why dead letters would wait


@CLUSTER_A
def test_a_quorum_queue_that_cannot_commit_does_not_hold_up_the_producers_other_keys(
    rabbit_cluster: RabbitCluster, on_cluster: StreamFixture
) -> None:
    """RabbitMQ 3.10 registers a channel with a quorum queue on its first publish there,
    blocking that channel up to 65 s: a queue that cannot commit froze every key of the
    connection. The producer sends its events on a channel of their own once overdue."""
    cluster, name = rabbit_cluster, on_cluster.name
    stuck = key_queue_name(name, "stuck")
    with _channel(cluster.urls[0]) as channel:
        channel.queue_declare(stuck, durable=True, arguments=keyed_queue_arguments(name, "quorum"))
    on_cluster.track(stuck)
    # Down to two members (the arguments stay the producer's), then one of them stopped.
    dropped, stopped = cluster.queue_info(stuck).members[1:]
    cluster.ctl(
        0,
        "eval",
        f'rabbit_quorum_queue:delete_member(<<"/">>, <<"{stuck}">>, \'{dropped}\').',
    )
    assert dropped not in cluster.queue_info(stuck).members
    client = cluster.nodes.index(dropped)  # a node that stays up, with no member of it
    settings = load_settings(amqp_url=cluster.urls[client], confirm_timeout=3.0)
    with Producer(name, mode="key", queue_type="quorum", settings=settings) as producer:
        producer.publish("fine", {"n": 0})
        producer.flush(timeout=30)
        cluster.stop(stopped)
        try:
            for n in range(1, 6):
                producer.publish("stuck", {"n": n}, timeout=30)
            for n in range(1, 21):
                producer.publish("fine", {"n": n}, timeout=30)
            fine = key_queue_name(name, "fine")
            wait_until(
                lambda: producer.unconfirmed_by_queue.get(fine, 0) == 0,
                40,
                "the other key's events confirmed while a queue cannot commit",
            )
            assert producer.unconfirmed_by_queue.get(stuck, 0) == 5, producer.stats
            # Its confirms go overdue and are sent again on a channel of their own. On 4.3 the
            # other key did not wait for that, so the node must stay down past confirm_timeout
            # for the mechanism to be seen at all.
            wait_until(
                lambda: producer.stats["overdue_reconnects"] >= 1,
                30,
                "the stuck queue's confirms overdue while its node is stopped",
            )
        finally:
            cluster.restart(stopped)
        producer.flush(timeout=120)  # the stuck queue confirms once it has its quorum back
        assert producer.unconfirmed_by_queue.get(stuck, 0) == 0, producer.stats


def _node_of_worker(cluster: RabbitCluster, worker_id: str) -> int:
    """The index of the node the worker's AMQP connection is open to."""
    rows = json.loads(
        cluster.ctl(0, "list_connections", "-q", "client_properties", "port", "--formatter", "json")
        or "[]"
    )
    for row in rows:
        if f"worker-{worker_id}@" in json.dumps(row.get("client_properties")):
            return cluster.ports.index(int(row["port"]))
    raise AssertionError(f"no connection of {worker_id} in {rows}")


@CLUSTER_B
@pytest.mark.parametrize("mode", ["key", "bucket"])
def test_a_worker_moves_off_a_node_whose_replica_of_a_quorum_queue_is_down(
    rabbit_cluster: RabbitCluster, on_cluster: StreamFixture, workers: Any, mode: str
) -> None:
    """A quorum queue delivers through its replica on the consumer's node: with that replica
    down, a consumer there is sent nothing, ever. The worker sees it twice (held with nothing
    delivered, messages ready) and moves to another node, where every event arrives in order."""
    cluster, name = rabbit_cluster, on_cluster.name
    every_node = ",".join(cluster.urls)
    # A message per event and a prefetch of 5: in bucket mode, what the broker counts as
    # delivered to the starved consumer is 5 messages; the rest wait ready.
    env = {
        "KEYQ_AMQP_URL": every_node,
        "KEYQ_QUEUE_TYPE": "quorum",
        "KEYQ_IDLE_RELEASE_MS": "2000",
        "KEYQ_PACK_MAX_EVENTS": "1",
        "KEYQ_PREFETCH": "5",
    }
    key, events = "acct-1", 20
    queue = key_queue_name(name, key) if mode == "key" else bucket_queue_name(name, 0)
    store = StateStore(on_cluster.redis, name)
    node: int | None = None
    ra_member = f"{{'%2F_{queue}', node()}}"
    with Producer(
        name,
        mode=mode,
        buckets=1 if mode == "bucket" else None,
        queue_type="quorum",
        settings=load_settings(amqp_url=every_node, pack_max_events=1),
    ) as producer:
        try:
            worker = workers(name, env=env, pipeline=LEDGER)
            worker.wait_ready(120)
            producer.publish(key, {"producer": "p", "n": 1})
            producer.flush(timeout=60)
            wait_until(lambda: _seen(store, key) == [1], 60, "the first event applied")

            node = _node_of_worker(cluster, worker.worker_id)
            stopped = cluster.ctl(node, "eval", f"ra:stop_server(quorum_queues, {ra_member}).")
            assert stopped.strip() == "ok", stopped
            for n in range(2, events + 1):
                producer.publish(key, {"producer": "p", "n": n})
            producer.flush(timeout=60)

            wait_until(
                lambda: len(_seen(store, key)) >= events, 120, "every event applied", every=1.0
            )
            assert _seen(store, key) == list(range(1, events + 1))
            log = worker.log()
            assert f"{queue}: held twice with nothing delivered" in log, log[-3000:]
            assert _node_of_worker(cluster, worker.worker_id) != node
            assert worker.terminate() == 0, worker.log()[-3000:]
        finally:
            if node is not None:  # the replica back, so that the queue's delete leaves nothing
                with suppress(Exception):
                    cluster.ctl(node, "eval", f"ra:restart_server(quorum_queues, {ra_member}).")


@CLUSTER_B
def test_a_worker_moves_off_a_node_that_keeps_a_gaps_message_from_it(
    rabbit_cluster: RabbitCluster, on_cluster: StreamFixture, workers: Any
) -> None:
    """RabbitMQ 3.10 was seen counting a gap's message as delivered through one node and never
    sending it (the cluster soak). The proxy in front of node 0 plays that node, cutting seq 3:
    the second time the gap's reopened consumer finds more ready than held, the worker moves."""
    cluster, name = rabbit_cluster, on_cluster.name
    key = "acct-1"
    store = StateStore(on_cluster.redis, name)
    with (
        Producer(
            name,
            mode="key",
            queue_type="quorum",
            settings=load_settings(amqp_url=cluster.urls[0], pack_max_events=1),
        ) as producer,
        FaultProxy("127.0.0.1", cluster.ports[0]) as proxy,
        FaultProxy("127.0.0.1", cluster.ports[1]) as elsewhere,
    ):
        proxy.drop_deliveries(*[b'"n":3}'] * 20)  # more than a gap timeout of reopenings
        urls = [proxy.url_for(cluster.urls[0]), elsewhere.url_for(cluster.urls[1])]
        env = {
            "KEYQ_AMQP_URL": ",".join(urls),
            "KEYQ_QUEUE_TYPE": "quorum",
            "KEYQ_SEQUENCE_GAP_TIMEOUT_MS": "45000",
        }
        elsewhere.refuse()  # so that the worker connects through node 0's proxy first
        worker = workers(name, env=env, pipeline=LEDGER)
        worker.wait_ready(120)
        elsewhere.refuse(on=False)
        assert proxy.connections >= 1 and elsewhere.connections == 0
        for n in range(1, 7):
            producer.publish(key, {"producer": "p", "n": n})
        producer.flush(timeout=60)
        wait_until(lambda: len(_seen(store, key)) >= 6, 90, "every event applied", every=1.0)
        assert _seen(store, key) == [1, 2, 3, 4, 5, 6], worker.log()[-3000:]
        assert proxy.deliveries_dropped >= 2, "the gap's message was not kept from it"
        log = worker.log()
        assert "messages were kept from its consumer behind a gap" in log, log[-3000:]
        assert "gave up waiting" not in log, log[-3000:]
        assert worker.terminate() == 0, worker.log()[-3000:]
