"""No key is left stranded: every event that waits aside has a path to a worker.

Only the holder of a key's own queue drains the queues its events wait in aside. A janitor that
deleted that queue while events waited aside (drained, idle, unheld: its worker killed, say)
left them with no path to any worker, for good. The janitor now refuses such a queue, and its
watchdog re-declares the queue of a key found in that state, and reports what it cannot
repair (a parked key whose dead letter is gone)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from keyq import Producer
from keyq.broker.key_control import KeyControl, ParkedKey
from keyq.broker.naming import key_queue_name
from keyq.broker.settings import load_settings
from keyq.broker.stranded import StrandedRecord
from keyq.janitor.config import JanitorSettings
from keyq.janitor.janitor import Janitor
from keyq.worker.batch.state_store import StateStore
from tests.conftest import StreamFixture
from tests.helpers import queue_depth
from tests.operator_helpers import dead_letter, keyq_delivery
from tests.workers import run_keyq, wait_until

pytestmark = pytest.mark.slow

KEY = "acct-63"
EVENTS = 30


def janitor(stream: StreamFixture, **overrides: Any) -> Janitor:
    values: dict[str, Any] = {
        "idle_ttl_s": 1.0,
        "janitor_interval_s": 0.2,
        "stranded_after_s": 2.0,
        "amqp_url": stream.settings.amqp_url,
        "redis_url": stream.settings.redis_url,
        **overrides,
    }
    return Janitor([stream.name], settings=load_settings(JanitorSettings, **values))


def keyq(stream: StreamFixture, *args: str) -> str:
    """``keyq ARGS --stream <the test's>``, which must succeed."""
    done = run_keyq(stream.settings, *args, "--stream", stream.name)
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


def applied(store: StateStore, key: str) -> int:
    return int((store.get(key) or {"applied": 0})["applied"])


def in_order_once(store: StateStore, key: str) -> bool:
    state = store.get(key) or {}
    return state.get("applied") == EVENTS and not state.get("violations")


def set_aside_with_no_worker(
    stream: StreamFixture, workers: Any, producer: Producer, amqp: Any
) -> tuple[KeyControl, str]:
    """A paused key's events set aside by a worker that is then killed -9, the key resumed:
    its own queue is drained, idle and unheld while its events wait aside."""
    control = KeyControl(stream.redis, stream.name)
    worker = workers(stream.name, pipeline="tests.pipelines:audit", mode="key")
    worker.wait_ready()
    keyq(stream, "pause", "--key", KEY)
    for n in range(1, EVENTS + 1):
        producer.publish(KEY, {"n": n})
    producer.flush(timeout=30)
    queue = key_queue_name(stream.name, KEY)
    wait_until(lambda: control.status(KEY).aside, 60, "the paused key's events set aside")
    unlocked = lambda: stream.redis.get(stream.keys.lock(queue)) is None  # noqa: E731
    drained = lambda: unlocked() and queue_depth(amqp, queue) == 0  # noqa: E731
    wait_until(drained, 60, "its own queue drained and handed back")
    worker.kill()
    keyq(stream, "resume", "--key", KEY)
    return control, queue


def test_a_key_queue_with_events_aside_is_kept_and_declared_again_once_stranded(
    stream: StreamFixture, workers: Any, producer: Producer, amqp: Any
) -> None:
    """The janitor keeps the key's drained, idle, unheld queue while its events wait aside (the
    stranding found in the field). A key already stranded, as an older janitor left it (its
    queue deleted and forgotten), gets its queue back within one look, and a worker drains
    what waited aside, in order, once."""
    control, queue = set_aside_with_no_worker(stream, workers, producer, amqp)
    store = StateStore(stream.redis, stream.name)
    tender = janitor(stream)
    wait_until(lambda: stream.redis.get(stream.keys.lock(queue)) is None, 30, "lock expiry")
    for _ in range(10):  # well past the idle ttl: retired if it ever would be
        tender.run(once=True)
        time.sleep(0.3)
    assert queue_depth(amqp, queue) is not None, "the key's queue was deleted with its events aside"
    assert tender.stats["deleted"] == 0, tender.stats
    assert tender.stats["watchdog_repairs"] == 0, tender.stats  # nothing needed repair

    amqp.channel().queue_delete(queue)
    stream.redis.zrem(stream.keys.registry, queue)
    stream.redis.hdel(stream.keys.queue_keys, queue)
    worker = workers(stream.name, pipeline="tests.pipelines:audit", mode="key")
    worker.wait_ready()
    watchdog = janitor(stream, idle_ttl_s=3600.0)
    watchdog.run(once=True)
    assert watchdog.stats["watchdog_repairs"] == 1, watchdog.stats
    assert queue_depth(amqp, queue) is not None
    wait_until(lambda: applied(store, KEY) >= EVENTS, 90, "the aside events applied")
    assert in_order_once(store, KEY), store.get(KEY)
    wait_until(lambda: not control.status(KEY).aside, 30, "the aside queues drained")
    watchdog.run(once=True)
    assert StrandedRecord(stream.redis, stream.name).all() == {}


