"""A rate limit per key with a real worker: a hot key's burst is applied at the limit, in
order, while a cold key's events are applied without waiting for it."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from keyq import Producer
from tests.conftest import StreamFixture
from tests.workers import run_keyq, wait_until

pytestmark = pytest.mark.slow

RATE = 50
HOT_EVENTS = 300


def seen(stream: StreamFixture, key: str, producer: Producer) -> list[int]:
    raw = stream.redis.hget(stream.keys.state, key)
    return [] if raw is None else list(orjson.loads(raw)["seen"].get(producer.producer_id, []))


@pytest.mark.alone
def test_a_hot_key_is_held_to_its_rate_while_a_cold_key_keeps_its_latency(
    stream: StreamFixture, workers: Any, producer: Producer
) -> None:
    worker = workers(stream.name, pipeline="tests.pipelines:ledger", mode="key")
    worker.wait_ready()
    producer.publish("warm-up", {"n": 1, "producer": producer.producer_id})
    producer.flush(timeout=20)
    wait_until(lambda: seen(stream, "warm-up", producer) == [1], 60, "the stream to run")
    done = run_keyq(stream.settings, "stream", "set", "--stream", stream.name, "--rate-limit", "50")
    assert done.returncode == 0, done.stderr
    time.sleep(1.5)  # workers read the policy within a second

    for n in range(1, HOT_EVENTS + 1):
        producer.publish("hot", {"n": n, "producer": producer.producer_id})
    producer.flush(timeout=20)
    started = time.monotonic()
    cold_latencies: list[float] = []
    cold = 0
    while len(seen(stream, "hot", producer)) < HOT_EVENTS:
        assert time.monotonic() - started < 60, "the hot key never finished"
        cold += 1
        producer.publish("cold", {"n": cold, "producer": producer.producer_id})
        producer.flush(timeout=20)
        sent = time.monotonic()
        wait_until(lambda c=cold: len(seen(stream, "cold", producer)) >= c, 10, "cold", 0.01)
        cold_latencies.append(time.monotonic() - sent)
        time.sleep(0.2)
    took = time.monotonic() - started
    cold_latencies.sort()
    print(
        f"{HOT_EVENTS} events of a key limited to {RATE}/s took {took:.1f}s; a cold key's "
        f"latency meanwhile: median {cold_latencies[len(cold_latencies) // 2]:.2f}s, "
        f"worst {cold_latencies[-1]:.2f}s over {len(cold_latencies)} events"
    )
    # A bucket holds one second of events: the rest take the limit's time.
    least = (HOT_EVENTS - RATE) / RATE
    assert least * 0.9 <= took <= least + 6.0, took
    # A cold key held behind the hot one would wait for a good part of its ``least`` seconds;
    # a loaded machine's batch takes about a second (the latency itself is bench.hot_key's).
    assert cold_latencies[-1] < least / 2, cold_latencies[-5:]
    assert seen(stream, "hot", producer) == list(range(1, HOT_EVENTS + 1))
    assert seen(stream, "cold", producer) == list(range(1, cold + 1))
    assert worker.terminate() == 0, worker.log()[-3000:]
