"""The demo order pipeline: each order's events folded, exactly once, into the order's state.

Run it with ``keyq worker --stream orders --pipeline keyq.demo.orders:pipeline``. An order goes
``new -> created -> paid -> shipped``, and may be cancelled while created or paid; items are
added and removed only while it is ``created``. An event that does not fit the order's status
(an item added after payment, shipping before payment, removing more than the cart holds) is
a fact about the business, not a fault: it is counted in ``rejected`` and changes nothing
else, so a replay always gives the same state. An event that is not an order event at all
(unknown or missing ``type``, a malformed item) raises ``ValueError``: no retry can fix it,
so the worker dead-letters it with the reason.

Money is integer cents throughout: totals must add up exactly, and floats do not. Spark's
Python workers import this module to run the reducer, so it imports nothing heavy.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple, TypedDict

if TYPE_CHECKING:
    from keyq.worker.pipeline import BatchContext

Status = Literal["new", "created", "paid", "cancelled", "shipped"]
Event = dict[str, Any]

EVENT_TYPES: Final = ("created", "item_added", "item_removed", "paid", "cancelled", "shipped")
ITEM_EVENTS: Final = ("item_added", "item_removed")
# Each state is stored as JSON by orjson, which refuses integers beyond 64 bits.
MAX_INT64: Final = 2**63 - 1


class OrderState(TypedDict):
    """One order's state, as stored (JSON) in Redis and written to the sink."""

    status: Status
    total_cents: int
    item_count: int  # the sum of the quantities in ``items``
    items: dict[str, int]  # sku -> quantity, only quantities > 0
    events_applied: int  # every event folded in, rejected ones included
    rejected: int  # events that did not fit the order's status at the time


class _Line(NamedTuple):
    sku: str
    qty: int
    price_cents: int


def new_order_state() -> OrderState:
    """The state before the first event: an order nobody has created yet."""
    return {
        "status": "new",
        "total_cents": 0,
        "item_count": 0,
        "items": {},
        "events_applied": 0,
        "rejected": 0,
    }


# --------------------------------------------------------------------------- the reducer


def apply_order_event(state: OrderState | None, event: Mapping[str, Any]) -> OrderState:
    """Fold one event into an order's state (None: no event yet); returns a new state.

    Pure and deterministic, and it never modifies ``state``: the worker may fold a batch
    again after a failed attempt, and must get the same result.
    """
    kind = _event_type(event)
    line = _line(event, kind) if kind in ITEM_EVENTS else None
    before = new_order_state() if state is None else state
    accepted = _transition(before, kind, line)
    after = accepted if accepted is not None else _copy(before)
    if accepted is None:
        after["rejected"] += 1
    after["events_applied"] += 1
    return after


def _event_type(event: object) -> str:
    if not isinstance(event, Mapping):
        raise ValueError(f"an order event must be a JSON object, not {type(event).__name__}")
    kind = event.get("type")
    if kind is None:
        raise ValueError("order event has no 'type'")
    if not isinstance(kind, str) or kind not in EVENT_TYPES:
        raise ValueError(
            f"unknown order event type {kind!r}; expected one of {', '.join(EVENT_TYPES)}"
        )
    order = event.get("order")
    if not isinstance(order, str) or not order:
        raise ValueError(f"{kind} event: 'order' must be a non-empty string, got {order!r}")
    return kind


def _line(event: Mapping[str, Any], kind: str) -> _Line:
    sku = event.get("sku")
    if not isinstance(sku, str) or not sku:
        raise ValueError(f"{kind} event: 'sku' must be a non-empty string, got {sku!r}")
    return _Line(sku, _whole(event, kind, "qty", 1), _whole(event, kind, "price_cents", 0))


