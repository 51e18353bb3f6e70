"""Which of a run's deliveries may be applied now, by what holds their keys back
(``keyq.broker.key_control``): a stopped key's events, and those of a key whose earlier events
still wait aside, are set aside; a side queue's are applied only while it is its key's head
and the key is not stopped. Under the ``park`` poison policy, a key's events after a poison
one (a payload that cannot be decoded) are set aside too, and the key is parked at it. Under
a rate limit, a key's events beyond its rate wait, unacked, for a later batch.

Pure: the statuses are read by the caller, once per run."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from keyq.broker.key_control import FLOWING, KeyStatus, ParkedKey
from keyq.worker.decoding import Undecodable, decode
from keyq.worker.deliveries import Delivery
from keyq.worker.rate_limits import KeyRateLimiter


@dataclass
class GateSorting:
    """A run's deliveries, sorted by what their keys allow."""

    through: list[Delivery] = field(default_factory=list)  # planned and applied as usual
    aside: dict[str, list[Delivery]] = field(default_factory=dict)  # key -> to set aside
    held: list[Delivery] = field(default_factory=list)  # a side queue's that may not apply now
    limited: list[Delivery] = field(default_factory=list)  # over their key's rate: wait
    parking: dict[str, ParkedKey] = field(default_factory=dict)  # keys to park, at what

    through_keys: list[str | None] = field(default_factory=list)  # the key of each through

    def let_through(self, delivery: Delivery, key: str | None) -> None:
        self.through.append(delivery)
        self.through_keys.append(key)

    @property
    def set_aside(self) -> list[Delivery]:
        return [delivery for found in self.aside.values() for delivery in found]


def key_of(delivery: Delivery, fallback_key: str | None) -> str | None:
    return decode(delivery, fallback_key).key


def sort_by_key_status(
    deliveries: Sequence[Delivery],
    fallback_keys: Mapping[str, str | None],
    statuses: Mapping[str, KeyStatus],
    *,
    is_side_queue: Callable[[str], bool],
    park_at_poison: bool,
    now_ms: int,
) -> GateSorting:
    """Sort ``deliveries`` (in delivery order) by their keys' ``statuses``."""
    sorting = GateSorting()
    parked_here: set[str] = set()
    for delivery in deliveries:
        decoded = decode(delivery, fallback_keys.get(delivery.queue))
        key = decoded.key
        if key is None:
            sorting.let_through(delivery, None)  # dead-lettered: it has no key to hold back
            continue
        status = statuses.get(key, FLOWING)
        if is_side_queue(delivery.queue):
            may_apply = not status.stopped and status.aside[:1] == (delivery.queue,)
            if may_apply and key not in parked_here:
                sorting.let_through(delivery, key)
                if park_at_poison and isinstance(decoded, Undecodable):
                    _park(sorting, parked_here, key, decoded, now_ms)
            else:
                sorting.held.append(delivery)
            continue
        if status.diverted or key in parked_here:
            sorting.aside.setdefault(key, []).append(delivery)
            continue
        sorting.let_through(delivery, key)
        if park_at_poison and isinstance(decoded, Undecodable):
            _park(sorting, parked_here, key, decoded, now_ms)
    return sorting


def limit_rates(sorting: GateSorting, limiter: KeyRateLimiter) -> None:
    """Hold back what would go through beyond each key's rate: a key's first events go, its
    later ones wait, in order."""
    counts: dict[str, int] = {}
    for key in sorting.through_keys:
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    allowed = {key: limiter.take(key, count) for key, count in counts.items()}
    through, through_keys = sorting.through, sorting.through_keys
    sorting.through, sorting.through_keys = [], []
    for delivery, key in zip(through, through_keys, strict=True):
        if key is None or allowed[key] > 0:
            if key is not None:
                allowed[key] -= 1
            sorting.let_through(delivery, key)
        else:
            sorting.limited.append(delivery)


def _park(
    sorting: GateSorting, parked_here: set[str], key: str, poison: Undecodable, now_ms: int
) -> None:
    parked_here.add(key)
    sorting.parking[key] = ParkedKey(
        at_ms=now_ms, reason=poison.reason, producer=poison.producer, seq=poison.seq
    )
