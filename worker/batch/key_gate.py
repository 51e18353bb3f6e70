"""Which of a run's deliveries may be applied now, by what holds their keys back
(``keyq.broker.key_control``): a stopped key's events, and those of a key whose earlier events
still wait aside, are set aside; an aside queue's are applied only while it is its key's head
and the key is not stopped. Under the ``park`` poison policy, a key's events after a poison
one (a payload that cannot be decoded) are set aside too, and the key is parked at it.

In auto mode a promoted key's events are routed first (``keyq.broker.routes``): its bucket's
holder forwards them to the key's own queue, and hands back what it drained aside of the key;
its own queue's holder keeps them waiting (moving) until the move is closed; after that the
rules above apply there.

Pure: the statuses are read by the caller, once per run."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from keyq.broker.key_control import FLOWING, KeyStatus, ParkedKey
from keyq.broker.naming import base_queue_name, is_bucket_queue
from keyq.broker.routes import Route
from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.batch.decoding import Decoder, Item, Undecodable


@dataclass
class GateSorting:
    """A run's deliveries, sorted by what their keys allow."""

    through: list[Delivery] = field(default_factory=list)  # planned and applied as usual
    aside: dict[str, list[Delivery]] = field(default_factory=dict)  # key -> to set aside
    hand_back: list[Delivery] = field(default_factory=list)  # an aside queue's, not to apply now
    parking: dict[str, ParkedKey] = field(default_factory=dict)  # keys to park, at what
    forward: dict[str, list[Delivery]] = field(default_factory=dict)  # key -> to its own queue
    moving: list[Delivery] = field(default_factory=list)  # its key's move is not closed
    stale: list[Delivery] = field(default_factory=list)  # copies no route names: settled

    through_keys: list[str | None] = field(default_factory=list)  # the key of each through

    def let_through(self, delivery: Delivery, key: str | None) -> None:
        self.through.append(delivery)
        self.through_keys.append(key)

    def route(self, delivery: Delivery, key: str, way: Way | None) -> None:
        if way is Way.FORWARD:
            self.forward.setdefault(key, []).append(delivery)
        elif way is Way.MOVING:
            self.moving.append(delivery)
        elif way is Way.HAND_BACK:
            self.hand_back.append(delivery)
        elif way is Way.STALE:
            self.stale.append(delivery)

    @property
    def set_aside(self) -> list[Delivery]:
        return [delivery for found in self.aside.values() for delivery in found]


class Way(enum.Enum):
    """Where auto mode's routes send a delivery, before the other rules."""

    FORWARD = "forward"
    MOVING = "moving"
    HAND_BACK = "hand back"
    STALE = "stale"  # a copy no route names: its original is still in the bucket


@dataclass(frozen=True)
class Routing:
    """What routing needs of an auto-mode attempt."""

    stream: str
    lease_queue: Mapping[str, str]  # a delivery's queue -> the held queue whose lease covers it
    forwardable: frozenset[str]  # promoted keys whose own queue may be published to now
    # Whether a delivery's queue is held under a bucket's lease, by queue: asked per delivery.
    _bucket_held: dict[str, bool] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def way(self, delivery: Delivery, key: str, route: Route | None, aside: bool) -> Way | None:
        """Where ``delivery`` of ``key`` goes; None: by the other rules."""
        queue = delivery.queue
        holder = self.lease_queue.get(queue, queue)
        bucket = self._bucket_held.get(queue)
        if bucket is None:
            bucket = self._bucket_held[queue] = is_bucket_queue(self.stream, holder)
        if bucket:
            if route is None:
                return None  # in its bucket: applied there
            if aside:
                return Way.HAND_BACK  # only its own queue's holder drains it now
            return Way.FORWARD if key in self.forwardable else Way.MOVING
        if aside:
            closed = route is not None and not route.open
            return None if closed else Way.HAND_BACK  # drained once the move is closed
        if route is None or base_queue_name(holder) != route.queue:
            # A copy whose forward did not count (confirmed after its lease, or its attempt
            # failed after it): the key was demoted, so its own queue was deleted empty, and
            # this copy's original was never acked in the bucket, where it is applied.
            return Way.STALE
        return Way.MOVING if route.open else None


def sort_by_key_status(
    deliveries: Sequence[Delivery],
    decoded: Decoder,
    statuses: Mapping[str, KeyStatus],
    *,
    is_aside_queue: Callable[[str], bool],
    park_at_poison: bool,
    now_ms: int,
    routing: Routing | None = None,
) -> GateSorting:
    """Sort ``deliveries`` (in delivery order) by their keys' ``statuses``."""
    items = [decoded(d) for d in deliveries]
    sorting = GateSorting()
    ways = _ways(deliveries, items, statuses, routing, is_aside_queue)

    def may_apply(delivery: Delivery, key: str) -> bool:
        status = statuses.get(key, FLOWING)
        if is_aside_queue(delivery.queue):
            return not status.stopped and status.aside[:1] == (delivery.queue,)
        return not status.diverted

    poisons: dict[str, int] = {}  # key -> the index of the poison it parks at
    if park_at_poison:
        for index, item in enumerate(items):
            key = item.key
            if key is None or key in poisons or not isinstance(item, Undecodable):
                continue
            if ways[index] is not None:
                continue
            if may_apply(deliveries[index], key):
                poisons[key] = index
                sorting.parking[key] = ParkedKey(
                    at_ms=now_ms, reason=item.reason, producer=item.producer, seq=item.seq
                )
    for index, (delivery, item) in enumerate(zip(deliveries, items, strict=True)):
        key = item.key
        if key is None:
            sorting.let_through(delivery, None)  # dead-lettered: it has no key to hold back
            continue
        if ways[index] is not None:
            sorting.route(delivery, key, ways[index])
            continue
        poison = poisons.get(key)
        stops_here = poison is not None and _after(item, index, items[poison], poison)
        if may_apply(delivery, key) and not stops_here:
            sorting.let_through(delivery, key)
        elif is_aside_queue(delivery.queue):
            sorting.hand_back.append(delivery)  # never to the tail: it would pass its successors
        else:
            sorting.aside.setdefault(key, []).append(delivery)
    return sorting


def _ways(
    deliveries: Sequence[Delivery],
    items: Sequence[Item],
    statuses: Mapping[str, KeyStatus],
    routing: Routing | None,
    is_aside_queue: Callable[[str], bool],
) -> list[Way | None]:
    """Where auto mode's routes send each delivery (None everywhere in other modes)."""
    if routing is None:
        return [None] * len(deliveries)
    return [
        None
        if item.key is None
        else routing.way(
            delivery,
            item.key,
            statuses.get(item.key, FLOWING).route,
            is_aside_queue(delivery.queue),
        )
        for delivery, item in zip(deliveries, items, strict=True)
    ]


def _after(item: Item, index: int, poison: Item, poison_index: int) -> bool:
    """Whether ``item`` comes after its key's ``poison`` in the key's order: by seq for the
    poison's producer (the order events apply in), by delivery order for the others."""
    if index == poison_index:
        return False
    same_producer = item.producer is not None and item.producer == poison.producer
    if same_producer and item.seq is not None and poison.seq is not None:
        return item.seq > poison.seq
    return index > poison_index