def _whole(event: Mapping[str, Any], kind: str, name: str, minimum: int) -> int:
    value = event.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{kind} event: {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _copy(state: OrderState) -> OrderState:
    copied = state.copy()
    copied["items"] = dict(state["items"])
    return copied


def _with_status(state: OrderState, status: Status) -> OrderState:
    changed = _copy(state)
    changed["status"] = status
    return changed


def _transition(state: OrderState, kind: str, line: _Line | None) -> OrderState | None:
    """The state after an accepted event, or None if the event does not fit the status."""
    status = state["status"]
    if line is not None:
        if status != "created":
            return None
        return _add(state, line) if kind == "item_added" else _remove(state, line)
    if kind == "created" and status == "new":
        return _with_status(state, "created")
    if kind == "paid" and status == "created" and state["item_count"] > 0:
        return _with_status(state, "paid")  # an empty cart cannot be paid
    if kind == "cancelled" and status in ("created", "paid"):
        return _with_status(state, "cancelled")  # after payment: a refund
    if kind == "shipped" and status == "paid":
        return _with_status(state, "shipped")
    return None


def _add(state: OrderState, line: _Line) -> OrderState | None:
    total = state["total_cents"] + line.qty * line.price_cents
    count = state["item_count"] + line.qty
    if total > MAX_INT64 or count > MAX_INT64:
        return None  # the state could no longer be stored
    added = _copy(state)
    added["items"][line.sku] = added["items"].get(line.sku, 0) + line.qty
    added["total_cents"] = total
    added["item_count"] = count
    return added


def _remove(state: OrderState, line: _Line) -> OrderState | None:
    """A removal names the unit price it takes off the total (the price it was added at)."""
    held = state["items"].get(line.sku, 0)
    total = state["total_cents"] - line.qty * line.price_cents
    if line.qty > held or total < 0:
        return None
    removed = _copy(state)
    if held == line.qty:
        del removed["items"][line.sku]
    else:
        removed["items"][line.sku] = held - line.qty
    removed["total_cents"] = total
    removed["item_count"] -= line.qty
    return removed


# --------------------------------------------------------------------------- the pipeline


def pipeline(df: Any, ctx: BatchContext) -> Any:
    """The worker's pipeline: rows ``key, state, applied`` per order, for the sink."""
    return ctx.state.fold(df, apply_order_event)


def expected_states(pairs: Iterable[tuple[str, Mapping[str, Any]]]) -> dict[str, OrderState]:
    """What the workers must end with: each key's events folded in publish order, in plain
    Python. An event the reducer refuses is skipped, as the worker dead-letters it."""
    states: dict[str, OrderState] = {}
    for key, event in pairs:
        try:
            states[key] = apply_order_event(states.get(key), event)
        except ValueError:
            continue
    return states


# --------------------------------------------------------------------------- demo traffic

_CATALOGUE_SIZE: Final = 40
_ZIPF_EXPONENT: Final = 1.1
_INVALID_SHARE: Final = 0.03
_REMOVE_SHARE: Final = 0.2
_QUANTITIES: Final = (1, 1, 1, 1, 2, 2, 3, 5)


def generate_orders(orders: int, events: int, seed: int) -> list[tuple[str, Event]]:
    """A realistic, deterministic stream of ``events`` events over ``orders`` orders, as
    ``(order_id, event)`` pairs in publish order.

    Events per order follow Zipf-like weights (a few orders are much hotter than the rest),
    each order follows a sensible lifecycle (created, items added and sometimes removed,
    then maybe paid and shipped or cancelled) within its own window of time, orders overlap,
    and about 3% of events are invalid for the order's status at that point.
    """
    if orders < 1 or events < orders:
        raise ValueError(f"need 1 <= orders <= events, got orders={orders} events={events}")
    rng = random.Random(seed)
    catalogue = {f"sku-{n:03d}": rng.randrange(99, 20_000) for n in range(1, _CATALOGUE_SIZE + 1)}
    ids = [f"order-{n:05d}" for n in range(1, orders + 1)]
    ranks = list(range(1, orders + 1))
    rng.shuffle(ranks)  # the hot orders are anywhere among the ids
    weights = [rank**-_ZIPF_EXPONENT for rank in ranks]
    counts = [1] * orders
    for index in rng.choices(range(orders), weights, k=events - orders):
        counts[index] += 1

    timeline: list[tuple[float, int, int, Event]] = []
    for index, (order_id, count) in enumerate(zip(ids, counts, strict=True)):
        lifecycle = _lifecycle(rng, order_id, count, catalogue)
        start = rng.random() * 0.8
        span = 0.1 + rng.random() * 0.5
        times = sorted(start + span * rng.random() for _ in lifecycle)
        timeline.extend(
            (at, index, position, event)
            for position, (at, event) in enumerate(zip(times, lifecycle, strict=True))
        )
    timeline.sort(key=lambda entry: entry[:3])
    return [(ids[index], event) for _, index, _, event in timeline]


def _lifecycle(
    rng: random.Random, order_id: str, count: int, catalogue: Mapping[str, int]
) -> list[Event]:
    """One order's ``count`` events: a valid plan with invalid events slipped in."""
    invalid_slots = {slot for slot in range(1, count) if rng.random() < _INVALID_SHARE}
    plan = iter(_valid_plan(rng, order_id, count - len(invalid_slots), catalogue))
    state = new_order_state()
    lifecycle: list[Event] = []
    for slot in range(count):
        invalid = slot in invalid_slots
        event = _invalid_event(rng, order_id, state, catalogue) if invalid else next(plan)
        after = apply_order_event(state, event)
        if (after["rejected"] > state["rejected"]) != invalid:
            raise RuntimeError(f"generator bug: {event} on {state} (invalid={invalid})")
        state = after
        lifecycle.append(event)
    return lifecycle


def _valid_plan(
    rng: random.Random, order_id: str, length: int, catalogue: Mapping[str, int]
) -> list[Event]:
    plan: list[Event] = [{"type": "created", "order": order_id}]
    if length == 1:
        return plan
    roll = rng.random()
    ending: list[str]
    if roll < 0.55:
        ending = ["paid", "shipped"]
    elif roll < 0.65:
        ending = ["cancelled"]
    elif roll < 0.72:
        ending = ["paid", "cancelled"]
    elif roll < 0.82:
        ending = ["paid"]
    else:
        ending = []  # still open
    if "paid" in ending and length - 1 - len(ending) < 1:
        ending = ["cancelled"]  # no room for an item to pay for
    cart: dict[str, int] = {}
    skus = sorted(catalogue)
    for _ in range(length - 1 - len(ending)):
        removable = sum(cart.values()) - 1  # a cart never empties, so it can still be paid
        if removable > 0 and rng.random() < _REMOVE_SHARE:
            sku = rng.choice(sorted(cart))
            qty = rng.randint(1, min(cart[sku], removable))
            cart[sku] -= qty
            if not cart[sku]:
                del cart[sku]
            plan.append(_item("item_removed", order_id, sku, qty, catalogue))
        else:
            sku = rng.choice(skus)
            qty = rng.choice(_QUANTITIES)
            cart[sku] = cart.get(sku, 0) + qty
            plan.append(_item("item_added", order_id, sku, qty, catalogue))
    plan.extend({"type": kind, "order": order_id} for kind in ending)
    return plan


def _invalid_event(
    rng: random.Random, order_id: str, state: OrderState, catalogue: Mapping[str, int]
) -> Event:
    """An event the order's current status rejects, of the kinds real clients send: a
    retried ``created``, shipping before payment, a stale removal, changes after payment."""
    sku = rng.choice(sorted(catalogue))
    status = state["status"]
    candidates: list[Event]
    if status == "created":
        too_many = state["items"].get(sku, 0) + 1
        candidates = [
            {"type": "created", "order": order_id},
            {"type": "shipped", "order": order_id},
            _item("item_removed", order_id, sku, too_many, catalogue),
        ]
    elif status == "paid":
        candidates = [
            {"type": "created", "order": order_id},
            {"type": "paid", "order": order_id},
            _item("item_added", order_id, sku, 1, catalogue),
            _item("item_removed", order_id, sku, 1, catalogue),
        ]
    else:
        kinds = ["paid", "shipped", "cancelled"] + ([] if status == "new" else ["created"])
        candidates = [{"type": kind, "order": order_id} for kind in kinds]
        candidates.append(_item("item_added", order_id, sku, 1, catalogue))
    return rng.choice(candidates)


def _item(kind: str, order_id: str, sku: str, qty: int, catalogue: Mapping[str, int]) -> Event:
    return {"type": kind, "order": order_id, "sku": sku, "qty": qty, "price_cents": catalogue[sku]}
