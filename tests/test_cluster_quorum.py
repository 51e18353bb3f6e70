"""Quorum streams on the private 3-node cluster keep every guarantee through node and
worker crashes: while a producer publishes, the node leading most of the stream's queues is
killed with -9 and restarted, and a worker is killed with -9 and replaced. Every key's
ledger (each applied event number, in the order applied) is then checked against what was
published: nothing lost, reordered or applied twice, and exactly the planted poison events
in the dead-letter queue."""

from __future__ import annotations

import collections
import threading
import time
import uuid
from typing import Any

import pika
import pytest
import redis

from keyq import Producer
from keyq.broker.naming import dead_letter_queue_name
from keyq.broker.settings import load_settings
from keyq.worker.state_store import StateStore
from tests.cluster import RabbitCluster, cluster_fixture
from tests.conftest import TEST_STREAM_PREFIX, StreamFixture
from tests.helpers import drain
from tests.workers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.services]

rabbit_cluster = cluster_fixture(scope="module")

KEYS = 24
PER_KEY = 50
ROUND_PAUSE_S = 0.35  # a round publishes one event of every key: ~18 s in all


@pytest.mark.parametrize("mode", ["key", "bucket"])
def test_a_quorum_stream_loses_nothing_when_a_leader_node_and_a_worker_are_killed(
    rabbit_cluster: RabbitCluster,
    redis_client: redis.Redis,
    workers: Any,
    mode: str,
) -> None:
    cluster = rabbit_cluster
    name = f"{TEST_STREAM_PREFIX}quorum-{mode}-{uuid.uuid4().hex[:8]}"
    every_node = ",".join(cluster.urls)
    stream = StreamFixture(name, load_settings(amqp_url=cluster.urls[0]), redis_client)
    env = {"KEYQ_AMQP_URL": every_node, "KEYQ_QUEUE_TYPE": "quorum"}
    keys = [f"acct-{index:02d}" for index in range(KEYS)]
    poison = {(keys[3], 17), (keys[10], 40), (keys[20], 5)}
    producer = Producer(
        name,
        mode=mode,
        buckets=6 if mode == "bucket" else None,
        queue_type="quorum",
        settings=load_settings(amqp_url=every_node),
        publish_timeout=120,
    )
    try:
        started = [workers(name, env=env), workers(name, env=env)]
        for worker in started:
            worker.wait_ready(120)
        published = collections.Counter[str]()

        def publish() -> None:
            for n in range(1, PER_KEY + 1):
                for key in keys:
                    event = {"producer": "p", "n": n, "poison": (key, n) in poison}
                    producer.publish(key, event)
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
        started.append(workers(name, env=env))

        publisher.join(180)
        assert not publisher.is_alive(), "publishing did not finish"
        producer.flush(timeout=120)

        store = StateStore(redis_client, name)
        expected = {
            key: [n for n in range(1, PER_KEY + 1) if (key, n) not in poison] for key in keys
        }

        def ledgers() -> dict[str, list[int]]:
            found = {}
            for key in keys:
                state = store.get(key) or {"seen": {}}
                found[key] = list(state["seen"].get("p", []))
            return found

        def complete() -> bool:
            return all(len(seen) >= len(expected[key]) for key, seen in ledgers().items())

        try:
            wait_until(complete, 240, "every key's events applied", every=1.0)
        finally:
            for worker in started[1:]:
                print(worker.log()[-2000:])
        final = ledgers()
        wrong = {key: seen for key, seen in final.items() if seen != expected[key]}
        assert not wrong, f"lost, reordered or applied twice: {wrong}"

        for worker in started[1:]:
            assert worker.terminate() == 0, worker.log()[-3000:]
        connection = pika.BlockingConnection(pika.URLParameters(cluster.urls[0]))
        try:
            letters = drain(connection.channel(), dead_letter_queue_name(name))
        finally:
            connection.close()
        assert {(letter.key, letter.json()["n"]) for letter in letters} == poison
        assert len(letters) == len(poison)
    finally:
        producer.close(timeout=30)
        stream.cleanup()
