"""Which of a run's deliveries may be applied now, by what holds their keys back
(``keyq.broker.key_control``): a stopped key's events, and those of a key whose earlier events
still wait aside, are set aside; an aside queue's are applied only while it is its key's head
and the key is not stopped. Under the ``park`` poison policy, a key's events after a poison
one (a payload that cannot be decoded) are set aside too, and the key is parked at it.

Pure: the statuses are read by the caller, once per run."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from keyq.broker.key_control import FLOWING, KeyStatus, ParkedKey
from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.batch.decoding import Decoder, Item, Undecodable


@dataclass
class GateSorting:
    """A run's deliveries, sorted by what their keys allow."""

    through: list[Delivery] = field(default_factory=list)  # planned and applied as usual
    aside: dict[str, list[Delivery]] = field(default_factory=dict)  # key -> to set aside
    hand_back: list[Delivery] = field(default_factory=list)  # an aside queue's, not to apply now
    parking: dict[str, ParkedKey] = field(default_factory=dict)  # keys to park, at what

    through_keys: list[str | None] = field(default_factory=list)  # the key of each through

    def let_through(self, delivery: Delivery, key: str | None) -> None:
        self.through.append(delivery)
        self.through_keys.append(key)

    @property
    def set_aside(self) -> list[Delivery]:
        return [delivery for found in self.aside.values() for delivery in found]


def sort_by_key_status(
    deliveries: Sequence[Delivery],
    decoded: Decoder,
    statuses: Mapping[str, KeyStatus],
    *,
    is_aside_queue: Callable[[str], bool],
    park_at_poison: bool,
    now_ms: int,
) -> GateSorting:
    """Sort ``deliveries`` (in delivery order) by their keys' ``statuses``."""
    items = [decoded(d) for d in deliveries]
    sorting = GateSorting()

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
        poison = poisons.get(key)
        stops_here = poison is not None and _after(item, index, items[poison], poison)
        if may_apply(delivery, key) and not stops_here:
            sorting.let_through(delivery, key)
        elif is_aside_queue(delivery.queue):
            sorting.hand_back.append(delivery)  # never to the tail: it would pass its successors
        else:
            sorting.aside.setdefault(key, []).append(delivery)
    return sorting


def _after(item: Item, index: int, poison: Item, poison_index: int) -> bool:
    """Whether ``item`` comes after its key's ``poison`` in the key's order: by seq for the
    poison's producer (the order events apply in), by delivery order for the others."""
    if index == poison_index:
        return False
    same_producer = item.producer is not None and item.producer == poison.producer
    if same_producer and item.seq is not None and poison.seq is not None:
        return item.seq > poison.seq
    return index > poison_index
