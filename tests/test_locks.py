"""Fenced locks on real Redis: expiry, renewal, stealing after expiry, stale tokens refused."""

from __future__ import annotations

import time

import pytest

from keyq.broker.errors import KeysStopped
from keyq.broker.key_control import KeyControl
from keyq.broker.locks import FencedLocks
from keyq.broker.stream_policy import StreamPolicies
from tests.conftest import StreamFixture


def test_one_holder_and_a_claim_round_takes_only_the_free_locks_with_growing_tokens(
    stream: StreamFixture,
) -> None:
    locks = FencedLocks(stream.redis, stream.name)
    first = locks.acquire("q1", "w1", 5000)
    assert first is not None
    assert locks.acquire("q1", "w2", 5000) is None
    assert locks.holder("q1") == first
    other = locks.acquire("q2", "w2", 5000)
    assert other is not None
    assert locks.holders(["q1", "q2", "q3"]) == {"q1": first, "q2": other, "q3": None}
    taken = locks.acquire("b", "w1", 5000)
    assert taken is not None
    expired = locks.acquire("c", "w1", 100)
    assert expired is not None
    time.sleep(0.2)
    leases = locks.acquire_many(["a", "b", "c", "d"], "w2", 5000)
    assert [lease.queue for lease in leases] == ["a", "c", "d"]
    assert all(lease.owner == "w2" for lease in leases)
    by_queue = {lease.queue: lease for lease in leases}
    assert by_queue["c"].token > expired.token  # fenced: the old holder's commits are refused
    assert locks.holders(["a", "b", "c", "d"]) == {
        "a": by_queue["a"],
        "b": taken,
        "c": by_queue["c"],
        "d": by_queue["d"],
    }
    assert locks.acquire_many(["a", "b", "c", "d"], "w3", 5000) == []
    assert locks.acquire_many([], "w3", 5000) == []


def test_expiry_lets_another_take_it_with_a_larger_token_and_only_it_releases(
    stream: StreamFixture,
) -> None:
    locks = FencedLocks(stream.redis, stream.name)
    old = locks.acquire("q", "w1", 150)
    assert old is not None
    time.sleep(0.3)
    new = locks.acquire("q", "w2", 5000)
    assert new is not None and new.token > old.token and new.owner == "w2"
    assert locks.release([old]) == 0
    assert locks.holder("q") == new
    assert locks.release([new]) == 1
    assert locks.holder("q") is None


def test_renewal_keeps_it_past_the_ttl_and_fails_once_lost(stream: StreamFixture) -> None:
    locks = FencedLocks(stream.redis, stream.name)
    a = locks.acquire("a", "w1", 300)
    b = locks.acquire("b", "w1", 300)
    assert a and b
    for _ in range(4):
        time.sleep(0.15)
        assert locks.renew([a, b], 300) == {"a": True, "b": True}
    assert locks.acquire("a", "w2", 300) is None
    stream.redis.delete(stream.keys.lock("b"))  # lost, e.g. expired while paused
    thief = locks.acquire("b", "w2", 5000)
    assert thief is not None
    assert locks.renew([a, b], 300) == {"a": True, "b": False}
    assert locks.holder("b") == thief  # the failed renewal did not touch the new owner's lock


def test_stale_token_cannot_commit(stream: StreamFixture) -> None:
    locks = FencedLocks(stream.redis, stream.name)
    target = stream.keys.state
    zombie = locks.acquire("q", "w1", 100)
    held = locks.acquire("r", "w1", 5000)
    assert zombie and held
    assert locks.commit([zombie], {target: {"k1": "v1"}}) == frozenset()
    time.sleep(0.2)  # w1 pauses past its ttl
    owner = locks.acquire("q", "w2", 5000)
    assert owner is not None
    assert locks.commit([owner], {target: {"k1": "v2"}}) == frozenset()
    # The zombie resumes and commits a batch that also used a lock it still holds: refused
    # whole, naming the lost queue, and the newer value stays.
    lost = locks.commit([zombie, held], {target: {"k1": "stale", "k3": "not alone"}})
    assert lost == {"q"}
    assert stream.redis.hgetall(target) == {"k1": "v2"}


def test_a_commit_writes_every_hash_or_none(stream: StreamFixture) -> None:
    locks = FencedLocks(stream.redis, stream.name)
    a = locks.acquire("a", "w1", 5000)
    b = locks.acquire("b", "w1", 5000)
    assert a and b
    writes = {stream.keys.state: {"k": "s1"}, stream.keys.marks: {"k": "m1", "j": "m2"}}
    assert locks.commit([a, b], writes) == frozenset()
    assert stream.redis.hgetall(stream.keys.state) == {"k": "s1"}
    assert stream.redis.hgetall(stream.keys.marks) == {"k": "m1", "j": "m2"}
    stream.redis.delete(stream.keys.lock("a"))
    stream.redis.delete(stream.keys.lock("b"))
    again = {stream.keys.state: {"k": "s2"}, stream.keys.marks: {"k": "m3"}}
    assert locks.commit([a, b], again) == {"a", "b"}
    assert stream.redis.hgetall(stream.keys.state) == {"k": "s1"}
    assert stream.redis.hgetall(stream.keys.marks) == {"k": "m1", "j": "m2"}


def test_a_commit_guarded_by_a_key_paused_meanwhile_writes_nothing(stream: StreamFixture) -> None:
    locks = FencedLocks(stream.redis, stream.name)
    lease = locks.acquire("q", "w1", 5000)
    assert lease
    guards = [(stream.keys.paused_keys, "k"), (stream.keys.policy, "paused")]
    writes = {stream.keys.state: {"k": "s1"}}
    assert locks.commit([lease], writes, guards=guards) == frozenset()
    KeyControl(stream.redis, stream.name).pause(["k"])
    with pytest.raises(KeysStopped):
        locks.commit([lease], {stream.keys.state: {"k": "s2"}}, guards=guards)
    assert stream.redis.hgetall(stream.keys.state) == {"k": "s1"}
    KeyControl(stream.redis, stream.name).resume(["k"])
    StreamPolicies(stream.redis, stream.name).set_paused(True)  # the whole stream
    with pytest.raises(KeysStopped):
        locks.commit([lease], {stream.keys.state: {"k": "s3"}}, guards=guards)
    assert stream.redis.hgetall(stream.keys.state) == {"k": "s1"}
