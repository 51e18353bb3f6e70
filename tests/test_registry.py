"""Queue registry and worker membership on real Redis."""

from __future__ import annotations

import time

import redis

from keyq.broker.clock import now_ms
from keyq.broker.membership import Membership, fair_share
from keyq.broker.registry import QueueRegistry
from tests.conftest import StreamFixture


def test_register_touch_and_idle(stream: StreamFixture) -> None:
    registry = QueueRegistry(stream.redis, stream.name)
    registry.register({"q1": "key-1", "q2": None})
    assert set(registry.queues()) == {"q1", "q2"}
    assert registry.original_keys(["q1", "q2", "q3"]) == {"q1": "key-1", "q2": None, "q3": None}
    time.sleep(0.05)
    cutoff = now_ms()
    time.sleep(0.05)
    registry.touch(["q1", "never-registered"])
    assert set(registry.idle_since(cutoff)) == {"q2"}
    assert "never-registered" not in registry.queues()
    before = registry.queues()["q1"]
    registry.touch(["q1"], at_ms=before - 10_000)  # never moves back
    assert registry.queues()["q1"] == before


def test_forget_only_if_untouched_since_read(stream: StreamFixture) -> None:
    registry = QueueRegistry(stream.redis, stream.name)
    registry.register({"q1": "a", "q2": "b"})
    seen = registry.idle_since(now_ms() + 1)
    time.sleep(0.01)
    registry.touch(["q1"])  # a producer used q1 after the janitor looked
    assert registry.forget_if_unchanged(seen) == 1
    assert set(registry.queues()) == {"q1"}
    assert registry.original_keys(["q2"]) == {"q2": None}


def test_register_announces(stream: StreamFixture, redis_client: redis.Redis) -> None:
    pubsub = redis_client.pubsub()
    pubsub.subscribe(stream.keys.announcements)
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"  # type: ignore[index]
    QueueRegistry(stream.redis, stream.name).register({"qa": "a", "qb": "b"})
    got: list[str] = []
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.5)
        if message and message["type"] == "message":
            got.extend(message["data"].split("\n"))  # one message, a queue per line
    pubsub.close()
    assert sorted(got) == ["qa", "qb"]


def test_membership_heartbeat_and_expiry(stream: StreamFixture) -> None:
    members = Membership(stream.redis, stream.name, ttl_ms=200)
    members.heartbeat("w1", {"role": "worker"})
    members.heartbeat("w2")
    assert members.alive() == ["w1", "w2"]
    assert members.info()["w1"]["role"] == "worker"
    for _ in range(3):
        time.sleep(0.1)
        members.heartbeat("w1")
    assert members.alive() == ["w1"]
    assert members.prune() == ["w2"]
    members.leave("w1")
    assert members.alive() == []


def test_fair_share_splits_evenly() -> None:
    workers = ["b", "a", "c"]
    shares = [fair_share(10, workers, w) for w in sorted(workers)]
    assert shares == [4, 3, 3] and sum(shares) == 10
    assert fair_share(2, workers, "c") == 0
    assert fair_share(5, [], "x") == 5
