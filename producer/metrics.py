"""A producer's Prometheus metrics, opt-in: ``Producer(stream, metrics=True)`` records into
prometheus_client's default registry (what ``start_http_server`` serves), and
``metrics=registry`` into a ``CollectorRegistry`` of the application's; without either nothing
is recorded and no family is registered.

The families are made once per registry and shared by every producer recording into it,
labelled ``stream``: producers of one stream in a process add up, as a service's figures should,
and one made per request adds no series. Counters and the latency histogram are recorded on the
producer's I/O thread, each where its event happens (a confirm settled in ``sending``, a re-send,
a reconnect in ``connector``); the window gauges are read from the live producers' windows at
each scrape, so publishing pays nothing for them. A producer without metrics records into
``NO_METRICS``, whose methods do nothing: no branch at the places that record.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar, Literal

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from keyq.broker.errors import ConfigurationError

if TYPE_CHECKING:
    from keyq.producer.outgoing import Outgoing
    from keyq.producer.window import ConfirmWindow

LABELS = ("stream",)

# Why an event went again: its connection was lost before its confirm, or its queue had to be
# declared anew (the event was returned, nacked, or confirmed after its publish lease lapsed).
ResendReason = Literal["reconnect", "redeclare"]

# From ``publish`` accepting an event to its confirm: a millisecond or two on a quiet broker,
# longer with a full window or flow control, up to ``reconnect_timeout`` across an outage.
CONFIRM_SECONDS_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class Meter:
    """What a producer records; this base records nothing (a producer without metrics)."""

    def settled(self, message: Outgoing, *, nacked: bool, published: bool) -> None:
        """The broker acked or nacked ``message`` (an event or a pack); ``published``: it
        counts as published, else it goes again."""

    def resent(self, events: int, reason: ResendReason) -> None:
        """``events`` events go again, for ``reason``."""

    def reconnected(self) -> None:
        """A connection was opened again after one was lost or closed."""

    def watch(self, window: ConfirmWindow) -> None:
        """Have the window gauges read ``window`` until ``unwatch``."""

    def unwatch(self, window: ConfirmWindow) -> None:
        """The producer of ``window`` is closed."""


NO_METRICS = Meter()


class StreamMeter(Meter):
    """One producer's recorder: the shared families' children for its stream, looked up once
    so that recording is an increment."""

    def __init__(self, families: ProducerMetrics, stream: str) -> None:
        self._families = families
        self.stream = stream
        self._published = families.published.labels(stream)
        self._confirmed = families.confirmed.labels(stream)
        self._returned = families.returned.labels(stream)
        self._nacked = families.nacked.labels(stream)
        self._late = families.late.labels(stream)
        self._resent = {
            reason: families.resent.labels(stream, reason) for reason in ("reconnect", "redeclare")
        }
        self._reconnects = families.reconnects.labels(stream)
        self._latency = families.latency.labels(stream)

    def settled(self, message: Outgoing, *, nacked: bool, published: bool) -> None:
        count = message.count
        if nacked:
            self._nacked.inc(count)
            return
        self._confirmed.inc(count)
        if published:
            self._published.inc(count)
            now = time.monotonic()
            observe = self._latency.observe
            for event in message.members:
                observe(now - event.accepted_at)
        elif message.returned:
            self._returned.inc(count)
        else:  # acked after its queue's lease lapsed: sent again (``ConfirmLedger``)
            self._late.inc(count)

    def resent(self, events: int, reason: ResendReason) -> None:
        if events:
            self._resent[reason].inc(events)

    def reconnected(self) -> None:
        self._reconnects.inc()

    def watch(self, window: ConfirmWindow) -> None:
        self._families.windows.add(self.stream, window)

    def unwatch(self, window: ConfirmWindow) -> None:
        self._families.windows.discard(self.stream, window)


class WindowCollector(Collector):
    """The confirm windows of the live producers, summed by stream at each scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: dict[str, weakref.WeakSet[ConfirmWindow]] = {}

    def add(self, stream: str, window: ConfirmWindow) -> None:
        with self._lock:
            self._windows.setdefault(stream, weakref.WeakSet()).add(window)

    def discard(self, stream: str, window: ConfirmWindow) -> None:
        with self._lock:
            windows = self._windows.get(stream)
            if windows is not None:
                windows.discard(window)
                if not windows:  # no producer of the stream left: its gauges go
                    del self._windows[stream]

    def describe(self) -> list[Metric]:
        return [self._used(), self._size()]  # the names, checked against the registry's

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            streams = {stream: list(windows) for stream, windows in self._windows.items()}
        used, size = self._used(), self._size()
        for stream, windows in sorted(streams.items()):
            if not windows:  # collected without ``unwatch`` (a producer never closed)
                continue
            # Read without the windows' locks: a scrape must never wait on a publisher.
            used.add_metric([stream], sum(window.unsettled for window in windows))
            size.add_metric([stream], sum(window.size for window in windows))
        yield used
        yield size

    @staticmethod
    def _used() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "keyq_producer_window_events",
            "Events accepted by publish and not yet published (confirmed, not returned): the "
            "part of the confirm window in use.",
            labels=LABELS,
        )

    @staticmethod
    def _size() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "keyq_producer_window_size",
            "Events the confirm windows may hold (confirm_window), summed over the producers.",
            labels=LABELS,
        )


