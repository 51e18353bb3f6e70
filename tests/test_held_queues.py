"""HeldQueues, HandBacks, the starvation watch and aside drains as units: the order each ending
of a holding follows. Services are stand-ins that record calls; worker tests use the real ones."""

from __future__ import annotations

import queue as queue_module
import time
from collections.abc import Sequence
from typing import Any, cast

import pytest

from keyq.broker.errors import BrokerUnavailable
from keyq.broker.key_control import KeyControl
from keyq.broker.locks import FencedLocks, Lease
from keyq.broker.registry import QueueRegistry
from keyq.worker.amqp.consume_rounds import Consumed, ConsumeOutcome
from keyq.worker.amqp.dead_letters import DeadLetterCalls
from keyq.worker.amqp.deliveries import DeliveryBuffer
from keyq.worker.amqp.link import ConsumerCalls, ConsumerLink, QueueCounter
from keyq.worker.amqp.queue_channels import ConsumerGone
from keyq.worker.amqp.starvation import StarvedQueues
from keyq.worker.batch.outcome import BatchOutcome
from keyq.worker.holding import refused_claims
from keyq.worker.holding.aside_drains import AsideDrains
from keyq.worker.holding.handbacks import RELEASE_COOLDOWN_S, HandBacks
from keyq.worker.holding.held_index import Held
from keyq.worker.holding.held_queues import MAX_PREFETCH, HeldQueues, QueueEvents
from tests.helpers import plain_delivery


class Journal:
    def __init__(self) -> None:
        self.entries: list[tuple[str, ...]] = []

    def note(self, *entry: str) -> None:
        self.entries.append(entry)


class StandInLink:
    """The link and its parts at once: consumers, counts, node and moves."""

    def __init__(self, journal: Journal, outcomes: dict[str, ConsumeOutcome] | None = None):
        self.journal = journal
        self.prefetch = 10
        self.outcomes = outcomes or {}
        self.epochs = iter(range(1, 1000))
        self.held_at_consume: list[bool] = []
        self.held: HeldQueues | None = None
        self.closings: list[list[str]] = []  # the queues of each close_queues call
        self.ready: dict[str, int] = {}  # what a look into a queue finds ready
        self.node = "127.0.0.1:5672"
        self.moves: list[str] = []
        self.reconnects = 0
        self.single_node = False
        self.looks_fail = False
        self.unacked: dict[str, int] = {}

    def message_count(self, queue: str) -> int:
        self.journal.note("look", queue)
        return self.ready.get(queue, 0)

    def unacked_of(self, queue: str) -> int | None:
        return self.unacked.get(queue, 0)

    def message_counts(self, queues: Sequence[str]) -> dict[str, int]:
        for queue in queues:
            self.journal.note("look", queue)
        if self.looks_fail:
            raise BrokerUnavailable("not connected to RabbitMQ")
        return {queue: self.ready.get(queue, 0) for queue in queues}

    def move(self, reason: str) -> None:
        self.journal.note("move", reason)
        self.moves.append(reason)

    def new_epoch(self) -> int:
        return next(self.epochs)

    def consume_many(self, claims: Sequence[tuple[str, int]], *, budget_s: float) -> list[Consumed]:
        results = []
        for queue, epoch in claims:
            assert self.held is not None
            self.held_at_consume.append(queue in self.held)
            self.journal.note("consume", queue, str(epoch))
            results.append(Consumed(self.outcomes.get(queue, ConsumeOutcome.CONSUMING), epoch))
        return results

    def consume(self, queue: str, epoch: int, prefetch: int | None = None) -> Consumed:
        self.journal.note("consume", queue, str(epoch), str(prefetch))
        if self.looks_fail:
            raise BrokerUnavailable("not connected to RabbitMQ")
        return Consumed(self.outcomes.get(queue, ConsumeOutcome.CONSUMING), epoch)

    def close_queue(self, queue: str, epoch: int | None = None) -> None:
        self.close_queues([(queue, epoch)])

    def close_queues(self, queues: Sequence[tuple[str, int | None]]) -> None:
        self.closings.append([queue for queue, _epoch in queues])
        for queue, epoch in queues:
            self.journal.note("close", queue, str(epoch))


