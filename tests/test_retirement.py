"""The retirement fence: a marked queue gets no new events until the mark is gone."""

from __future__ import annotations

import threading
import time

import pika

from keyq import Producer
from keyq.broker.key_control import KeyControl
from keyq.broker.locks import FencedLocks
from keyq.broker.naming import bucket_queue_name, key_queue_name
from keyq.broker.registry import QueueRegistry
from keyq.broker.retirement import Mark, RetirementFence
from keyq.broker.settings import load_settings
from tests.conftest import StreamFixture
from tests.helpers import drain, queue_depth


def test_lease_refused_while_marked_until_the_mark_expires_and_touches_when_granted(
    stream: StreamFixture,
) -> None:
    fence = RetirementFence(stream.redis, stream.name)
    registry = QueueRegistry(stream.redis, stream.name)
    registry.register({"q1": "a", "q2": "b"})
    before = registry.queues()
    assert marked(fence.mark(["q1"], "janitor-1", ttl_ms=5000)) == ["q1"]
    assert marked(fence.mark(["q1", "q2"], "janitor-2", ttl_ms=5000)) == ["q2"]  # one deleter
    assert fence.marked(["q1", "q2", "q3"]) == ["q1", "q2"]
    fence.unmark(["q2"])
    time.sleep(0.01)
    assert fence.lease(["q1", "q2", "q3"]) == {"q1": None, "q2": 0, "q3": 0}
    after = registry.queues()
    assert after["q1"] == before["q1"]  # a refused lease does not look like activity
    assert after["q2"] > before["q2"]
    assert "q3" not in after  # leases never register a queue
    fence.mark(["q"], "janitor", ttl_ms=100)  # a mark expires if its deleter dies
    assert fence.lease(["q"]) == {"q": None}
    time.sleep(0.2)
    assert fence.lease(["q"]) == {"q": 0}


def test_a_lease_on_a_queue_quiet_for_a_while_announces_it_as_woken(stream: StreamFixture) -> None:
    """Workers waiting for their next tick hear of a woken queue at once (the claim that
    follows is the latency of an event for a key that had gone quiet)."""
    fence = RetirementFence(stream.redis, stream.name)
    registry = QueueRegistry(stream.redis, stream.name)
    registry.register({"quiet": "a", "busy": "b", "retiring": "c"})
    long_ago = int(time.time() * 1000) - 60_000
    stream.redis.zadd(stream.keys.registry, {"quiet": long_ago, "retiring": long_ago})
    fence.mark(["retiring"], "janitor", ttl_ms=5000)
    pubsub = stream.redis.pubsub()
    pubsub.subscribe(stream.keys.announcements)
    try:
        assert pubsub.get_message(timeout=1)["type"] == "subscribe"
        leased = fence.lease(["quiet", "busy", "retiring"])
        assert leased == {"quiet": 0, "busy": 0, "retiring": None}
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
        assert message is not None and message["data"] == "quiet"
        assert stream.redis.zscore(stream.keys.woken, "quiet") is not None
        fence.lease(["quiet", "busy"])  # active now: no news
        assert pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5) is None
    finally:
        pubsub.close()


def test_a_deleter_keeps_only_the_marks_that_still_stand_and_renews_them(
    stream: StreamFixture,
) -> None:
    fence = RetirementFence(stream.redis, stream.name)
    queues = ["mine", "lapsing", "theirs"]
    assert marked(fence.mark(queues, "janitor-1", ttl_ms=300)) == queues
    stream.redis.delete(stream.keys.retiring("theirs"))
    assert marked(fence.mark(["theirs"], "janitor-2", ttl_ms=5000)) == ["theirs"]
    time.sleep(0.1)
    assert marked(fence.still_marked(["mine", "theirs", "never"], "janitor-1", 5000)) == ["mine"]
    time.sleep(0.4)  # past the first ttl: only the renewed mark is left of janitor-1's
    assert marked(fence.still_marked(["mine", "lapsing"], "janitor-1", 5000)) == ["mine"]
    assert fence.marked(["mine", "lapsing", "theirs"]) == ["mine", "theirs"]
    assert fence.lease(["mine", "lapsing"]) == {"mine": None, "lapsing": 0}
    assert fence.still_marked([], "janitor-1", 5000) == {}


