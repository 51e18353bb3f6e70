"""The producer's packing on the I/O thread's parts (fake loop, connection and channels, as in
tests/test_producer_io_parts.py): which events leave together, and how a pack is confirmed,
returned and sent again. The real broker's side is in tests/test_packed_publishing.py."""

from __future__ import annotations

import time
from typing import Any

import pika
import pytest

from keyq.broker.envelope import HEADER_KEY, HEADER_PUBLISHED_AT, HEADER_SEQ
from keyq.broker.packs import HEADER_PACK, decode_pack, is_pack
from keyq.producer.confirmation import Confirmation
from keyq.producer.outgoing import Outgoing
from tests.test_producer_io_parts import Harness, ack, make_harness


def packing(**overrides: Any) -> Harness:
    """The I/O parts' harness (tests/test_producer_io_parts.py) with packing on."""
    return make_harness(**{"pack_max_events": 5, **overrides})


def run(harness: Harness) -> None:
    """Let the I/O thread take what was handed over; a queue's first events wait for its
    publish lease, granted here."""
    harness.loop.run_soon()
    harness.grant(*[q for q, lane in harness.link.lanes.items() if not lane.lease_until])


def event(harness: Harness, queue: str) -> Outgoing:
    """An event as ``Producer`` makes it, handed over without running the I/O loop."""
    harness.numbers += 1
    number = harness.numbers
    headers = {HEADER_KEY: f"key-{queue}", HEADER_SEQ: number, HEADER_PUBLISHED_AT: 1000 + number}
    message = Outgoing(
        number,
        queue,
        f"key-{queue}",
        b'{"n": %d}' % number,
        pika.BasicProperties(
            message_id=f"p:{number}", content_type="application/json", headers=headers
        ),
    )
    message.confirmation = Confirmation(harness.link.window, f"p:{number}")
    with harness.link.window.cond:
        harness.link.submit(message, time.monotonic())
    return message


def events(harness: Harness, count: int) -> list[Outgoing]:
    return [event(harness, "q") for _ in range(count)]


def sent_events(harness: Harness) -> list[list[int]]:
    """The seqs each message sent carried, in send order."""
    found = []
    for body, properties in harness.channel.sent:
        if is_pack(properties.content_type):
            assert properties.headers[HEADER_PACK] == len(decode_pack(body))
            found.append([e.headers[HEADER_SEQ] for e in decode_pack(body)])
        else:
            found.append([properties.headers[HEADER_SEQ]])
    return found


def test_events_of_a_queue_waiting_together_leave_as_one_pack() -> None:
    harness = packing()
    for queue in ("q", "r", "q", "q", "r"):
        event(harness, queue)
    run(harness)
    assert sent_events(harness) == [[1, 3, 4], [2, 5]]
    body, properties = harness.channel.sent[0]
    assert properties.headers[HEADER_PUBLISHED_AT] == 1001  # the oldest: what lag gauges read
    assert properties.headers[HEADER_KEY] == "key-q"
    assert [e.message_id for e in decode_pack(body)] == ["p:1", "p:3", "p:4"]
    link = harness.link
    assert link.window.unsettled == 5 and link.window.unsettled_by_queue() == {"q": 3, "r": 2}
    link.connector.on_confirm(ack(1))
    assert link.window.unsettled == 2 and link.window.unsettled_by_queue() == {"r": 2}


def test_a_lone_event_goes_at_once_and_later_ones_gather_until_its_confirm() -> None:
    harness = packing()
    first = event(harness, "q")
    run(harness)
    assert sent_events(harness) == [[1]]  # alone, at once
    waiting = events(harness, 3)
    run(harness)
    assert sent_events(harness) == [[1]]  # an earlier message of the queue awaits its confirm
    harness.link.connector.on_confirm(ack(1))
    assert first.confirmation is not None and first.confirmation.published
    assert sent_events(harness) == [[1], [2, 3, 4]]
    assert not any(m.confirmation and m.confirmation.published for m in waiting)
    harness.link.connector.on_confirm(ack(2))
    assert all(m.confirmation and m.confirmation.published for m in waiting)
    assert harness.link.window.unsettled == 0 and harness.link.lanes["q"].quiet


def test_a_pack_is_bounded_in_bytes() -> None:
    harness = packing(pack_max_events=100, pack_max_bytes=1024)
    events(harness, 12)
    run(harness)
    while harness.link.window.unsettled:  # a full pack goes at once; the rest after its confirm
        harness.link.connector.on_confirm(ack(len(harness.channel.sent), multiple=True))
    sizes = [len(body) for body, _ in harness.channel.sent]
    assert sum(len(seqs) for seqs in sent_events(harness)) == 12
    assert len(sizes) > 1 and max(sizes) <= 1024