class StandInLocks:
    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.calls: list[list[str]] = []

    def release(self, leases: Sequence[Lease]) -> int:
        if leases:
            self.calls.append([lease.queue for lease in leases])
            self.journal.note("release", *(lease.queue for lease in leases))
        return len(leases)


class StandInRegistry:
    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def register(self, queues: dict[str, str | None]) -> None:
        self.journal.note("register", *queues)


class RecordingBuffer(DeliveryBuffer):
    def __init__(self, journal: Journal) -> None:
        super().__init__()
        self.journal = journal

    def drop(
        self, queue: str, channel_epoch: int | None = None, *, keep_waits: bool = False
    ) -> int:
        self.journal.note("drop", queue, str(channel_epoch), "keep" if keep_waits else "")
        return super().drop(queue, channel_epoch, keep_waits=keep_waits)


class Parts:
    def __init__(self, link: StandInLink, locks: StandInLocks, events: QueueEvents) -> None:
        self.link, self.locks, self._events = link, locks, events
        self.gone: queue_module.SimpleQueue[ConsumerGone] = queue_module.SimpleQueue()
        self._reports: list[tuple[str, list[str], str]] = []
        self.starved: StarvedQueues
        self.drains: AsideDrains

    @property
    def reports(self) -> list[tuple[str, list[str], str]]:
        while not self._events.empty():
            self._reports.append(self._events.get_nowait())
        return self._reports


def make(
    *claimed: Lease,
    outcomes: dict[str, ConsumeOutcome] | None = None,
    queue_type: str = "classic",
    ready: dict[str, int] | None = None,
) -> tuple[HeldQueues, Journal, Parts]:
    """Stand-ins wired as a worker wires the real parts, ``claimed`` already held; ``ready``:
    what a look into each queue finds."""
    journal = Journal()
    link = StandInLink(journal, outcomes)
    link.ready = ready or {}
    parts = Parts(link, StandInLocks(journal), queue_module.SimpleQueue())
    buffer = RecordingBuffer(journal)
    parts.starved = StarvedQueues(
        link=cast(ConsumerLink, link),
        consumers=cast(ConsumerCalls, link),
        counts=cast(QueueCounter, link),
        buffer=buffer,
        queue_type=queue_type,
    )
    parts.drains = AsideDrains(
        control=cast(KeyControl, None),
        consumers=cast(ConsumerCalls, link),
        counts=cast(QueueCounter, link),
        dead_letters=cast(DeadLetterCalls, None),
        buffer=buffer,
        queue_of_key=lambda key, status: key,
    )
    held = HeldQueues(
        consumers=cast(ConsumerCalls, link),
        gone=parts.gone,
        buffer=buffer,
        locks=cast(FencedLocks, parts.locks),
        registry=cast(QueueRegistry, StandInRegistry(journal)),
        events=parts._events,
        aside=parts.drains,
        observers=[parts.starved],
    )
    link.held = held
    if claimed:
        held.claim(list(claimed), budget_s=1.0)
    return held, journal, parts


def lease(queue: str, token: int = 1) -> Lease:
    return Lease(queue=queue, owner="me", token=token)


def test_a_claimed_queue_is_held_before_its_consumer_opens_and_refusals_let_locks_go() -> None:
    held, _journal, parts = make(outcomes={"q-busy": ConsumeOutcome.BUSY})
    outcomes = held.claim([lease("q-a"), lease("q-busy")], budget_s=1.0)
    assert parts.link.held_at_consume == [True, True]
    assert [o.held is not None for o in outcomes] == [True, False]
    assert held.queues() == ["q-a"]
    assert parts.locks.calls == [["q-busy"]]
    assert parts.reports == [("assigned", ["q-a"], "claimed")]


