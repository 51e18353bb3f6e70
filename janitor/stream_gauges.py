"""What a stream looks like from outside, measured by the janitor that leads it, once per
pass: dead letters, events ready in its queues, the age of the oldest event waiting in a
queue no worker consumes, parked and paused keys, live workers, and in auto mode its promoted
keys (``promoted``, for the metrics only).

Depths come from ``rabbitmq_prometheus`` (``KEYQ_PROMETHEUS_URL``) or the management API
(``KEYQ_MANAGEMENT_URL``) when set, in one listing; else from passive declares of the
registered queues, at most ``DECLARE_LIMIT`` of them (with more, the ready events are not
measured). The oldest age is read from the head of at most ``PEEK_LIMIT`` queues per pass
that have ready events and no consumer: a ``basic.get`` without ack, its
``x-keyq-published-at`` header read, then a ``basic.nack`` with requeue, which puts the
event back at the head (it reaches its worker marked redelivered). Quorum streams are not
peeked (a requeue counts toward their delivery limit). Queues a worker consumes are not
peeked; instead each worker reports when the oldest event it holds and has not applied was
published (buffered, deferred for an earlier seq or in the batch being processed), and the
age is the oldest of all these.
"""

from __future__ import annotations

import logging
import time

import pika
import pika.exceptions
import redis
from pika.adapters.blocking_connection import BlockingChannel

from keyq.broker.connections import open_blocking_connection
from keyq.broker.envelope import HEADER_PUBLISHED_AT
from keyq.broker.errors import KeyqError
from keyq.broker.management import queue_figures as management_figures
from keyq.broker.membership import Membership
from keyq.broker.naming import Mode, dead_letter_queue_name, stream_prefix
from keyq.broker.prometheus_api import queue_figures as prometheus_figures
from keyq.broker.queue_probe import QueueCounts, QueueProbe
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.registry import QueueRegistry
from keyq.broker.routes import RouteBook
from keyq.broker.settings import Settings
from keyq.broker.stream_figures import FiguresRecord, StreamFigures
from keyq.broker.streams import StreamConfig
from keyq.broker.urls import vhost_of
from keyq.broker.worker_report import WorkerReport

log = logging.getLogger("keyq.janitor")

DECLARE_LIMIT = 2000  # passive declares per stream and pass, without a listing endpoint
PEEK_LIMIT = 20  # head messages read per stream and pass
LISTING_TIMEOUT_S = 10.0

Figures = dict[str, QueueCounts | None]  # None: the queue is not there


