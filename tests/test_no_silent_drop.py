"""No silent drop: queues deleted as the janitor does (mark, grace, ``if_empty``) under a
producer publishing 10,000 events or more lose none, in per-key order (a copy only of what was sent
again, dropped by seq as a worker does). Queues deleted unmarked: tests/test_producer_metrics.py."""

from __future__ import annotations

import multiprocessing
import time
from collections import defaultdict
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event as EventType

import pika
import pika.exceptions
import redis
from pika.adapters.blocking_connection import BlockingChannel

from keyq import Producer
from keyq.broker.envelope import HEADER_KEY, HEADER_SEQ
from keyq.broker.naming import key_queue_name
from keyq.broker.retirement import Mark, RetirementFence
from keyq.broker.settings import load_settings
from tests.conftest import StreamFixture
from tests.helpers import unpacked

KEYS = [f"acct-{i}" for i in range(5)]
EVENTS = 10_000


def take_everything(channel: BlockingChannel, queue: str) -> list[tuple[str, int]]:
    """Consume (and ack) what ``queue`` holds until it stays quiet for 5 ms."""
    taken: list[tuple[str, int]] = []
    for method, properties, body in channel.consume(queue, inactivity_timeout=0.005):
        if method is None:
            break
        taken.extend(
            (str(headers[HEADER_KEY]), int(headers[HEADER_SEQ]))
            for headers, *_ in unpacked(properties, body)
        )
        channel.basic_ack(method.delivery_tag)
    channel.cancel()  # anything delivered but not yet taken goes back to the queue
    return taken


def delete_over_and_over(
    amqp_url: str,
    redis_url: str,
    stream: str,
    queues: list[str],
    grace_s: float,
    stop: EventType,
    deleted: Synchronized[int],
    results: multiprocessing.Queue[object],
) -> None:
    """Retire the queues again and again until told to stop; report what was drained."""
    fence = RetirementFence(redis.Redis.from_url(redis_url, decode_responses=True), stream)
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=500)
    seen: list[tuple[str, int]] = []
    deletions = refused = 0
    while not stop.is_set():
        marks = fence.mark(queues, "test-deleter", ttl_ms=10_000)
        marked = [queue for queue, mark in marks.items() if mark is Mark.MARKED]
        time.sleep(grace_s)
        for queue in marked:
            try:
                seen.extend(take_everything(channel, queue))
                channel.queue_delete(queue, if_empty=True)
                deletions += 1
                deleted.value = deletions
            except pika.exceptions.ChannelClosedByBroker:
                refused += 1  # 404: not declared again yet; 406: not empty
                channel = connection.channel()
                channel.basic_qos(prefetch_count=500)
        fence.unmark(marked)
        time.sleep(grace_s / 2)
    for queue in queues:  # what is left after the producer finished
        try:
            seen.extend(take_everything(channel, queue))
        except pika.exceptions.ChannelClosedByBroker:
            channel = connection.channel()
    connection.close()
    results.put((seen, deletions, refused))


def test_deleting_queues_under_a_producer_loses_nothing(stream: StreamFixture) -> None:
    queues = [key_queue_name(stream.name, key) for key in KEYS]
    stream.track(*queues)
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    results: multiprocessing.Queue[object] = context.Queue()
    deleted = context.Value("i", 0)
    settings = load_settings(publish_lease_ms=100, retire_grace_ms=250)
    deleter = context.Process(
        target=delete_over_and_over,
        args=(settings.amqp_url, settings.redis_url, stream.name, queues, 0.25, stop, deleted),
        kwargs={"results": results},
    )
    deleter.start()
    published: dict[str, list[int]] = defaultdict(list)
    try:
        with Producer(stream.name, mode="key", settings=settings, confirm_window=200) as producer:
            # EVENTS at least, and on until the deleter has deleted 20 queues: a loaded
            # machine deletes fewer in the time EVENTS take.
            n, deadline = 0, time.monotonic() + 180
            while n < EVENTS or (deleted.value < 20 and time.monotonic() < deadline):
                key = KEYS[n % len(KEYS)]
                published[key].append(producer.publish(key, {"n": n}).seq)
                if n % 100 == 99:
                    time.sleep(0.03)  # bursts, so the deleter empties and deletes queues
                n += 1
            producer.flush(60)
            stats = dict(producer.stats)
    finally:
        stop.set()
    seen, deletions, refused = results.get(timeout=60)  # type: ignore[misc]
    deleter.join(30)

    by_key: dict[str, list[int]] = defaultdict(list)
    for key, seq in seen:
        by_key[key].append(seq)
    sent_again = stats["late_confirms"] + stats["returned"] + stats["resent"]
    copies = 0
    for key in KEYS:
        applied: list[int] = []  # what a worker applies: each seq past the last one applied
        for seq in by_key[key]:
            if applied and seq <= applied[-1]:
                copies += 1
            else:
                applied.append(seq)
        missing = sorted(set(published[key]) - set(applied))
        assert not missing, f"{key}: {len(missing)} lost or out of order, first {missing[:5]}"
        assert applied == published[key], f"{key}: foreign events"
    assert copies <= sent_again, f"{copies} copies of events, only {stats} sent again"
    assert deletions >= 20, f"the race was not exercised ({deletions} deletions, {refused} refused)"
