"""Auto mode's stage of an attempt (``keyq.broker.routes``): the promotions due, the own queues
a bucket's holder may forward to now, and the ``Routing`` the key gate sorts by.

A forward is a publish to the key's own queue, so it goes under a publish lease of the
retirement fence, as a producer's would, taken right before the copies are sent: while the
janitor retires that queue the key's events wait in the bucket (moving); a route found changed
after the lease (the janitor demoted the key meanwhile) runs the attempt again; and a copy
confirmed after its lease ran out does not count (the attempt fails and runs again; a second
copy is a duplicate by its seq). An own queue is declared, then registered with its key and
announced, before its first copy is sent.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, MutableMapping, Sequence

import redis

from keyq.broker.clock import now_ms
from keyq.broker.errors import BrokerUnavailable, KeysStopped
from keyq.broker.key_control import KeyControl, KeyStatus
from keyq.broker.locks import Lease
from keyq.broker.naming import (
    incarnation_name,
    is_aside_queue,
    is_bucket_queue,
)
from keyq.broker.registry import QueueRegistry
from keyq.broker.retirement import RetirementFence
from keyq.broker.routes import Route, RouteBook
from keyq.broker.streams import StreamConfig
from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.batch.admission import Admission, Disposition
from keyq.worker.batch.decoding import Decoder, Event, producer_of, seq_of
from keyq.worker.batch.key_gate import Routing
from keyq.worker.batch.ports import DeadLetterSink
from keyq.worker.batch.route_watch import Published, RouteWatch

log = logging.getLogger("keyq.worker.batch")


class AutoRouting:
    """Routes one auto-mode worker's attempts; used only by the batch loop's thread."""

    def __init__(
        self,
        *,
        client: redis.Redis,
        config: StreamConfig,
        registry: QueueRegistry,
        control: KeyControl,
        watch: RouteWatch,
        sink: DeadLetterSink,
        lease_ms: int,
    ) -> None:
        self._config = config
        self._book = RouteBook(client, config.stream)
        self._fence = RetirementFence(client, config.stream)
        self._registry = registry
        self._control = control
        self._watch = watch
        self._sink = sink
        self._lease_s = lease_ms / 1000
        self._registered: set[tuple[str, int]] = set()  # (own queue, epoch) registered
        self.promoted: Counter[str] = Counter()  # by why
        self.forwarded = 0  # events

    def prepare(
        self,
        deliveries: Sequence[Delivery],
        decoded: Decoder,
        statuses: MutableMapping[str, KeyStatus],
        leases: Mapping[str, Lease],
    ) -> tuple[Routing, dict[str, Route]]:
        """Promote the keys due (their statuses updated in place), lease the own queues of the
        promoted keys found in buckets, and say how to route this attempt and where to."""
        lease_queue = {queue: lease.queue for queue, lease in leases.items()}
        taken_ms = now_ms()
        published = self._published_in_buckets(deliveries, decoded, lease_queue, taken_ms)
        due = self._watch.due(published, statuses, time.monotonic(), taken_ms)
        if due:
            self._promote(due)
            statuses.update(self._control.statuses(due))
        routed = {
            key: route
            for key in published
            if (status := statuses.get(key)) is not None and (route := status.route) is not None
        }
        granted = self._fence.lease(sorted({route.queue for route in routed.values()}))
        # Being retired: its events wait in the bucket until the key is demoted.
        forwardable = {
            key: route for key, route in routed.items() if granted.get(route.queue) is not None
        }
        return Routing(self._config.stream, lease_queue, frozenset(forwardable)), forwardable

    def observe(self, admission: Admission, decoded: Decoder) -> None:
        """What the attempt came to, for later ones: its rate-limited keys."""
        limited = {
            key
            for delivery in admission.of(Disposition.RATE_LIMITED)
            if (key := decoded(delivery).key) is not None
        }
        if limited:
            self._watch.limited(limited, time.monotonic())

    def _published_in_buckets(
        self,
        deliveries: Sequence[Delivery],
        decoded: Decoder,
        lease_queue: Mapping[str, str],
        taken_ms: int,
    ) -> dict[str, list[Published]]:
        """Each key's events this attempt takes from a bucket (not drained aside), with their
        publish times: at most now (a producer's clock may run ahead), now if they do not say."""
        published: dict[str, list[Published]] = {}
        from_bucket: dict[str, bool] = {}  # by queue: a batch holds thousands of its events
        for delivery in deliveries:
            queue = delivery.queue
            bucket = from_bucket.get(queue)
            if bucket is None:
                bucket = from_bucket[queue] = self._from_bucket(queue, lease_queue)
            if not bucket:
                continue
            item = decoded(delivery)
            key = item.key
            if key is None:
                continue
            at = item.published_at_ms if isinstance(item, Event) else None
            at_ms = taken_ms if at is None else min(at, taken_ms)
            published.setdefault(key, []).append((item.producer, item.seq, at_ms))
        return published

    def _from_bucket(self, queue: str, lease_queue: Mapping[str, str]) -> bool:
        stream = self._config.stream
        held = lease_queue.get(queue, queue)
        return is_bucket_queue(stream, held) and not is_aside_queue(stream, queue)

    def _promote(self, due: Mapping[str, str]) -> None:
        config = self._config
        for key, why in due.items():
            route = self._book.promote(key, config.own_queue_for(key), config.queue_for(key), why)
            if route is not None and route.why == why and route.open:
                self.promoted[why] += 1
                log.info("promoted key %r to a queue of its own (%s)", key, why)

    def forward(self, forward: Mapping[str, list[Delivery]], routes: Mapping[str, Route]) -> None:
        """Copy each promoted key's events from its bucket to its own queue, confirmed, under a
        publish lease taken now, its route unchanged since the attempt read it. Raises
        ``KeysStopped`` when a route changed (the attempt runs again and sees it) and
        ``BrokerUnavailable`` when the copies were confirmed after the lease ran out."""
        if not forward:
            return
        started = time.monotonic()
        granted = self._fence.lease(sorted({routes[key].queue for key in forward}))
        current = self._book.routes(forward)  # read after the lease: see the module's note
        copies: list[tuple[str, str, Sequence[Delivery]]] = []
        for key, deliveries in forward.items():
            route, incarnation = routes[key], granted.get(routes[key].queue)
            now = current.get(key)
            if incarnation is None or now is None or now.epoch != route.epoch:
                raise KeysStopped(f"the route of key {key!r} changed while its batch ran")
            copies.append((incarnation_name(route.queue, incarnation), key, deliveries))
        new = {
            queue: key
            for queue, key, _ in copies
            if (queue, routes[key].epoch) not in self._registered
        }
        if new:
            self._sink.declare(list(new))
            self._registry.register(dict[str, str | None](new))
            self._registered.update((queue, routes[key].epoch) for queue, key in new.items())
        self._sink.forward(copies)
        if time.monotonic() > started + self._lease_s:
            raise BrokerUnavailable(
                f"events forwarded to {copies[0][0]} were confirmed after their lease ran out"
            )
        for _, key, sent in copies:
            self._book.note_forwarded(key, highest_seqs(sent))
        self.forwarded += sum(len(sent) for _, _, sent in copies)


def highest_seqs(deliveries: Sequence[Delivery]) -> dict[str, int]:
    """Per SDK producer, the highest seq among ``deliveries``: what producers switching the key
    to its own queue wait for (``keyq.producer.route_follow``)."""
    highest: dict[str, int] = {}
    for delivery in deliveries:
        producer, seq = producer_of(delivery), seq_of(delivery)
        if producer is not None and seq is not None and seq > highest.get(producer, 0):
            highest[producer] = seq
    return highest
