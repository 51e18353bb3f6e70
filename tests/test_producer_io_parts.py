"""Unit tests of the producer link's I/O-thread parts on a fake loop, connection and channels:
sends, confirms, recoveries, leases, stalled queues, the overdue watch and probes. The broker's
side: tests/test_producer_order.py, tests/test_connection_failures.py, tests/test_cluster.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pika
import pytest

from keyq.broker.settings import load_settings
from keyq.producer.lanes import WaitReason
from keyq.producer.link import PublisherLink
from keyq.producer.outgoing import Outgoing
from keyq.producer.overdue import CONFIRM_CHECK_S
from keyq.producer.probes import PROBE_FIRST_S

Callback = Callable[..., Any]


class FakeLoop:
    """Runs nothing by itself: the test fires what is due."""

    def __init__(self) -> None:
        self.later: list[tuple[float, Callback]] = []
        self.soon: list[Callback] = []

    def call_later(self, delay: float, callback: Callback) -> None:
        self.later.append((delay, callback))

    def add_callback_threadsafe(self, callback: Callback) -> None:
        self.soon.append(callback)

    def run_soon(self) -> None:
        while self.soon:
            self.soon.pop(0)()

    def fire(self, delay: float) -> None:
        """Run (once) the callbacks asked for after ``delay``."""
        due = [callback for wait, callback in self.later if wait == delay]
        self.later = [(wait, callback) for wait, callback in self.later if wait != delay]
        for callback in due:
            callback()

    def delays(self) -> list[float]:
        return [wait for wait, _callback in self.later]


@dataclass(eq=False)
class FakeChannel:
    is_open: bool = True
    published: list[str] = field(default_factory=list)  # queue names, in order
    sent: list[tuple[bytes, Any]] = field(default_factory=list)  # (body, properties), in order
    declared: list[str] = field(default_factory=list)
    on_close: list[Callback] = field(default_factory=list)
    declare_callbacks: list[Callback] = field(default_factory=list)
    confirm: Callback | None = None
    confirm_ok: Callback | None = None

    def basic_publish(
        self, exchange: str, routing_key: str, body: bytes, properties: Any, mandatory: bool
    ) -> None:
        assert exchange == "" and mandatory
        self.published.append(routing_key)
        self.sent.append((body, properties))

    def queue_declare(self, queue: str, **kwargs: Any) -> None:
        self.declared.append(queue)
        if kwargs.get("callback") is not None:
            self.declare_callbacks.append(kwargs["callback"])

    def add_on_close_callback(self, callback: Callback) -> None:
        self.on_close.append(callback)

    def add_on_return_callback(self, callback: Callback) -> None: ...

    def confirm_delivery(self, ack_nack_callback: Callback, callback: Callback) -> None:
        self.confirm, self.confirm_ok = ack_nack_callback, callback

    def close(self, reason: BaseException | None = None) -> None:
        self.is_open = False
        for callback in self.on_close:
            callback(self, reason or RuntimeError("closed"))


class FakeConnection:
    def __init__(self) -> None:
        self.is_open, self.is_closing, self.is_closed, self.closes = True, False, False, 0
        self.opening: list[tuple[FakeChannel, Callback]] = []

    def channel(self, on_open_callback: Callback) -> FakeChannel:
        opened = FakeChannel()
        self.opening.append((opened, on_open_callback))
        return opened

    def open_channels(self) -> list[FakeChannel]:
        opening, self.opening = self.opening, []
        for opened, on_open in opening:
            on_open(opened)
        return [opened for opened, _ in opening]

    def close(self) -> None:
        self.closes += 1
        self.is_closing = True


@dataclass
class Harness:
    link: PublisherLink
    loop: FakeLoop
    connection: FakeConnection
    channel: FakeChannel
    leases_asked: list[str]
    new_queues: list[dict[str, str | None]]
    numbers: int = 0

    def publish(self, queue: str) -> Outgoing:
        self.numbers += 1
        properties = pika.BasicProperties(message_id=f"p:{self.numbers}")
        message = Outgoing(self.numbers, queue, f"key-{queue}", b"{}", properties)
        with self.link.window.cond:
            self.link.submit(message, time.monotonic())
        self.loop.run_soon()
        return message

    def grant(self, *queues: str, incarnation: int | None = 0) -> None:
        self.link.leases.applied(dict.fromkeys(queues, incarnation), time.monotonic())


def ack(tag: int, *, multiple: bool = False, nack: bool = False) -> Any:
    kind = pika.spec.Basic.Nack if nack else pika.spec.Basic.Ack
    return SimpleNamespace(method=kind(delivery_tag=tag, multiple=multiple))


def make_harness(**overrides: Any) -> Harness:
    """A link on the fake loop, connection and channel; settings as given over the defaults."""
    settings = load_settings(
        **{"confirm_window": 100, "confirm_timeout": 15.0, "publish_lease_ms": 2000, **overrides}
    )
    asked: list[str] = []
    new_queues: list[dict[str, str | None]] = []
    link = PublisherLink(
        settings,
        "s",
        ("s.dead", "classic"),
        on_new_queues=new_queues.append,
        request_lease=lambda queue, _key: asked.append(queue),
    )
    link.ctx.ioloop.close()
    loop, connection, channel = FakeLoop(), FakeConnection(), FakeChannel()
    link.ctx.ioloop = loop  # type: ignore[assignment]
    link.ctx.connection = connection  # type: ignore[assignment]
    link.ctx.channel = channel
    return Harness(link, loop, connection, channel, asked, new_queues)


@pytest.fixture
def harness() -> Harness:
    """A link that sends each event as a message of its own."""
    return make_harness(pack_max_events=1)


def test_events_wait_for_a_lease_then_go_in_order_and_settle(harness: Harness) -> None:
    link = harness.link
    first, second = harness.publish("q"), harness.publish("q")
    lane = link.lanes["q"]
    assert lane.reasons == {WaitReason.UNLEASED} and list(lane.waiting) == [first, second]
    assert harness.leases_asked == ["q"]  # asked once
    harness.grant("q")
    assert not lane.waits and lane.inflight == 2
    assert harness.channel.declared == ["q"] and harness.channel.published == ["q", "q"]
    assert [first.tag, second.tag] == [1, 2]
    link.connector.on_confirm(ack(2, multiple=True))
    assert link.window.unsettled == 0 and link.window.unsettled_by_queue() == {}
    assert harness.new_queues == [{"q": "key-q"}]  # registered once
    assert not link.ledger.inflight and lane.quiet


def test_a_returned_event_goes_again_before_newer_ones(harness: Harness) -> None:
    link, channel = harness.link, harness.channel
    harness.publish("q")
    harness.grant("q")
    returned = harness.publish("q")
    link.ledger.on_return(None, None, returned.properties, b"")
    lane = link.lanes["q"]
    assert lane.waits_for(WaitReason.RECOVERING)
    newer = harness.publish("q")  # parks behind the recovery
    assert list(lane.waiting) == [newer]
    link.connector.on_confirm(ack(2, multiple=True))  # the first published, the second returned
    # Declared again, then the returned event, then the newer one.
    assert channel.declared == ["q", "q"] and channel.published == ["q", "q", "q", "q"]
    assert [m.number for m in link.ledger.inflight] == [2, 3]
    assert link.ledger.returned_events == 1 and not lane.waits
    assert link.window.unsettled == 2


def test_a_lost_connection_collects_every_unconfirmed_event_in_order(harness: Harness) -> None:
    link = harness.link
    harness.publish("a")
    harness.publish("b")
    harness.grant("a")  # "b" stays held
    harness.publish("a")
    link.recovery.collect_unsettled()
    assert [m.number for m in link.recovery.resend] == [1, 2, 3]
    assert not (link.lanes or link.ledger.inflight or link.ledger.by_number)
    link.recovery.resend_collected()
    assert link.recovery.resent_events == 3 and link.ledger.next_tag == 1
    assert set(link.lanes) == {"a", "b"}  # new lanes, held until leased again


def test_a_retired_queue_holds_its_events_and_asks_again(harness: Harness) -> None:
    link = harness.link
    harness.publish("q")
    harness.grant("q", incarnation=None)
    lane = link.lanes["q"]
    assert lane.waits_for(WaitReason.UNLEASED) and not lane.declared and lane.lease_until == 0.0
    retry = link.leases.lease_s / 4
    assert retry in harness.loop.delays()
    harness.loop.fire(retry)
    assert harness.leases_asked == ["q", "q"]
    harness.grant("q", incarnation=1)
    assert harness.channel.declared == ["q~1"] and harness.channel.published == ["q~1"]


def test_a_confirm_from_a_retired_incarnation_sends_the_event_again(harness: Harness) -> None:
    # A quorum queue is deleted once its mark's grace is over and declared anew under the
    # next name; a confirm that comes from the old one after the new one is leased proves
    # nothing (the old may have been deleted after routing the event), so the event goes again.
    link, channel = harness.link, harness.channel
    event = harness.publish("q")
    harness.grant("q")
    assert channel.published == ["q"] and event.sent_to == "q"
    harness.grant("q", incarnation=1)  # the lane moved on while the confirm was slow
    link.connector.on_confirm(ack(1))
    assert link.ledger.late_confirms == 1 and harness.new_queues == []  # not counted as published
    assert channel.declared[-1] == "q~1" and channel.published == ["q", "q~1"]
    assert link.ledger.by_number[event.number].sent_to == "q~1" and link.window.unsettled == 1
    link.connector.on_confirm(ack(2))
    assert link.window.unsettled == 0 and harness.new_queues == [{"q~1": "key-q"}]


@pytest.mark.parametrize("gap", [True, False])
def test_a_confirm_counts_only_under_leases_renewed_without_a_gap(
    harness: Harness, gap: bool
) -> None:
    # A lease that ran out before the next (a stalled Redis thread, say): a deleter may have
    # deleted the queue in the gap, so a confirm proves nothing and the event goes again.
    link = harness.link
    event = harness.publish("q")
    harness.grant("q")
    if gap:
        link.lanes["q"].lease_until = time.monotonic() - 0.01  # ran out with the event in flight
    harness.grant("q")  # same incarnation; after the gap, or while the first still held
    link.connector.on_confirm(ack(1))
    assert link.ledger.late_confirms == int(gap)
    if gap:
        assert harness.new_queues == [] and link.window.unsettled == 1, "counted after a gap"
        assert link.ledger.by_number[event.number].tag == 2, "not sent again"
    else:
        assert link.window.unsettled == 0 and harness.new_queues == [{"q": "key-q"}]


def test_a_lease_is_renewed_ahead_while_events_are_in_flight(harness: Harness) -> None:
    link = harness.link
    harness.publish("q")
    harness.grant("q")
    assert harness.leases_asked == ["q"]
    lane = link.lanes["q"]
    lane.lease_until = time.monotonic() + link.leases.lease_s / 4
    harness.publish("q")  # in the lease's second half: renewed, nothing held
    assert harness.leases_asked == ["q", "q"] and lane.leasing and not lane.waits
    harness.publish("q")
    assert harness.leases_asked == ["q", "q"]  # one request at a time


def stalled_own_channel(harness: Harness, events: int) -> tuple[FakeChannel, list[Outgoing]]:
    """Queue "quiet" stalled, ``events`` published to it, its own channel open in confirm mode."""
    harness.link.window.mark_stalled({"quiet"})
    harness.link.stalled.open_all()  # as on a new connection
    sent = [harness.publish("quiet") for _ in range(events)]
    harness.grant("quiet")
    [own] = harness.connection.open_channels()
    assert own.confirm_ok is not None and own.confirm is not None
    own.confirm_ok(None)  # confirm mode on: the first goes, declared there too
    return own, sent


def test_a_stalled_queue_sends_one_event_at_a_time_on_its_own_channel(harness: Harness) -> None:
    link = harness.link
    own, (first, second) = stalled_own_channel(harness, 2)
    assert own.declared == ["quiet"] and own.published == ["quiet"] and first.tag == 1
    assert list(link.lanes["quiet"].waiting) == [second]
    assert own.confirm is not None
    own.confirm(ack(1))  # heard again: its channel closes, the rest goes on the main one
    assert "quiet" not in link.window.stalled and not own.is_open
    assert not link.stalled.own
    assert harness.channel.published == ["quiet"] and second.tag == 1
    assert link.window.unsettled == 1 and harness.new_queues == [{"quiet": "key-quiet"}]


def test_a_stalled_channel_overdue_is_reset_and_its_event_waits_again(harness: Harness) -> None:
    link = harness.link
    own, [sent] = stalled_own_channel(harness, 1)
    link.stalled.reset_overdue(sent.sent_at + 14.9)
    assert own.is_open
    link.stalled.reset_overdue(sent.sent_at + 15.0)
    assert not own.is_open and link.stalled.channel_resets == 1
    lane = link.lanes["quiet"]
    assert list(lane.waiting) == [sent] and lane.inflight == 0
    assert 1.0 in harness.loop.delays()  # opened again a moment later


def test_an_overdue_confirm_makes_its_queues_stalled_and_reconnects(harness: Harness) -> None:
    link = harness.link
    harness.publish("a")
    harness.grant("a")
    oldest = link.ledger.inflight[0]
    link.watch.check(oldest.sent_at + 14.0)
    assert harness.connection.closes == 0
    link.window.set_blocked(True)  # flow control delays confirms on purpose
    link.watch.check(oldest.sent_at + 20.0)
    assert harness.connection.closes == 0
    link.window.set_blocked(False)
    link.watch.check(oldest.sent_at + 20.0)
    assert harness.connection.closes == 1 and link.watch.overdue_reconnects == 1
    assert link.window.stalled == {"a"}
    assert link.ctx.settings.connect_timeout in harness.loop.delays()  # dropped if not closed


def test_the_watch_runs_every_second_until_stopping(harness: Harness) -> None:
    link = harness.link
    link.watch.start()
    assert harness.loop.delays() == [CONFIRM_CHECK_S]
    harness.loop.fire(CONFIRM_CHECK_S)
    assert harness.loop.delays() == [CONFIRM_CHECK_S]
    link.ctx.stopping = True
    harness.loop.fire(CONFIRM_CHECK_S)
    assert harness.loop.delays() == []


def test_an_unreachable_queue_waits_until_its_probe_is_answered(harness: Harness) -> None:
    link, connection = harness.link, harness.connection
    link.probes.mark_unreachable("q", "404 down")
    message = harness.publish("q")
    lane = link.lanes["q"]
    assert lane.unreachable and list(lane.waiting) == [message]
    harness.grant("q")
    assert list(lane.waiting) == [message]  # still unreachable
    link.probes.probe("q", link.ctx.queue_args)
    [probe] = connection.open_channels()
    assert probe.declared == ["q"]
    probe.declare_callbacks[0](None)
    assert not lane.waits and lane.declared and not probe.is_open
    assert "q" not in link.probes.unreachable and "q" not in link.probes.probing
    assert harness.channel.published == ["q"] and harness.channel.declared == []


def test_a_refused_probe_is_retried_with_growing_delays(harness: Harness) -> None:
    link, connection = harness.link, harness.connection
    link.probes.mark_unreachable("q", "404 down")
    link.probes.probe("q", link.ctx.queue_args)
    for nominal in (PROBE_FIRST_S, 2 * PROBE_FIRST_S, 4 * PROBE_FIRST_S):
        [probe] = connection.open_channels()
        probe.close()  # 404: the channel closes
        [delay] = harness.loop.delays()
        assert nominal / 2 <= delay <= nominal  # jittered backoff
        harness.loop.fire(delay)
    assert len(connection.opening) == 1


def test_a_newer_probe_supersedes_a_chain_cut_off(harness: Harness) -> None:
    link, connection = harness.link, harness.connection
    link.probes.mark_unreachable("q", "404 down")
    link.probes.probe("q", link.ctx.queue_args)
    [cut] = [opened for opened, _ in connection.opening]
    connection.opening.clear()
    link.probes.probe("q", link.ctx.queue_args)  # a new connection's chain
    cut.close()  # the older chain's channel, closed before it opened
    [delay] = harness.loop.delays()
    harness.loop.fire(delay)
    assert len(connection.opening) == 1  # only the newer chain's channel


def test_a_queue_marked_unreachable_keeps_the_first_incarnation_seen(harness: Harness) -> None:
    probes = harness.link.probes
    probes.mark_unreachable("q~2", "404")
    probes.mark_unreachable("q~3", "404")
    assert harness.link.lanes.unreachable == {"q": "q~2"}