def test_losing_a_lock_fences_then_closes_then_drops_and_never_releases() -> None:
    held, journal, parts = make(lease("q-a"))
    journal.entries.clear()
    held.lose(lease("q-a"), "lock lost")
    assert "q-a" not in held
    assert [entry[0] for entry in journal.entries] == ["close", "drop", "register"]
    assert parts.locks.calls == []  # not ours any more: never released by us
    assert held.lost == 1
    assert parts.reports[-1] == ("revoked", ["q-a"], "lock lost")
    # A lost lease of an older holding leaves the newer one alone.
    held.claim([lease("q-a", token=2)], budget_s=1.0)
    held.lose(lease("q-a", token=1), "commit refused")
    assert "q-a" in held and held.lost == 1


def test_consumers_the_broker_took_away_are_queued_and_ended_when_settled() -> None:
    held, journal, parts = make(*(lease(f"q-{n}") for n in range(3)))
    journal.entries.clear()
    stale = held.get("q-0")
    assert stale is not None
    parts.gone.put(ConsumerGone("q-0", stale.epoch + 100, "channel closed"))
    assert held.settle_gone() == 0 and "q-0" in held, "a stale loss is ignored"
    for item in held.all():  # what the I/O thread does: queue it, nothing more
        parts.gone.put(ConsumerGone(item.queue, item.epoch, "connection lost"))
    assert len(held) == 3 and journal.entries == []
    assert held.settle_gone() == 3
    assert len(held) == 0 and held.lost == 3
    assert [entry[0] for entry in journal.entries] == ["close"] * 3 + ["drop"] * 3 + ["release"]
    assert parts.locks.calls == [["q-0", "q-1", "q-2"]]  # one round trip for all
    assert parts.reports[-1] == ("revoked", ["q-0", "q-1", "q-2"], "connection lost")
    assert held.settle_gone() == 0


def test_an_aside_queue_is_drained_under_its_held_queues_lease_and_ends_with_it() -> None:
    held, journal, parts = make(lease("q-a", token=5))
    parts.drains._attach(held, "q-aside", "q-a")
    (attached,) = parts.drains._attached.all()
    parts.gone.put(ConsumerGone("q-aside", attached.epoch, "channel closed by the broker"))
    assert held.settle_gone() == 0, "an aside consumer taken away leaves the holding"
    assert "q-a" in held and parts.drains.draining() == set()

    assert parts.drains._attach(held, "q-aside", "q-a") is ConsumeOutcome.CONSUMING
    (attached,) = parts.drains._attached.all()
    assert held.lease_for("q-aside", attached.epoch) == lease("q-a", token=5)
    assert parts.drains.draining() == {"q-a"}
    journal.entries.clear()
    held.lose(lease("q-a", token=5), "lock lost")
    assert [entry[:2] for entry in journal.entries][:2] == [
        ("close", "q-aside"),
        ("drop", "q-aside"),
    ]
    assert held.lease_for("q-aside", attached.epoch) is None
    assert parts.drains.draining() == set()


def test_handing_back_closes_all_in_one_call_before_dropping_then_releases_all_in_one() -> None:
    held, journal, parts = make(lease("q-a"), lease("q-b"), lease("q-c"))
    held._buffer.add(plain_delivery("q-c", 1, held.get("q-c").epoch))  # type: ignore[union-attr]
    journal.entries.clear()
    handed = held.hand_back(
        {"q-a": "rebalance", "q-b": "idle", "q-c": "idle"},
        busy=lambda queue: held._buffer.depth(queue) > 0,
    )
    assert handed == ["q-a", "q-b"]  # q-c has work again: kept
    assert [entry[:2] for entry in journal.entries] == [
        ("close", "q-a"),
        ("close", "q-b"),
        ("drop", "q-a"),
        ("drop", "q-b"),
        ("release", "q-a"),
    ]
    assert parts.link.closings == [["q-a", "q-b"]]  # one round trip for both channels
    assert parts.locks.calls == [["q-a", "q-b"]]
    assert held.released == 2 and held.lost == 0
    assert parts.reports[-1] == ("revoked", ["q-a", "q-b"], "released")
    # Handing back all closes every consumer and settles the losses too.
    held, _journal, parts = make(lease("q-a"), lease("q-b"))
    item = held.get("q-b")
    assert item is not None
    parts.gone.put(ConsumerGone("q-b", item.epoch, "channel closed by the broker"))
    ended = held.hand_back_all()
    assert [h.queue for h in ended] == ["q-a"]
    assert parts.locks.calls == [["q-b"], ["q-a"]]
    assert parts.reports[-1] == ("revoked", ["q-a"], "shutdown")


