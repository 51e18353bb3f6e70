"""The producers' Prometheus metrics (``metrics=``), on the real broker: each figure read from
a registry of the test's own after a scenario that must move it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast
from urllib.parse import urlsplit

import pika
import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from keyq import Producer
from keyq.aio import Producer as AsyncProducer
from keyq.broker.errors import ConfigurationError
from keyq.broker.naming import key_queue_name
from keyq.producer.metrics import NO_METRICS, ProducerMetrics, meter_for
from keyq.producer.outgoing import Outgoing
from tests.conftest import StreamFixture
from tests.faults import FaultProxy
from tests.helpers import drain


def sample(registry: CollectorRegistry, name: str, stream: str, **labels: str) -> float:
    """A sample's value, 0 when it was never recorded."""
    value = registry.get_sample_value(name, {"stream": stream, **labels})
    return 0.0 if value is None else value


def published(registry: CollectorRegistry, stream: str) -> float:
    return sample(registry, "keyq_producer_events_published_total", stream)


def confirm_count(registry: CollectorRegistry, stream: str) -> float:
    return sample(registry, "keyq_producer_confirm_seconds_count", stream)


@pytest.fixture
def proxy(stream: StreamFixture) -> Iterator[FaultProxy]:
    parts = urlsplit(stream.settings.amqp_url)
    with FaultProxy(parts.hostname or "127.0.0.1", parts.port or 5672) as started:
        yield started


# ------------------------------------------------------------------ the real broker
def test_n_events_confirmed_count_n_published_and_n_latencies(stream: StreamFixture) -> None:
    registry = CollectorRegistry()
    events = 300
    with Producer(
        stream.name, mode="key", settings=stream.settings, confirm_window=64, metrics=registry
    ) as producer:
        for n in range(events):
            producer.publish(f"k{n % 7}", {"n": n})
        producer.flush(20)
        assert published(registry, stream.name) == events
        assert sample(registry, "keyq_producer_events_confirmed_total", stream.name) == events
        assert confirm_count(registry, stream.name) == events
        assert sample(registry, "keyq_producer_confirm_seconds_sum", stream.name) > 0
        assert sample(registry, "keyq_producer_window_events", stream.name) == 0
        assert sample(registry, "keyq_producer_window_size", stream.name) == 64
        for nothing in ("returned", "nacked", "confirmed_late"):
            assert sample(registry, f"keyq_producer_events_{nothing}_total", stream.name) == 0
    # A closed producer's window is no longer read; its counters stay.
    assert registry.get_sample_value("keyq_producer_window_size", {"stream": stream.name}) is None
    assert published(registry, stream.name) == events