def test_a_queue_whose_key_has_events_aside_is_never_marked_for_retirement(
    stream: StreamFixture,
) -> None:
    """Only the holder of a key's own queue drains what waits aside for the key: the queue
    is refused in the script that marks (no window between the check and the mark), and a
    queue whose key had events set aside during the grace is refused before its delete. A
    key-mode queue registered without its key (adopted by a janitor after a crash, registered
    again by a worker after a Redis failover) is recorded as the key's when its events go
    aside, so it is refused too."""
    fence = RetirementFence(stream.redis, stream.name)
    registry = QueueRegistry(stream.redis, stream.name)
    registry.register({"q-a": "a", "q-b": "b", "q-c": "c"})
    stream.redis.hset(stream.keys.aside, "a", '["side-a"]')
    marks = fence.mark(["q-a", "q-b", "q-c", "unkeyed"], "janitor", ttl_ms=5000)
    assert marks == {"q-a": Mark.ASIDE} | dict.fromkeys(["q-b", "q-c", "unkeyed"], Mark.MARKED)
    assert fence.marked(["q-a", "q-b", "q-c"]) == ["q-b", "q-c"]
    stream.redis.hset(stream.keys.aside, "b", '["side-b"]')  # set aside during the grace
    marks = fence.still_marked(["q-b", "q-c"], "janitor", 5000)
    assert marks == {"q-b": Mark.ASIDE, "q-c": Mark.MARKED}

    locks = FencedLocks(stream.redis, stream.name)
    own, bucket = key_queue_name(stream.name, "d"), bucket_queue_name(stream.name, 3)
    registry.register({own: None, bucket: None}, announce=False)
    control = KeyControl(stream.redis, stream.name)
    for queue, key in ((own, "d"), (bucket, "e")):
        lease = locks.acquire(queue, "worker", 5000)
        assert lease is not None
        assert control.set_aside_tail(key, lease, f"side-{key}") == [f"side-{key}"]
        locks.release([lease])
    assert fence.mark([own], "janitor", ttl_ms=5000) == {own: Mark.ASIDE}
    assert stream.redis.hget(stream.keys.queue_keys, bucket) is None  # a bucket is no key's


def marked(marks: dict[str, Mark]) -> list[str]:
    return [queue for queue, mark in marks.items() if mark is Mark.MARKED]


def test_a_deleted_queue_is_leased_under_its_next_incarnation(stream: StreamFixture) -> None:
    """A deleter that moved a queue on (quorum) makes every later lease name the next
    incarnation, and touch that one's activity; marks hold every incarnation of a base name;
    moving an old incarnation on again never goes back."""
    fence = RetirementFence(stream.redis, stream.name)
    registry = QueueRegistry(stream.redis, stream.name)
    registry.register({"q~1": "a", "q": "a"})
    before = registry.queues()
    assert marked(fence.mark(["q"], "janitor", ttl_ms=5000)) == ["q"]
    fence.advance_incarnations(["q"])
    assert fence.lease(["q"]) == {"q": None}  # still marked
    fence.unmark(["q"])
    time.sleep(0.01)
    assert fence.lease(["q"]) == {"q": 1}
    after = registry.queues()
    assert after["q~1"] > before["q~1"] and after["q"] == before["q"]
    assert marked(fence.mark(["q~1"], "janitor", ttl_ms=5000)) == ["q~1"]
    assert fence.marked(["q", "q~1", "q~7"]) == ["q", "q~1", "q~7"]  # one mark per base name
    assert fence.lease(["q"]) == {"q": None}
    fence.advance_incarnations(["q~1"])
    fence.unmark(["q~1"])
    fence.advance_incarnations(["q"])  # a late report of the first delete: no step back
    assert fence.lease(["q", "other"]) == {"q": 2, "other": 0}


def test_producer_holds_a_marked_queue_and_resumes(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    settings = load_settings(publish_lease_ms=100, retire_grace_ms=200)
    fence = RetirementFence(stream.redis, stream.name)
    queue = key_queue_name(stream.name, "k")
    with Producer(stream.name, settings=settings) as producer:
        producer.publish("k", {"n": 0})
        producer.flush(10)
        fence.mark([queue], "test", ttl_ms=10_000)
        time.sleep(0.25)  # the producer's lease has run out
        for n in range(1, 6):
            producer.publish("k", {"n": n})
        time.sleep(0.5)
        assert queue_depth(amqp, queue) == 1, "events went to a queue being retired"
        assert producer.unconfirmed == 5
        flushed = threading.Event()
        thread = threading.Thread(target=lambda: (producer.flush(10), flushed.set()))
        thread.start()
        time.sleep(0.2)
        assert not flushed.is_set()
        fence.unmark([queue])
        thread.join(10)
        assert flushed.is_set()
    assert [m.json()["n"] for m in drain(amqp.channel(), queue)] == list(range(6))