class ProducerMetrics:
    """The producer families of one registry; ``for_registry`` makes them once per registry
    (prometheus_client refuses a family registered twice)."""

    _made: ClassVar[weakref.WeakKeyDictionary[CollectorRegistry, ProducerMetrics]] = (
        weakref.WeakKeyDictionary()
    )
    _making: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, registry: CollectorRegistry) -> None:
        self.published = Counter(
            "keyq_producer_events_published",
            "Events published: confirmed by RabbitMQ and not returned (Receipt.published).",
            LABELS,
            registry=registry,
        )
        self.confirmed = Counter(
            "keyq_producer_events_confirmed",
            "Events RabbitMQ acked, published or not (a returned event is acked too, and an "
            "ack after the queue's publish lease lapsed does not count as published).",
            LABELS,
            registry=registry,
        )
        self.returned = Counter(
            "keyq_producer_events_returned",
            "Events RabbitMQ returned (basic.return, NO_ROUTE: their queue was deleted); their "
            "queue is declared again and they are sent again.",
            LABELS,
            registry=registry,
        )
        self.nacked = Counter(
            "keyq_producer_events_nacked",
            "Events RabbitMQ refused (basic.nack); they are sent again.",
            LABELS,
            registry=registry,
        )
        self.late = Counter(
            "keyq_producer_events_confirmed_late",
            "Events acked after their queue's publish lease lapsed (the queue may have been "
            "deleted meanwhile); they are sent again.",
            LABELS,
            registry=registry,
        )
        self.resent = Counter(
            "keyq_producer_events_resent",
            "Events sent again: after a lost connection (reason=reconnect), or to their queue "
            "declared anew (reason=redeclare: returned, nacked or confirmed late).",
            (*LABELS, "reason"),
            registry=registry,
        )
        self.reconnects = Counter(
            "keyq_producer_reconnects",
            "Connections to RabbitMQ opened again after one was lost or closed.",
            LABELS,
            registry=registry,
        )
        self.latency = Histogram(
            "keyq_producer_confirm_seconds",
            "Seconds from publish accepting an event to its being published (confirmed and not "
            "returned, re-sends included); one observation per event.",
            LABELS,
            registry=registry,
            buckets=CONFIRM_SECONDS_BUCKETS,
        )
        self.windows = WindowCollector()
        registry.register(self.windows)

    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> ProducerMetrics:
        with cls._making:
            made = cls._made.get(registry)
            if made is None:
                made = cls._made[registry] = cls(registry)
            return made

    def meter(self, stream: str) -> StreamMeter:
        return StreamMeter(self, stream)


def meter_for(metrics: bool | CollectorRegistry, stream: str) -> Meter:
    """The recorder a producer's ``metrics`` option asks for."""
    if metrics is False:
        return NO_METRICS
    registry = REGISTRY if metrics is True else metrics
    if not isinstance(registry, CollectorRegistry):
        raise ConfigurationError(
            f"metrics must be True, False or a prometheus_client CollectorRegistry, got {metrics!r}"
        )
    return ProducerMetrics.for_registry(registry).meter(stream)