def test_a_quorum_queue_handed_back_starved_is_looked_into_before_its_lock_goes() -> None:
    """The order of a starved hand-back (``keyq.worker.amqp.starvation``); whether the broker
    starves a consumer is shown on a real cluster in ``tests/test_cluster.py``."""
    held, journal, parts = make(queue_type="quorum", ready={"q-starved-one": 3})
    for round_ in (1, 2):
        held.claim([lease("q-starved-one"), lease("q-busy")], budget_s=1.0)
        epoch = held.get("q-busy").epoch  # type: ignore[union-attr]
        held._buffer.add(plain_delivery("q-busy", round_, epoch))
        held._buffer.take(10, 0.0, 0.0)  # handled: nothing of it waits
        journal.entries.clear()
        held.hand_back({"q-starved-one": "idle", "q-busy": "idle"}, busy=lambda _queue: False)
        steps = [entry[:2] for entry in journal.entries if entry[0] != "drop"]
        moved = [("move", steps[3][1])] if round_ == 2 else []  # starved twice in a row
        assert steps == [
            ("close", "q-starved-one"),
            ("close", "q-busy"),
            ("look", "q-starved-one"),  # only the queue whose holding received nothing
            *moved,
            ("release", "q-starved-one"),  # and only then its lock (with q-busy's)
        ], steps
    assert len(parts.link.moves) == 1 and "q-starved-one" in parts.link.moves[0]
    assert parts.starved.starved_moves == 1


def _starved_hand_backs(held: HeldQueues, queue: str, reasons: list[str]) -> None:
    for reason in reasons:
        held.claim([lease(queue)], budget_s=1.0)
        if reason == "received":
            epoch = held.get(queue).epoch  # type: ignore[union-attr]
            held._buffer.add(plain_delivery(queue, 1, epoch))
            held._buffer.take(10, 0.0, 0.0)
        held.hand_back(
            {queue: "rebalance" if reason == "rebalance" else "idle"}, busy=lambda _q: False
        )


def test_a_holding_that_received_something_between_two_starved_ones_moves_nothing() -> None:
    held, _journal, parts = make(queue_type="quorum", ready={"q": 3})
    _starved_hand_backs(held, "q", ["starved", "received", "starved"])
    assert parts.link.moves == [] and parts.starved.starved_moves == 0
    _starved_hand_backs(held, "q", ["starved"])
    assert len(parts.link.moves) == 1


@pytest.mark.parametrize(
    ("queue_type", "link_state", "reasons", "looks"),
    [
        ("classic", None, ["starved", "starved"], 0),  # a classic queue is never looked into
        ("quorum", None, ["rebalance", "rebalance"], 0),  # only idle hand-backs are
        ("quorum", "looks_fail", ["starved", "starved"], 2),  # a failed look moves nothing
        ("quorum", "single_node", ["starved", "starved"], 2),  # one broker URL: the link stays
    ],
)
def test_starved_hand_backs_that_move_nothing_still_release_the_locks(
    queue_type: str, link_state: str | None, reasons: list[str], looks: int
) -> None:
    held, journal, parts = make(queue_type=queue_type, ready={"q": 3})
    if link_state is not None:
        setattr(parts.link, link_state, True)
    _starved_hand_backs(held, "q", reasons)
    assert parts.locks.calls == [["q"]] * len(reasons), "every lock released"
    assert parts.link.moves == [] and parts.starved.starved_moves == 0, "nothing moved"
    assert [entry[0] for entry in journal.entries].count("look") == looks, "looks"


