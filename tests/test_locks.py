"""Fenced locks on real Redis: expiry, renewal, stealing after expiry, stale tokens refused."""

from __future__ import annotations

import time

from keyq.broker.locks import FencedLocks

from tests.conftest import StreamFixture


def test_only_one_holder(stream: StreamFixture) -> None:
    locks = FencedLocks(stream.redis, stream.name)
    first = locks.acquire("q1", "w1", 5000)
    assert first is not None
    assert locks.acquire("q1", "w2", 5000) is None
    assert locks.holder("q1") == first
    other = locks.acquire("q2", "w2", 5000)
    assert other is not None
    assert locks.holders(["q1", "q2", "q3"]) == {"q1": first, "q2": other, "q3": None}


def test_expiry_lets_another_take_it_with_a_larger_token(stream: StreamFixture) -> None:
    locks = FencedLocks(stream.redis, stream.name)
    old = locks.acquire("q", "w1", 150)
    assert old is not None
    time.sleep(0.3)
    new = locks.acquire("q", "w2", 5000)
    assert new is not None and new.token > old.token and new.owner == "w2"


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


def test_release_only_your_own(stream: StreamFixture) -> None:
    locks = FencedLocks(stream.redis, stream.name)
    old = locks.acquire("q", "w1", 100)
    assert old is not None
    time.sleep(0.2)
    new = locks.acquire("q", "w2", 5000)
    assert new is not None
    assert locks.release([old]) == 0
    assert locks.holder("q") == new
    assert locks.release([new]) == 1
    assert locks.holder("q") is None


def test_stale_token_cannot_commit(stream: StreamFixture) -> None:
    locks = FencedLocks(stream.redis, stream.name)
    target = stream.keys.state
    zombie = locks.acquire("q", "w1", 100)
    held = locks.acquire("r", "w1", 5000)
    assert zombie and held
    assert locks.commit(target, {zombie: {"k1": "v1"}}) == {"q": True}
    time.sleep(0.2)  # w1 pauses past its ttl
    owner = locks.acquire("q", "w2", 5000)
    assert owner is not None
    assert locks.commit(target, {owner: {"k1": "v2"}}) == {"q": True}
    # The zombie resumes and tries to commit: refused, and the newer value stays.
    result = locks.commit(target, {zombie: {"k1": "stale", "k2": "stale"}, held: {"k3": "ok"}})
    assert result == {"q": False, "r": True}
    assert stream.redis.hgetall(target) == {"k1": "v2", "k3": "ok"}