def test_the_watchdog_reports_a_parked_key_whose_dead_letter_is_gone(
    stream: StreamFixture, producer: Producer, amqp: Any
) -> None:
    """What it cannot repair it reports: in the stranded gauge, ``keyq status`` and ``keyq
    inspect``; a key that flows, and a parked key whose dead letter waits, are not reported
    (told apart by the index of dead letters)."""
    for key in ("flowing", "parked", "lettered"):
        producer.publish(key, {"n": 1})
    producer.flush(timeout=30)
    control = KeyControl(stream.redis, stream.name)
    for key in ("parked", "lettered"):
        control.park(key, ParkedKey(at_ms=1, reason="pipeline failed: boom", producer="p", seq=7))
    queue = key_queue_name(stream.name, "lettered")
    dead_letter(amqp, stream.name, [keyq_delivery(queue, "lettered", "p", 7, b"{}")])
    tender = janitor(stream, idle_ttl_s=3600.0)
    tender.run(once=True)
    assert StrandedRecord(stream.redis, stream.name).all() == {}  # not for long enough yet
    stream.redis.set(stream.keys.redrive_lock, "an operator's walk", px=10_000)
    time.sleep(2.2)  # past KEYQ_STRANDED_AFTER_S
    tender.run(once=True)
    assert StrandedRecord(stream.redis, stream.name).all() == {}  # its letters may be taken
    stream.redis.delete(stream.keys.redrive_lock)
    tender.run(once=True)
    found = StrandedRecord(stream.redis, stream.name).all()
    assert list(found) == ["parked"], found
    assert "no dead letter" in found["parked"].reason
    assert tender.watchdog.latest == {stream.name: 1}

    status = keyq(stream, "status")
    assert "stranded" in status and "parked" in status, status
    inspected = keyq(stream, "inspect", "--key", "parked")
    assert "no dead letter" in inspected, inspected
    calm = keyq(stream, "inspect", "--key", "flowing")
    assert "stranded" not in calm, calm


def test_the_watchdog_reports_a_held_queue_and_a_worker_that_apply_nothing(
    stream: StreamFixture, workers: Any, producer: Producer, tmp_path: Path
) -> None:
    """A pipeline that hangs: its worker keeps its locks (renewed on another thread) and its
    queue's events stay ready behind a small prefetch; the watchdog names the key and the
    worker. Only the holder can act, so nothing is repaired."""
    env = {
        "KEYQ_TEST_BATCH_MARKER": str(tmp_path / "batch"),
        "KEYQ_TEST_BATCH_PAUSE": "600",
        "KEYQ_PREFETCH": "10",
        "KEYQ_BATCH_MAX_EVENTS": "10",
    }
    worker = workers(stream.name, pipeline="tests.pipelines:audit_slow", mode="key", env=env)
    worker.wait_ready()
    for n in range(1, 51):
        producer.publish("hung", {"n": n})
    producer.flush(timeout=30)
    wait_until((tmp_path / "batch").exists, 90, "the worker to be inside its first batch")
    tender = janitor(stream, idle_ttl_s=3600.0)

    def reported() -> dict[str, Any]:
        tender.run(once=True)
        found = StrandedRecord(stream.redis, stream.name).all()
        return found if {"hung", f"worker {worker.worker_id}"} <= set(found) else {}

    found = wait_until(reported, 30, "the key and its worker reported", every=0.5)
    assert "held by " + worker.worker_id in found["hung"].reason, found
    assert "applied none" in found[f"worker {worker.worker_id}"].reason, found
    assert tender.stats["watchdog_repairs"] == 0, tender.stats


def test_a_paused_stream_strands_nothing(
    stream: StreamFixture, producer: Producer, amqp: Any
) -> None:
    """While the whole stream is paused, workers hold nothing by design: a key with events
    aside is neither reported nor woken, every look."""
    producer.publish(KEY, {"n": 1})
    producer.flush(timeout=30)
    queue = key_queue_name(stream.name, KEY)
    stream.redis.hset(stream.keys.aside, KEY, '["side"]')
    keyq(stream, "pause", "--all")
    tender = janitor(stream, idle_ttl_s=3600.0)
    for _ in range(3):
        tender.run(once=True)
        time.sleep(1.1)
    tender.run(once=True)
    assert StrandedRecord(stream.redis, stream.name).all() == {}
    assert tender.stats["watchdog_repairs"] == 0, tender.stats
    keyq(stream, "resume", "--all")
    tender.run(once=True)
    time.sleep(2.2)
    tender.run(once=True)
    found = StrandedRecord(stream.redis, stream.name).all()
    assert list(found) == [KEY] and "nobody holds" in found[KEY].reason, found
    assert queue_depth(amqp, queue) == 1