def test_bucket_mode_a_quiet_quorum_queue_with_ready_messages_and_none_unacked_moves() -> None:
    held, journal, parts = make(queue_type="quorum", ready={"q-starved": 7, "q-busy": 7})
    parts.link.unacked = {"q-busy": 5}  # a full prefetch: ready messages wait for room
    held.claim([lease("q-starved"), lease("q-busy")], budget_s=1.0)
    for _ in range(3):  # quiet for less than the idle time: not looked into
        parts.starved.watch_quiet(held.all(), 60.0)
    assert not [entry for entry in journal.entries if entry[0] == "look"]
    parts.starved.watch_quiet(held.all(), 0.0)  # quiet for at least 0 s: looked into
    assert parts.link.moves == []
    parts.starved.watch_quiet(held.all(), 0.0)  # the second look, an idle time (0 s) later
    assert len(parts.link.moves) == 1 and "q-starved" in parts.link.moves[0]
    assert ("look", "q-busy") in journal.entries and parts.starved.starved_moves == 1


def test_reopening_keeps_the_lock_and_the_waits_and_remembers_a_wider_prefetch() -> None:
    held, journal, _parts = make(lease("q-a"))
    before = held.get("q-a")
    assert before is not None and held.room_of("q-a") == 10
    assert held.reopen("q-a", 40)
    after = held.get("q-a")
    assert after is not None
    assert after.lease == before.lease and after.epoch > before.epoch
    assert held.room_of("q-a") == 40
    assert ("drop", "q-a", str(before.epoch), "keep") in journal.entries
    assert held.reopen("q-a")  # the wider prefetch is kept
    assert journal.entries[-1] == ("consume", "q-a", str(after.epoch + 1), "40")
    assert held.room_of("q-missing") is None and not held.reopen("q-missing")


@pytest.mark.parametrize("refusal", ["the broker refuses", "the link is down", "consumer gone"])
def test_a_reopen_that_fails_ends_the_holding_and_releases_its_lock(refusal: str) -> None:
    held, journal, parts = make(lease("q-a"))
    item = held.get("q-a")
    assert item is not None
    if refusal == "the broker refuses":
        parts.link.outcomes["q-a"] = ConsumeOutcome.FAILED
    elif refusal == "the link is down":
        parts.link.looks_fail = True  # the connection was lost: consume raises
    else:  # the broker took the consumer away: ended, not reopened
        parts.gone.put(ConsumerGone("q-a", item.epoch, "connection lost"))
    journal.entries.clear()
    assert not held.reopen("q-a", 40)
    assert "q-a" not in held and held.lost == 1
    assert parts.locks.calls == [["q-a"]]
    consumed = [entry for entry in journal.entries if entry[0] == "consume"]
    assert bool(consumed) is (refusal != "consumer gone"), consumed


def test_a_batch_outcome_defers_stops_lost_queues_and_puts_back_the_rest_as_put_back_does() -> None:
    held, journal, parts = make(lease("q-a"), lease("q-b", token=3), lease("q-c"))
    epochs = {item.queue: item.epoch for item in held.all()}
    journal.entries.clear()
    held.apply(
        BatchOutcome(
            unsettled=[plain_delivery("q-a", 1, epochs["q-a"])],
            deferred=[plain_delivery("q-c", 2, epochs["q-c"])],
            lost=[lease("q-b", token=3)],
        )
    )
    assert "q-b" not in held and ("register", "q-b") in journal.entries
    assert parts.reports[-1] == ("revoked", ["q-b"], "commit refused: the lock moved on")
    assert held._buffer.depth("q-a") == 1 and held._buffer.deferred("q-c") == 1
    # Put back: what is held is kept; consumers whose deliveries were let go are closed.
    held, journal, _parts = make(lease("q-a"))
    item = held.get("q-a")
    assert item is not None
    journal.entries.clear()
    held.put_back([plain_delivery("q-a", 1, item.epoch), plain_delivery("q-gone", 1, 7)])
    assert held._buffer.depth("q-a") == 1 and held._buffer.depth("q-gone") == 0
    assert journal.entries == [("close", "q-gone", "7")]


