"""The janitor in auto-mode streams, on the real services: it reclaims idle own queues of
promoted keys as key mode reclaims key queues, demotes their keys while the queues' marks
still stand, and never touches a bucket, the dead-letter queue, an own queue with events,
one whose key has events aside, or one whose key's move is still open."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import pika
import pytest

from keyq.broker.key_control import KeyControl
from keyq.broker.locks import FencedLocks
from keyq.broker.naming import aside_queue_name
from keyq.broker.registry import QueueRegistry
from keyq.broker.retirement import Mark, RetirementFence
from keyq.broker.routes import WHY_OPERATOR, RouteBook
from keyq.broker.settings import load_settings
from keyq.broker.streams import StreamConfig, ensure_stream_config
from keyq.broker.topology import dead_letter_queue_arguments, keyed_queue_arguments
from keyq.janitor.config import JanitorSettings
from keyq.janitor.janitor import Janitor
from tests.conftest import StreamFixture
from tests.helpers import queue_depth


def janitor_settings() -> JanitorSettings:
    """Every registered queue is idle at once; a short lease and grace keep passes quick."""
    fast = {"idle_ttl_s": 0, "publish_lease_ms": 200, "retire_grace_ms": 500}
    return load_settings(JanitorSettings, **fast, janitor_interval_s=0.2)


def auto_stream(stream: StreamFixture, queue_type: str = "classic") -> StreamConfig:
    return ensure_stream_config(stream.redis, stream.name, "auto", 4, queue_type)


def declare(
    amqp: pika.BlockingConnection, stream: StreamFixture, queues: Sequence[str], queue_type: str
) -> None:
    stream.track(*queues)
    channel = amqp.channel()
    try:
        arguments = keyed_queue_arguments(stream.name, queue_type)
        for queue in queues:
            channel.queue_declare(queue, durable=True, arguments=arguments)
    finally:
        channel.close()


def promote(
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    key: str,
    *,
    close: bool = True,
    queue_type: str = "classic",
) -> tuple[str, str]:
    """``key`` promoted, its own queue and its bucket declared and registered (the own queue
    with its key, as the bucket's holder's first forward registers it), and its move closed
    under a lease of its bucket unless ``close`` is False; returns (own queue, bucket)."""
    config = auto_stream(stream, queue_type)
    own, bucket = config.own_queue_for(key), config.queue_for(key)
    declare(amqp, stream, [own, bucket], queue_type)
    QueueRegistry(stream.redis, stream.name).register({bucket: None, own: key})
    book = RouteBook(stream.redis, stream.name)
    route = book.promote(key, own, bucket, WHY_OPERATOR)
    assert route is not None and route.open and route.queue == own
    if close:
        locks = FencedLocks(stream.redis, stream.name)
        lease = locks.acquire(bucket, "bucket-holder", 10_000)
        assert lease is not None
        assert book.close(key, route.epoch, lease) is True
        assert locks.release([lease]) == 1
    time.sleep(0.01)  # registered visibly before the janitor's cutoff
    return own, bucket


@pytest.fixture
def fence_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[Any]]]:
    """What the janitor marks, and hooks called as it lifts marks: spied on the real fence,
    which still does all the work."""
    calls: dict[str, list[Any]] = {"marked": [], "on_unmark": []}
    mark, unmark = RetirementFence.mark, RetirementFence.unmark

    def spy_mark(
        fence: RetirementFence, queues: Sequence[str], owner: str, ttl_ms: int
    ) -> dict[str, Mark]:
        calls["marked"].extend(queues)
        return mark(fence, queues, owner, ttl_ms)

    def spy_unmark(fence: RetirementFence, queues: Sequence[str]) -> None:
        for hook in calls["on_unmark"]:
            hook(queues)
        unmark(fence, queues)

    monkeypatch.setattr(RetirementFence, "mark", spy_mark)
    monkeypatch.setattr(RetirementFence, "unmark", spy_unmark)
    yield calls


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_an_idle_own_queue_is_deleted_and_its_key_demoted_before_the_mark_goes(
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
    fence_calls: dict[str, list[Any]],
    queue_type: str,
) -> None:
    """A quorum own queue moves to its next incarnation as key mode's does."""
    own, bucket = promote(stream, amqp, "hot", queue_type=queue_type)
    # An own queue whose key is no longer promoted (its demotion refused once): deleted too.
    config = auto_stream(stream, queue_type)
    stale = config.own_queue_for("stale")
    declare(amqp, stream, [stale], queue_type)
    dead_letters = config.dead_letter_queue
    channel = amqp.channel()
    dead_arguments = dead_letter_queue_arguments(queue_type)
    channel.queue_declare(dead_letters, durable=True, arguments=dead_arguments)
    channel.close()
    registry = QueueRegistry(stream.redis, stream.name)
    registry.register({stale: "stale", dead_letters: None})
    time.sleep(0.01)
    book = RouteBook(stream.redis, stream.name)
    route_at_unmark: list[object] = []  # the key's route as its own queue's mark is lifted
    unmarked = lambda queues: route_at_unmark.append(book.route("hot")) if own in queues else None  # noqa: E731
    fence_calls["on_unmark"] = [unmarked]

    janitor = Janitor([stream.name], settings=janitor_settings(), janitor_id="janitor-auto")
    janitor.run(once=True)
    janitor.run(once=True)  # a second pass finds nothing more to do

    stats = janitor.stats
    assert stats["deleted"] == 2 and stats["forgotten"] == 2, stats
    assert stats["demoted"] == 1 and stats["demote_refused"] == 0, stats
    assert stats["errors"] == 0 and stats["skipped_moving"] == 0, stats
    assert queue_depth(amqp, own) is None and queue_depth(amqp, stale) is None
    # The key is demoted, and was already when its queue's mark was lifted.
    assert book.route("hot") is None
    assert route_at_unmark == [None]
    assert book.counts().get("demoted") == 1
    assert [row["what"] for row in book.history(key="hot")] == ["demoted", "closed", "promoted"]
    # Neither the bucket nor the dead-letter queue was ever marked, nor deleted.
    assert bucket not in fence_calls["marked"] and dead_letters not in fence_calls["marked"]
    assert queue_depth(amqp, bucket) == 0 and queue_depth(amqp, dead_letters) == 0
    assert set(registry.queues()) == {bucket, dead_letters}
    assert RetirementFence(stream.redis, stream.name).marked([own, stale]) == []
    incarnation = stream.redis.hget(stream.keys.incarnations, own)
    assert incarnation == ("1" if queue_type == "quorum" else None)