def test_a_returned_pack_goes_again_with_its_events_before_newer_ones() -> None:
    harness = packing()
    link, channel = harness.link, harness.channel
    events(harness, 3)
    run(harness)
    pack_properties = channel.sent[0][1]
    link.ledger.on_return(None, None, pack_properties, b"")
    newer = event(harness, "q")
    run(harness)
    link.connector.on_confirm(ack(1))  # confirmed, but it was returned: declared anew, sent again
    assert sent_events(harness) == [[1, 2, 3], [1, 2, 3, 4]]
    assert channel.declared == ["q", "q"]
    assert link.ledger.returned_events == 3 and link.window.unsettled == 4
    link.connector.on_confirm(ack(2))
    assert newer.confirmation is not None and newer.confirmation.published
    assert link.window.unsettled == 0


def test_a_lost_connection_sends_packs_and_gathered_events_again_in_order() -> None:
    harness = packing()
    link = harness.link
    events(harness, 2)
    run(harness)
    events(harness, 2)  # gather behind the unconfirmed pack
    run(harness)
    assert sent_events(harness) == [[1, 2]]
    link.recovery.collect_unsettled()
    assert [m.members[0].number for m in link.recovery.resend] == [1, 3]
    assert sum(m.count for m in link.recovery.resend) == 4
    harness.channel.sent.clear()
    link.recovery.resend_collected()
    run(harness)  # leases are asked again on the new connection
    assert sent_events(harness) == [[1, 2, 3, 4]]
    assert link.recovery.resent_events == 4
    link.connector.on_confirm(ack(1))
    assert link.window.unsettled == 0


def test_with_a_linger_a_lone_event_waits_for_company() -> None:
    harness = packing(pack_linger_ms=20)
    event(harness, "q")
    run(harness)
    assert sent_events(harness) == []
    event(harness, "q")
    run(harness)
    harness.loop.fire(0.02)
    assert sent_events(harness) == [[1, 2]]


@pytest.mark.parametrize("max_events", [1, 2, 7])
def test_packs_keep_every_events_order_and_fields(max_events: int) -> None:
    harness = packing(pack_max_events=max_events)
    made = events(harness, 20)
    run(harness)
    if max_events == 1:
        assert sent_events(harness) == [[n] for n in range(1, 21)], "packing off: all alone"
    while harness.link.window.unsettled:
        harness.link.connector.on_confirm(ack(len(harness.channel.sent), multiple=True))
    seqs = [seq for message in sent_events(harness) for seq in message]
    assert seqs == list(range(1, 21))
    assert all(len(message) <= max_events for message in sent_events(harness))
    bodies = []
    for body, properties in harness.channel.sent:
        bodies.extend(
            [e.body for e in decode_pack(body)] if is_pack(properties.content_type) else [body]
        )
    assert bodies == [m.body for m in made]


def test_a_full_pack_goes_at_once_and_the_events_after_it_go_on_gathering() -> None:
    harness = packing(pack_max_events=3)
    event(harness, "q")
    run(harness)
    events(harness, 2)  # gathering behind the first
    run(harness)
    events(harness, 2)  # one more fills a pack: it goes; the other keeps gathering
    run(harness)
    assert sent_events(harness) == [[1], [2, 3, 4]]
    harness.link.connector.on_confirm(ack(1))
    assert sent_events(harness) == [[1], [2, 3, 4]], "went while a message was in flight"
    events(harness, 3)
    run(harness)
    assert sent_events(harness) == [[1], [2, 3, 4], [5, 6, 7]], "a full pack did not go at once"
    harness.link.connector.on_confirm(ack(3, multiple=True))
    assert sent_events(harness)[-1] == [8]


def test_an_earlier_linger_does_not_cut_a_later_one_short() -> None:
    harness = packing(pack_max_events=2, pack_linger_ms=20)
    event(harness, "q")  # lingers: a timer
    run(harness)
    event(harness, "q")  # fills the pack: it goes, and the first timer stays behind
    run(harness)
    event(harness, "q")  # a new round, with a timer of its own
    run(harness)
    assert sent_events(harness) == [[1, 2]]
    lingers = [callback for delay, callback in harness.loop.later if delay == 0.02]
    assert len(lingers) == 2
    first, second = lingers
    first()
    assert sent_events(harness) == [[1, 2]]
    second()
    assert sent_events(harness) == [[1, 2], [3]]


def test_events_a_failed_send_did_not_take_wait_in_front_of_the_outbox() -> None:
    harness = packing()
    event(harness, "q")
    run(harness)  # the lease granted, the first sent
    harness.link.connector.on_confirm(ack(1))
    events(harness, 3)
    channel = harness.channel
    real_publish = channel.basic_publish

    def refuse(*args: Any, **kwargs: Any) -> None:
        channel.basic_publish = real_publish  # type: ignore[method-assign]
        raise RuntimeError("the socket went away")

    channel.basic_publish = refuse  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        harness.loop.run_soon()
    assert [m.number for m in harness.link.window.outbox] == [2, 3, 4]
    harness.loop.soon.append(harness.link.publisher.drain)
    harness.loop.run_soon()
    assert sent_events(harness) == [[1], [2, 3, 4]]
