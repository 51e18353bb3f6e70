"""The quickstart's order pipeline, before and after a fix.

``v1`` folds order events with ``keyq.demo.orders.apply_order_event``, which refuses an item event
without a ``qty``: such an event is poison, dead-lettered (and, under the ``park`` policy, its
key stops). ``v2`` is the fix: an item without a quantity is one item. Redriving the key after
deploying ``v2`` applies the parked event and everything that waited behind it, in order.

Run from the checkout's root: ``keyq worker --stream orders --pipeline
examples.quickstart.pipeline:v1`` (the worker finds modules in its working directory).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from keyq.demo.orders import ITEM_EVENTS, OrderState, apply_order_event

if TYPE_CHECKING:
    from keyq.worker.pipeline import BatchContext


def v1(df: Any, ctx: BatchContext) -> Any:
    """Every item event must say how many: one without ``qty`` is dead-lettered."""
    return ctx.state.fold(df, apply_order_event)


def one_by_default(state: OrderState | None, event: Mapping[str, Any]) -> OrderState:
    """The fixed reducer: an item event without ``qty`` adds or removes one."""
    if event.get("type") in ITEM_EVENTS and "qty" not in event:
        event = {**event, "qty": 1}
    return apply_order_event(state, event)


def v2(df: Any, ctx: BatchContext) -> Any:
    """``v1`` fixed: what it dead-lettered for a missing quantity now applies."""
    return ctx.state.fold(df, one_by_default)