def test_a_consumer_whose_whole_prefetch_is_deferred_is_reopened_wider() -> None:
    held, journal, _parts = make(lease("q-a"))
    assert held.reopen("q-a", 3)

    def defer(*tags: int) -> None:
        epoch = held.get("q-a").epoch  # type: ignore[union-attr]
        deferred = [plain_delivery("q-a", tag, epoch) for tag in tags]
        held.apply(BatchOutcome(deferred=deferred))

    journal.entries.clear()
    defer(1, 2)
    assert not [entry for entry in journal.entries if entry[0] == "consume"]  # room left
    defer(3)
    # In messages: the deferred deliveries' messages, plus the AMQP prefetch.
    assert held.room_of("q-a") == 3 + 10
    assert held.reopen("q-a", MAX_PREFETCH)
    journal.entries.clear()
    defer(4)
    assert journal.entries == []  # as wide as it gets


def test_handbacks_ask_the_least_busy_surplus_once_idle_ones_and_cool_down_what_went_back() -> None:
    buffer = DeliveryBuffer()
    for tag in range(3):
        buffer.add(plain_delivery("q-deep", tag))
    handbacks = HandBacks(buffer)
    handbacks.ask_surplus({"q-deep", "q-empty", "q-other"}, 1)
    handbacks.ask_surplus({"q-deep", "q-empty", "q-other"}, 1)  # already asked for
    taken = handbacks.take()
    assert len(taken) == 1 and "q-deep" not in taken
    assert set(taken.values()) == {"rebalance"}
    assert handbacks.take() == {}
    now = time.monotonic()
    handbacks.handed_back(["q-empty"])
    assert handbacks.cooling("q-empty", now)
    assert not handbacks.cooling("q-empty", now + RELEASE_COOLDOWN_S + 0.1)
    assert not handbacks.cooling("q-other", now)
    # Idle queues are asked back only with nothing buffered.
    buffer.add(plain_delivery("q-busy", 1))
    long_ago = time.monotonic() - 60
    held = [
        Held(queue=queue, lease=lease(queue), epoch=1, since=long_ago)
        for queue in ("q-busy", "q-idle")
    ]
    held.append(Held(queue="q-new", lease=lease("q-new"), epoch=1))
    handbacks.ask_idle(held, idle_after_s=30)
    assert handbacks.take() == {"q-idle": "idle"}


def test_refused_claims_wait_by_reason_and_say_unreachable_once(caplog: Any) -> None:
    refused = refused_claims.RefusedClaims()
    now = 1000.0
    refused.refused("q-busy", ConsumeOutcome.BUSY, now)
    refused.refused("q-gone", ConsumeOutcome.MISSING, now)
    with caplog.at_level("INFO", logger="keyq.worker.holding.claims"):
        refused.refused("q-down", ConsumeOutcome.UNREACHABLE, now)
        refused.refused("q-down", ConsumeOutcome.UNREACHABLE, now)
        refused.consumed("q-down")
        refused.consumed("q-down")
    assert refused.waiting("q-busy", now + refused_claims.BUSY_BACKOFF_S - 0.01)
    assert not refused.waiting("q-busy", now + refused_claims.BUSY_BACKOFF_S + 0.01)
    assert refused.waiting("q-gone", now + refused_claims.MISSING_BACKOFF_S - 0.01)
    assert not refused.waiting("q-down", now + refused_claims.UNREACHABLE_BACKOFF_S + 0.01)
    assert not refused.waiting("q-never", now)
    said = [record.getMessage() for record in caplog.records]
    assert sum("is unreachable" in line for line in said) == 1
    assert sum("reachable again" in line for line in said) == 1