def test_a_queue_deleted_under_the_producer_counts_returned_and_resent(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    """Deleted unmarked, behind the producer's back: declared again, every event lands."""
    registry = CollectorRegistry()
    queue = key_queue_name(stream.name, "k")
    channel = amqp.channel()
    rounds, per_round = 15, 50
    seen: list[int] = []
    with Producer(stream.name, settings=stream.settings, metrics=registry) as producer:
        for round_ in range(rounds):
            for n in range(per_round):
                producer.publish("k", {"n": round_ * per_round + n})
            producer.flush(30)
            seen.extend(int(m.json()["n"]) for m in drain(channel, queue))
            channel.queue_delete(queue, if_empty=True)  # gone: the next events come back
        stats = producer.stats
    assert seen == list(range(rounds * per_round))
    returned = sample(registry, "keyq_producer_events_returned_total", stream.name)
    nacked = sample(registry, "keyq_producer_events_nacked_total", stream.name)
    late = sample(registry, "keyq_producer_events_confirmed_late_total", stream.name)
    redeclared = sample(
        registry, "keyq_producer_events_resent_total", stream.name, reason="redeclare"
    )
    assert stats["returned"] >= rounds - 1, f"only {stats['returned']} events came back"
    assert returned >= 1, stats
    assert returned + nacked == stats["returned"], stats
    assert late == stats["late_confirms"], stats
    # Every event that came back went again, once, to its queue declared anew.
    assert redeclared == returned + nacked + late, (redeclared, stats)
    assert (
        sample(registry, "keyq_producer_events_resent_total", stream.name, reason="reconnect") == 0
    )
    assert published(registry, stream.name) == rounds * per_round
    assert confirm_count(registry, stream.name) == rounds * per_round


def test_a_cut_connection_counts_a_reconnect_resends_and_the_window_in_use(
    stream: StreamFixture, proxy: FaultProxy
) -> None:
    registry = CollectorRegistry()
    before, held = 50, 20
    pause_s = 0.4
    with Producer(
        stream.name,
        mode="key",
        settings=stream.settings,
        amqp_url=proxy.url_for(stream.settings.amqp_url),
        publish_timeout=15,
        metrics=registry,
    ) as producer:
        for n in range(before):
            producer.publish(f"k{n % 3}", {"n": n})
        producer.flush(10)
        proxy.pause()  # nothing is confirmed from here
        for n in range(held):
            producer.publish(f"k{n % 3}", {"n": before + n})
        assert sample(registry, "keyq_producer_window_events", stream.name) == held
        time.sleep(pause_s)
        proxy.cut()
        proxy.resume()
        producer.flush(20)
        stats = producer.stats
        assert sample(registry, "keyq_producer_window_events", stream.name) == 0
    assert stats["reconnects"] >= 1, stats
    assert sample(registry, "keyq_producer_reconnects_total", stream.name) == stats["reconnects"]
    resent = sample(registry, "keyq_producer_events_resent_total", stream.name, reason="reconnect")
    assert resent == stats["resent"] == held, stats
    total = before + held
    assert published(registry, stream.name) == total
    assert confirm_count(registry, stream.name) == total

    def within(seconds: str) -> float:
        return sample(registry, "keyq_producer_confirm_seconds_bucket", stream.name, le=seconds)

    # The held events waited out the pause: timed from publish, not from their re-send.
    assert total - within("0.25") >= held
    assert within("10.0") == total


def test_producers_sharing_a_registry_share_its_families(stream: StreamFixture) -> None:
    """Producers in one registry (threaded or asyncio) add up; ``metrics=True`` records into
    the default one."""
    registry = CollectorRegistry()
    options: dict[str, Any] = {"mode": "key", "settings": stream.settings, "confirm_window": 30}
    with (
        Producer(stream.name, metrics=registry, **options) as first,
        Producer(stream.name, metrics=registry, **options) as second,
    ):
        first.publish("a", {"n": 1})
        second.publish("b", {"n": 2})
        second.publish("b", {"n": 3})
        first.flush(10)
        second.flush(10)
        assert sample(registry, "keyq_producer_window_size", stream.name) == 60
    assert published(registry, stream.name) == 3

    async def main() -> None:
        async with AsyncProducer(stream.name, metrics=registry, **options) as producer:
            for n in range(200):
                await producer.publish(f"k{n % 5}", {"n": n})
            await producer.flush(20)
            assert sample(registry, "keyq_producer_window_size", stream.name) == 30, "asyncio"

    asyncio.run(main())
    assert published(registry, stream.name) == 203, "the asyncio producer's events"
    assert confirm_count(registry, stream.name) == 203
    with Producer(stream.name, metrics=True, **options) as default:
        before = published(REGISTRY, stream.name)
        default.publish("c", {"n": 4})
        default.flush(10)
    assert published(REGISTRY, stream.name) == before + 1


def test_a_producer_not_asked_for_metrics_registers_none(
    stream: StreamFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    registered: list[object] = []
    original = CollectorRegistry.register

    def spy(self: CollectorRegistry, collector: Any) -> None:
        registered.append(collector)
        original(self, collector)

    monkeypatch.setattr(CollectorRegistry, "register", spy)
    with Producer(stream.name, mode="key", settings=stream.settings) as producer:
        producer.publish("k", {"n": 1})
        producer.flush(10)
    assert registered == []
    assert (
        REGISTRY.get_sample_value("keyq_producer_events_published_total", {"stream": stream.name})
        is None
    )


# ---------------------------------------------------------------- no service needed
def test_the_metrics_option_is_checked_before_any_io() -> None:
    assert meter_for(False, "s") is NO_METRICS
    with pytest.raises(ConfigurationError, match="CollectorRegistry"):
        meter_for(cast(Any, "yes"), "s")
    with pytest.raises(ConfigurationError, match="CollectorRegistry"):
        Producer("s", metrics=cast(Any, 1), amqp_url="amqp://nowhere.invalid:1/")


def _message(count: int, *, returned: bool = False, accepted_ago: float = 0.01) -> Outgoing:
    now = time.monotonic()
    events = [
        Outgoing(n, "q", "k", b"", cast(Any, SimpleNamespace()), accepted_at=now - accepted_ago)
        for n in range(count)
    ]
    if count == 1:
        events[0].returned = returned
        return events[0]
    return Outgoing(0, "q", "k", b"", cast(Any, None), returned=returned, events=events)


def test_each_settled_outcome_counts_in_its_own_family() -> None:
    registry = CollectorRegistry()
    families = ProducerMetrics.for_registry(registry)
    assert ProducerMetrics.for_registry(registry) is families  # made once per registry
    meter = families.meter("s")
    meter.settled(_message(3, accepted_ago=2.0), nacked=False, published=True)  # a pack of 3
    meter.settled(_message(1, returned=True), nacked=False, published=False)
    meter.settled(_message(2), nacked=True, published=False)
    meter.settled(_message(1), nacked=False, published=False)  # acked after its lease lapsed
    meter.resent(4, "redeclare")
    meter.resent(0, "reconnect")
    meter.reconnected()
    assert published(registry, "s") == 3
    assert sample(registry, "keyq_producer_events_confirmed_total", "s") == 5
    assert sample(registry, "keyq_producer_events_returned_total", "s") == 1
    assert sample(registry, "keyq_producer_events_nacked_total", "s") == 2
    assert sample(registry, "keyq_producer_events_confirmed_late_total", "s") == 1
    assert sample(registry, "keyq_producer_events_resent_total", "s", reason="redeclare") == 4
    assert sample(registry, "keyq_producer_events_resent_total", "s", reason="reconnect") == 0
    assert sample(registry, "keyq_producer_reconnects_total", "s") == 1
    assert confirm_count(registry, "s") == 3
    assert sample(registry, "keyq_producer_confirm_seconds_bucket", "s", le="1.0") == 0
    assert sample(registry, "keyq_producer_confirm_seconds_sum", "s") >= 6.0
