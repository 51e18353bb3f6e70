"""What one attempt at a group of deliveries will do, decided before anything runs: decode
them, sequence them against the committed marks, and sort them into the events to apply,
the messages to dead-letter, what waits for an earlier seq and what gets settled.

Pure: the marks and the clock are passed in."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.batch.decoding import Decoder, Event, Item, Undecodable
from keyq.worker.batch.marks import KeyMarks
from keyq.worker.batch.sequencing import Identified, Plan, plan_batch


@dataclass(frozen=True)
class RunPlan:
    """One attempt's deliveries, sorted by what becomes of them."""

    keys: list[str]  # the keys of the run, in first-seen order
    plan: Plan  # indexes into ``ordered``
    ordered: list[Item]  # the keyed items, in arrival order
    events: list[Event]  # to apply, in the order to apply them
    letters: list[Undecodable]  # to dead-letter, in delivery order
    deferred: list[Delivery]  # behind an open gap: not settled now
    settling: list[Delivery]  # everything else: acked once committed


def plan_run(
    deliveries: Sequence[Delivery],
    decoded: Decoder,
    marks: Mapping[str, KeyMarks],
    *,
    now: float,
    gap_timeout_s: float,
    dead: str | None = None,
) -> RunPlan:
    """Plan a run of ``deliveries`` (in delivery order), each as ``decoded`` reads it,
    against the committed ``marks`` of its keys; ``dead``, when given, dead-letters every
    event with that reason."""
    events, letters = decode_all(deliveries, decoded, dead)
    identities, ordered = identify(arrival_order(deliveries, [*events, *letters]))
    keys = list(dict.fromkeys(identity.key for identity in identities))
    plan = plan_batch(identities, marks, now=now, gap_timeout_s=gap_timeout_s)
    return _sort(deliveries, letters, ordered, plan, keys)


def decode_all(
    deliveries: Iterable[Delivery], decoded: Decoder, dead: str | None
) -> tuple[list[Event], list[Undecodable]]:
    """Decode each delivery; with ``dead``, what decodes is dead-lettered all the same."""
    events: list[Event] = []
    letters: list[Undecodable] = []
    for delivery in deliveries:
        item = decoded(delivery)
        if dead is not None and isinstance(item, Event):
            item = Undecodable(delivery, dead, item.key, item.producer, item.seq)
        if isinstance(item, Event):
            events.append(item)
        else:
            letters.append(item)
    return events, letters


def arrival_order(deliveries: Sequence[Delivery], items: Iterable[Item]) -> list[Item]:
    """``items`` in the order of the deliveries they were decoded from."""
    by_delivery: dict[int, Item] = {id(item.delivery): item for item in items}
    return [by_delivery[id(d)] for d in deliveries]


def identify(items: Iterable[Item]) -> tuple[list[Identified], list[Item]]:
    """The identities sequencing needs, and the items they stand for; an item without a
    key has nothing to mark and is left out (it is dead-lettered)."""
    identities: list[Identified] = []
    keyed: list[Item] = []
    for item in items:
        if item.key is None:
            continue
        identities.append(
            Identified(
                item.key,
                item.producer,
                item.seq,
                counts=isinstance(item, Event),
                deferred_since=item.delivery.deferred_since,
                redrive_id=item.redrive_id,
            )
        )
        keyed.append(item)
    return identities, keyed


def late(item: Item) -> Undecodable:
    """An event that came after the worker gave up waiting for it: applying it now would
    break its key's order, and it is not a duplicate, so it is dead-lettered."""
    return Undecodable(
        item.delivery,
        f"late: seq {item.seq} of producer {item.producer} arrived after the worker gave up "
        "waiting for it (its successors were applied)",
        item.key,
        item.producer,
        item.seq,
    )


def _sort(
    deliveries: Sequence[Delivery],
    letters: Sequence[Undecodable],
    ordered: list[Item],
    plan: Plan,
    keys: list[str],
) -> RunPlan:
    in_order = [ordered[index] for index in plan.apply]
    fresh_letters = [letter for letter in letters if letter.key is None]
    fresh_letters += [item for item in in_order if isinstance(item, Undecodable)]
    fresh_letters += [late(ordered[index]) for index in plan.late]
    position = {id(delivery): index for index, delivery in enumerate(deliveries)}
    fresh_letters.sort(key=lambda letter: position[id(letter.delivery)])  # as delivered
    deferred = [ordered[index].delivery for index in plan.deferred]
    deferred_ids = {id(delivery) for delivery in deferred}
    return RunPlan(
        keys=keys,
        plan=plan,
        ordered=ordered,
        events=[item for item in in_order if isinstance(item, Event)],
        letters=fresh_letters,
        deferred=deferred,
        settling=[d for d in deliveries if id(d) not in deferred_ids],
    )