class StreamGauges:
    """Measures the streams a janitor leads; ``latest`` is read by its metrics."""

    def __init__(self, settings: Settings, janitor_id: str, figures_ttl_s: float = 60.0) -> None:
        self._settings = settings
        self._janitor_id = janitor_id
        self._figures_ttl_s = figures_ttl_s  # the record outlives a few passes, no more
        self._name = f"{janitor_id}-gauges"
        self._connection: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._probe = QueueProbe(self._open_channel)  # shares the peeks' channel
        self.latest: dict[str, StreamFigures] = {}
        self.promoted: dict[str, int] = {}  # auto-mode streams: keys with a queue of their own
        self._failing = False

    def forget(self, stream: str) -> None:
        """No longer this janitor's to measure (another leads it)."""
        self.latest.pop(stream, None)
        self.promoted.pop(stream, None)

    def measure(self, client: redis.Redis, stream: str, config: StreamConfig) -> None:
        """Measure ``stream`` now. Redis errors propagate (the pass fails as a whole); a
        broker that cannot be asked leaves its figures unmeasured, said once per outage."""
        keys = StreamKeys(stream)
        pipe = client.pipeline(transaction=False)
        pipe.hlen(keys.paused_keys)
        pipe.hlen(keys.parked_keys)
        paused, parked = (int(count) for count in pipe.execute())
        if config.mode is Mode.AUTO:
            self.promoted[stream] = RouteBook(client, stream).count()
        membership = Membership(client, stream, self._settings.member_ttl_ms)
        alive = membership.alive()
        live = len(alive)
        held_since = workers_oldest_event_ms(client, stream, alive)
        dead_letter_queue = dead_letter_queue_name(stream)
        queues = [q for q in QueueRegistry(client, stream).queues() if q != dead_letter_queue]
        dead_letters = ready = age = None
        try:
            figures = self.figures(stream, [*queues, dead_letter_queue])
            dead = figures.get(dead_letter_queue)
            dead_letters = dead.ready if dead is not None else 0
            ready = self._ready(figures, queues)
            if ready == 0:
                age = 0.0
            elif config.queue_type != "quorum":
                age = self._oldest_age_s(figures, queues)
            if self._failing:
                log.info("stream gauges: RabbitMQ answers again")
                self._failing = False
        except (KeyqError, pika.exceptions.AMQPError, OSError) as exc:
            self.close()
            if not self._failing:
                log.warning("stream gauges of %s not measured: %s", stream, exc)
                self._failing = True
        if held_since is not None:  # what workers hold and have not applied is waiting too
            held_age = max(0.0, time.time() - held_since / 1000)
            age = held_age if age is None else max(age, held_age)
        self.latest[stream] = StreamFigures(
            dead_letters=dead_letters,
            ready_events=ready,
            oldest_event_age_s=age,
            parked_keys=parked,
            paused_keys=paused,
            live_workers=live,
        )
        # Kept in Redis too: readers other than the metrics (the console) see them.
        record = FiguresRecord(client, stream)
        record.write(self.latest[stream], self._janitor_id, self._figures_ttl_s)

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except Exception:  # closing a broken connection: nothing left to do
                log.debug("closing the gauges' connection failed", exc_info=True)

    # ---- the figures --------------------------------------------------------------------------

    @staticmethod
    def _ready(figures: Figures, queues: list[str]) -> int | None:
        if any(queue not in figures for queue in queues):
            return None  # more queues than are declared per pass: not measured
        return sum(found.ready for queue in queues if (found := figures[queue]) is not None)

    def figures(self, stream: str, queues: list[str]) -> Figures:
        """The counts of ``queues``: from a listing when one is set and answers (queues it
        does not report are declared), else declared, up to the limit."""
        settings = self._settings
        listed: dict[str, tuple[int, int] | None] | None = None
        vhost = vhost_of(settings.amqp_url)
        try:
            if settings.prometheus_url:
                found = prometheus_figures(
                    settings.prometheus_url,
                    vhost,
                    LISTING_TIMEOUT_S,
                    prefix=stream_prefix(stream),
                )
                listed = dict(found.items())
            elif settings.management_url:
                listed = management_figures(settings.management_url, vhost, LISTING_TIMEOUT_S)
        except KeyqError as exc:
            log.debug("stream gauges of %s: listing failed, declaring: %s", stream, exc)
        figures: Figures = {}
        if listed is not None:
            figures = {q: QueueCounts(*both) for q in queues if (both := listed.get(q)) is not None}
        unknown = [queue for queue in queues if queue not in figures][:DECLARE_LIMIT]
        if unknown:
            self._open_channel()  # a connection dropped while idle is opened again first
            figures.update(self._probe.counts_of(unknown))
        return figures

    def _oldest_age_s(self, figures: Figures, queues: list[str]) -> float | None:
        """The age of the oldest head event among unconsumed queues with ready events."""
        waiting = [
            queue
            for queue in queues
            if (found := figures.get(queue)) is not None and found.ready > 0 and not found.consumers
        ]
        oldest: int | None = None
        for queue in waiting[:PEEK_LIMIT]:
            published = self._peek(queue)
            if published is not None and (oldest is None or published < oldest):
                oldest = published
        if oldest is None:
            return None
        return max(0.0, time.time() - oldest / 1000)

    def _peek(self, queue: str) -> int | None:
        """The publish time (ms) of the event at the head of ``queue``, requeued at once."""
        channel = self._open_channel()
        try:
            method, properties, _body = channel.basic_get(queue, auto_ack=False)
        except pika.exceptions.ChannelClosedByBroker:
            self._channel = None  # gone, or taken by a worker meanwhile: not this pass
            return None
        if method is None:
            return None
        channel.basic_nack(method.delivery_tag, requeue=True)
        value = (properties.headers or {}).get(HEADER_PUBLISHED_AT)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def _open_channel(self) -> BlockingChannel:
        if self._connection is not None and self._connection.is_open:
            try:  # heartbeats: a connection idle between passes is dropped by the broker
                self._connection.process_data_events(0)
            except pika.exceptions.AMQPError:
                self.close()
        if self._connection is None or not self._connection.is_open:
            self._channel = None
            self._connection = open_blocking_connection(self._settings, self._name)
        if self._channel is None or not self._channel.is_open:
            self._channel = self._connection.channel()
        return self._channel


def workers_oldest_event_ms(client: redis.Redis, stream: str, alive: list[str]) -> int | None:
    """When the oldest event a live worker holds unapplied was published, from the reports
    in their heartbeats (``WorkerReport.oldest_event_ms``)."""
    if not alive:
        return None
    raws = client.hmget(StreamKeys(stream).member_info, alive)
    stamps = [
        report.oldest_event_ms
        for worker, raw in zip(alive, raws, strict=True)
        if (report := WorkerReport.parse(raw, worker=worker, stream=stream)) is not None
        and report.oldest_event_ms is not None
    ]
    return min(stamps, default=None)