def test_own_queues_with_events_aside_or_an_open_move_are_kept_and_a_lost_one_comes_back(
    stream: StreamFixture, amqp: pika.BlockingConnection, fence_calls: dict[str, list[Any]]
) -> None:
    """An own queue with events is kept and its key stays promoted. Only the own queue's
    holder drains a promoted key's aside list: the janitor reads past that queue (it is not
    the key's bucket that is kept). Until the bucket's holder closes a move, the own queue's
    holder holds the key's events: the queue is not marked, let alone deleted. A promoted
    key whose events wait aside, with its own queue gone, gets that queue declared again
    (and registered with its key) by the watchdog, not its bucket."""
    busy, busy_bucket = promote(stream, amqp, "busy")
    channel = amqp.channel()
    channel.confirm_delivery()
    channel.basic_publish("", busy, b"{}", pika.BasicProperties(delivery_mode=2))
    channel.close()
    paused, paused_bucket = promote(stream, amqp, "paused")
    moving, moving_bucket = promote(stream, amqp, "moving", close=False)
    lost, lost_bucket = promote(stream, amqp, "lost")
    locks = FencedLocks(stream.redis, stream.name)
    control = KeyControl(stream.redis, stream.name)
    for key, own in (("paused", paused), ("lost", lost)):
        lease = locks.acquire(own, "own-holder", 10_000)
        assert lease is not None
        aside = aside_queue_name(stream.name, key, "t1")
        assert control.set_aside_tail(key, lease, aside) == [aside]
        assert locks.release([lease]) == 1
    registry = QueueRegistry(stream.redis, stream.name)
    amqp.channel().queue_delete(lost)
    assert registry.forget_if_unchanged({lost: registry.queues()[lost]}) == 1
    before = registry.queues()
    assert lost not in before

    janitor = Janitor([stream.name], settings=janitor_settings(), janitor_id="janitor-kept")
    janitor.run(once=True)

    stats = janitor.stats
    expected = {"deleted": 0, "demoted": 0, "skipped_not_empty": 1, "revived": 1}
    expected |= {"skipped_aside": 0, "errors": 0, "skipped_moving": 1, "watchdog_repairs": 1}
    assert {name: stats[name] for name in expected} == expected, stats
    buckets = {busy_bucket, paused_bucket, moving_bucket, lost_bucket}
    assert not {paused, moving, *buckets} & set(fence_calls["marked"])
    assert queue_depth(amqp, busy) == 1
    assert {queue_depth(amqp, queue) for queue in (paused, moving, lost, *buckets)} == {0}
    book = RouteBook(stream.redis, stream.name)
    route = book.route("busy")
    assert route is not None and route.queue == busy and not route.open
    route = book.route("paused")
    assert route is not None and route.queue == paused
    route = book.route("moving")
    assert route is not None and route.open
    assert book.route("lost") is not None
    assert "demoted" not in book.counts()
    assert book.open_moves() == {"moving": moving_bucket}
    assert lost in registry.queues()
    assert registry.original_keys([lost]) == {lost: "lost"}
    assert registry.queues()[lost_bucket] == before[lost_bucket]  # the bucket was not woken
