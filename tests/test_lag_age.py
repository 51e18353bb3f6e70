"""The age of a stream's oldest unprocessed event: the oldest head of the queues nobody consumes
(peeked, and left in place), and the events workers hold: a worker stuck in a slow batch has
nothing ready in its queue, yet its events are waiting."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from keyq import Producer
from keyq.broker.naming import key_queue_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.stream_figures import FiguresRecord
from keyq.broker.streams import load_stream_config
from keyq.janitor.stream_gauges import StreamGauges
from tests.conftest import StreamFixture
from tests.helpers import drain
from tests.workers import wait_until

pytestmark = pytest.mark.slow


def test_the_oldest_event_age_counts_what_a_worker_holds_unapplied(
    stream: StreamFixture, workers: Any, producer: Producer, tmp_path: Path
) -> None:
    marker = tmp_path / "in-batch"
    worker = workers(
        stream.name,
        pipeline="tests.pipelines:audit_slow",
        mode="key",
        env={"KEYQ_TEST_BATCH_MARKER": str(marker), "KEYQ_TEST_BATCH_PAUSE": "6"},
    ).wait_ready()
    for n in range(1, 6):
        producer.publish("slow-key", {"n": n, "producer": "p"})
    producer.flush(timeout=20)
    published_at = time.time()
    wait_until(marker.exists, 60, "the worker to be inside its batch", every=0.05)
    time.sleep(2.5)
    gauges = StreamGauges(stream.settings, "test-janitor")
    try:
        config = load_stream_config(stream.redis, stream.name)
        assert config is not None
        wait_until(  # the worker's next heartbeat carries what it holds
            lambda: (
                gauges.measure(stream.redis, stream.name, config) is None
                and (gauges.latest[stream.name].oldest_event_age_s or 0) >= 2.0
            ),
            10,
            "the age of the events the worker holds",
        )
        figures = gauges.latest[stream.name]
        kept = FiguresRecord(stream.redis, stream.name).read()  # what the console reads
    finally:
        gauges.close()
    assert kept is not None and kept.janitor == "test-janitor"
    assert kept.figures.ready_events == 0 and kept.figures.live_workers == figures.live_workers
    assert stream.redis.pttl(StreamKeys(stream.name).figures) > 0  # it goes with its janitor
    assert figures.ready_events == 0  # nothing ready: the worker holds them all
    age = figures.oldest_event_age_s
    assert age is not None and age <= time.time() - published_at + 1.0, age
    assert worker.terminate() == 0, worker.log()[-3000:]


@pytest.mark.parametrize("listing", ["declared", "prometheus down"])
def test_with_no_worker_the_age_is_the_oldest_queue_heads_and_peeking_takes_nothing(
    listing: str,
    stream: StreamFixture,
    producer: Producer,
    amqp: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without a listing, or with one that does not answer, the queues are declared passively;
    a broker that cannot be reached leaves the depths unmeasured, said once per outage."""
    producer.publish("old-key", {"n": 1, "producer": "p"})
    producer.flush(timeout=20)
    published_at = time.time()
    time.sleep(1.5)
    for key in ("old-key", "new-key"):
        producer.publish(key, {"n": 2, "producer": "p"})
    producer.flush(timeout=20)
    config = load_stream_config(stream.redis, stream.name)
    assert config is not None
    dead = "http://127.0.0.1:1/metrics"  # nothing listens on port 1
    listed = stream.settings.model_copy(
        update={"prometheus_url": dead if listing == "prometheus down" else None}
    )
    gauges = StreamGauges(listed, "test-janitor")
    try:
        gauges.measure(stream.redis, stream.name, config)
        figures = gauges.latest[stream.name]
    finally:
        gauges.close()
    assert (figures.ready_events, figures.dead_letters, figures.live_workers) == (3, 0, 0)
    age = figures.oldest_event_age_s  # the older key's head, not the newer key's
    assert age is not None and 1.4 <= age <= time.time() - published_at + 0.5, age
    queue = key_queue_name(stream.name, "old-key")
    assert [m.json()["n"] for m in drain(amqp.channel(), queue)] == [1, 2]  # peeked, kept
    unreachable = StreamGauges(
        listed.model_copy(update={"amqp_url": "amqp://keyq:s3cret-pw@127.0.0.1:1/%2F"}),
        "test-janitor",
    )
    caplog.set_level("WARNING", logger="keyq.janitor")
    for _ in range(2):
        unreachable.measure(stream.redis, stream.name, config)
    down = unreachable.latest[stream.name]
    assert (down.ready_events, down.dead_letters, down.oldest_event_age_s) == (None, None, None)
    said = [r.getMessage() for r in caplog.records if "not measured" in r.getMessage()]
    assert len(said) == 1 and "s3cret-pw" not in said[0], said
