"""Unit tests of the producer link's pure parts: a queue's lane and its wait reasons, the
confirm window's accounting, the overdue watch's timing and the stalled queues' own channels.
No service; the real broker's side is in tests/test_producer_order.py and
tests/test_connection_failures.py.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import pika
import pytest

from keyq.broker.errors import ProducerClosed, PublishError, PublishTimeout
from keyq.producer.lanes import Lanes, QueueLane, WaitReason, waiting_counts
from keyq.producer.ledger import StallClock
from keyq.producer.outgoing import Outgoing, events_in
from keyq.producer.overdue import overdue_oldest
from keyq.producer.stalled import STALLED_QUEUE_IN_FLIGHT, OwnChannel
from keyq.producer.window import REFUSING_QUEUE_ROOM, ConfirmWindow


def event(number: int, queue: str = "q", *, sent_at: float = 0.0) -> Outgoing:
    message = Outgoing(number, queue, "k", b"{}", pika.BasicProperties(message_id=f"p:{number}"))
    message.sent_at = sent_at
    return message


def test_a_lane_waits_while_any_reason_or_a_declaration_holds_it() -> None:
    lane = QueueLane(key="k")
    assert not lane.waits
    lane.wait(WaitReason.UNLEASED)
    lane.wait(WaitReason.UNREACHABLE)
    assert lane.waits and lane.unreachable
    assert lane.waits_for(WaitReason.UNLEASED) and not lane.waits_for(WaitReason.RECOVERING)
    lane.release(WaitReason.UNLEASED)
    assert lane.waits, "released while still unreachable"
    lane.release(WaitReason.UNLEASED)  # twice is harmless
    assert lane.reasons == {WaitReason.UNREACHABLE}
    lane.reachable()
    assert not lane.reasons and not lane.unreachable and lane.declared, "reachable: declared"
    lane.start_declaring("q~1")
    assert lane.declaring == "q~1" and lane.waits and not lane.quiet, "declaring holds it"
    lane.stop_declaring()
    assert lane.declaring is None and not lane.waits and lane.quiet


def test_lanes_of_an_unreachable_queue_wait_and_quiet_lanes_are_forgotten() -> None:
    lanes = Lanes()
    lanes.unreachable["q"] = "q~1"
    assert lanes.of(event(1, "q")).unreachable, "a new lane of an unreachable queue waits"
    assert not lanes.of(event(2, "r")).unreachable
    lanes.update(a=QueueLane(key="a"), b=QueueLane(key="b", inflight=1))
    lanes.forget_quiet()
    assert list(lanes) == ["b"]


@pytest.mark.parametrize(
    ("change", "quiet"),
    [
        (lambda lane: None, True),
        (lambda lane: setattr(lane, "inflight", 1), False),
        (lambda lane: lane.wait(WaitReason.RECOVERING), False),
        (lambda lane: lane.returned.append(event(1)), False),
        (lambda lane: lane.waiting.append(event(1)), False),
        (lambda lane: setattr(lane, "leasing", True), False),
        (lambda lane: lane.start_declaring("q"), False),
        # Unleased or unreachable with nothing waiting: nothing to lose by forgetting it.
        (lambda lane: lane.wait(WaitReason.UNLEASED), True),
        (lambda lane: lane.wait(WaitReason.UNREACHABLE), True),
    ],
)
def test_a_lane_is_quiet_with_nothing_in_flight_or_on_its_way(
    change: Callable[[QueueLane], object], quiet: bool
) -> None:
    lane = QueueLane(key="k")
    change(lane)
    assert lane.quiet is quiet


def test_waiting_events_are_released_only_when_nothing_holds_them_back() -> None:
    lane = QueueLane(key="k", inflight=2)
    lane.waiting.extend([event(5), event(7)])
    lane.take_back([event(6), event(3)])
    assert [m.number for m in lane.waiting] == [3, 5, 6, 7], "taken back go first, in order"
    assert lane.inflight == 0
    lane.wait(WaitReason.UNLEASED)
    assert not lane.take_released() and len(lane.waiting) == 4
    lane.release(WaitReason.UNLEASED)
    assert [m.number for m in lane.take_released()] == [3, 5, 6, 7]
    assert not lane.waiting


def test_a_recovery_resends_returned_events_in_order_then_the_waiting() -> None:
    lane = QueueLane(key="k", declared=True, registered=True)
    lane.wait(WaitReason.RECOVERING)
    lane.wait(WaitReason.UNLEASED)
    lane.returned.extend([event(4), event(2)])
    lane.waiting.append(event(9))
    returned, waiting = lane.begin_recovery()
    assert [m.number for m in returned] == [2, 4]
    assert [m.number for m in waiting] == [9]
    assert lane.reasons == {WaitReason.UNLEASED}  # only the recovery is over
    assert not (lane.declared or lane.registered or lane.returned or lane.waiting)


def test_waiting_counts_by_reason() -> None:
    held = QueueLane(key="a", waiting=deque([event(1), event(2)]))
    held.wait(WaitReason.UNLEASED)
    recovering = QueueLane(key="b", waiting=deque([event(3)]), returned=[event(0)])
    recovering.wait(WaitReason.RECOVERING)
    free = QueueLane(key="c", waiting=deque([event(4)]))
    lanes = [held, recovering, free]
    assert waiting_counts(lanes, WaitReason.UNLEASED) == (2, 1)
    assert waiting_counts(lanes, WaitReason.RECOVERING) == (2, 1)  # returned ones count
    assert waiting_counts(lanes, WaitReason.UNREACHABLE) == (0, 0)
    pack = event(5)
    pack.events = [event(5), event(6), event(7)]
    recovering.returned = [pack]
    assert waiting_counts([recovering], WaitReason.RECOVERING) == (4, 1), "a pack's events"
    assert events_in([pack, event(9)]) == 4


def submit(window: ConfirmWindow, message: Outgoing, wait_s: float = 0.0) -> bool:
    with window.cond:
        return window.submit(message, time.monotonic() + wait_s)


def test_submitting_counts_the_event_and_wakes_the_io_thread_once() -> None:
    window = ConfirmWindow(10)
    assert submit(window, event(1, "a"))
    assert not submit(window, event(2, "a"))
    assert not submit(window, event(3, "b"))
    assert window.unsettled == 3
    assert window.unsettled_by_queue() == {"a": 2, "b": 1}
    assert [m.number for m in window.outbox] == [1, 2, 3]
    window.draining()
    assert submit(window, event(4, "a"))
    assert not window.drain_again()  # already scheduled
    idle = ConfirmWindow(10)
    assert idle.drain_again(), "no drain scheduled: wakes"
    assert not idle.drain_again()


def test_a_full_window_or_blocked_publishers_time_out_saying_so() -> None:
    window = ConfirmWindow(2)
    submit(window, event(1))
    submit(window, event(2))
    with pytest.raises(PublishTimeout, match=r"2 events await confirmation \(window 2\)"):
        submit(window, event(3))
    blocked = ConfirmWindow(10)
    blocked.set_blocked(True)
    with pytest.raises(PublishTimeout, match="blocking publishers"):
        submit(blocked, event(1))
    blocked.set_blocked(False)
    submit(blocked, event(1))


def test_settling_makes_room_for_a_waiting_publisher() -> None:
    window = ConfirmWindow(1)
    submit(window, event(1, "a"))
    done = threading.Event()

    def publish() -> None:
        submit(window, event(2, "b"), wait_s=5)
        done.set()

    waiter = threading.Thread(target=publish)
    waiter.start()
    time.sleep(0.05)
    assert not done.is_set()
    assert window.settle(["a"]) == set()
    waiter.join(5)
    assert done.is_set() and window.unsettled_by_queue() == {"b": 1}


@pytest.mark.parametrize(
    ("mark", "says"), [("refusing", "keeps refusing"), ("stalled", "stopped confirming")]
)
def test_a_crowded_queue_waits_alone(mark: str, says: str) -> None:
    window = ConfirmWindow(10 * REFUSING_QUEUE_ROOM)
    if mark == "refusing":
        window.mark_refusing("bad")
    else:
        window.mark_stalled({"bad"})
    for number in range(REFUSING_QUEUE_ROOM):
        submit(window, event(number, "bad"))
    with pytest.raises(PublishTimeout, match=says):
        submit(window, event(REFUSING_QUEUE_ROOM, "bad"))
    submit(window, event(REFUSING_QUEUE_ROOM, "good"))  # other keys are not held up


def test_settling_a_stalled_or_refusing_queue_clears_it() -> None:
    window = ConfirmWindow(10)
    for number, queue in enumerate(["a", "a", "b", "c"]):
        submit(window, event(number, queue))
    window.mark_stalled({"a", "b"})
    window.mark_refusing("c")
    assert window.settle(["a", "c"]) == {"a"}
    assert window.stalled == {"b"} and window.refusing == set()
    assert window.unsettled == 2 and window.unsettled_by_queue() == {"a": 1, "b": 1}


def test_a_failure_stands_and_every_waiter_raises_it() -> None:
    window = ConfirmWindow(10)
    submit(window, event(1))
    first = PublishError("first")
    window.fail(first)
    window.fail(PublishError("second"))
    assert window.failure is first
    with pytest.raises(ProducerClosed, match="first"):
        submit(window, event(2))
    with pytest.raises(ProducerClosed, match="1 events unconfirmed: first"):
        window.wait_settled(None)


def test_wait_settled_times_out_or_returns_once_settled() -> None:
    window = ConfirmWindow(10)
    window.wait_settled(time.monotonic())  # nothing owed
    submit(window, event(1, "a"))
    with pytest.raises(PublishTimeout, match="flush timed out: 1 events unconfirmed"):
        window.wait_settled(time.monotonic() + 0.05)
    window.settle(["a"])
    window.wait_settled(time.monotonic())


def test_overdue_oldest_is_the_first_unsettled_past_the_timeout() -> None:
    first, second = event(1, sent_at=100.0), event(2, "r", sent_at=103.0)
    assert overdue_oldest([], 200.0, 15.0) is None
    assert overdue_oldest([first, second], 114.0, 15.0) is None
    assert overdue_oldest([first, second], 115.0, 15.0) == (first, 15.0)
    first.settled = True
    assert overdue_oldest([first, second], 115.0, 15.0) is None
    assert overdue_oldest([first, second], 120.0, 15.0) == (second, 17.0)


def test_a_stall_is_reported_after_twice_the_timeout_then_once_per_timeout() -> None:
    clock = StallClock(10.0, now=1000.0)
    assert clock.due(1019.0, unsettled=5) is None
    assert clock.due(1020.0, unsettled=5) == 20.0
    assert clock.due(1025.0, unsettled=5) is None  # reported 5 s ago
    assert clock.due(1030.0, unsettled=5) == 30.0
    clock.settled(1031.0)
    assert clock.due(1045.0, unsettled=5) is None  # quiet for 14 s only
    assert clock.due(1051.0, unsettled=5) == 20.0
    # With nothing owed, the stall starts with the next event.
    clock = StallClock(10.0, now=0.0)
    assert clock.due(500.0, unsettled=0) is None
    assert clock.due(515.0, unsettled=1) is None
    assert clock.due(520.0, unsettled=1) == 20.0


class OpenChannel:
    is_open = True


def test_an_own_channel_has_room_for_one_event_once_ready() -> None:
    own = OwnChannel()
    assert not own.has_room()  # not open yet
    own.channel = OpenChannel()
    assert not own.has_room()  # confirm mode not on yet
    own.ready = True
    assert own.has_room()
    for number in range(STALLED_QUEUE_IN_FLIGHT):
        own.track(event(number + 1))
    assert not own.has_room()
    assert [m.tag for m in own.inflight] == list(range(1, STALLED_QUEUE_IN_FLIGHT + 1))
    assert own.next_tag == STALLED_QUEUE_IN_FLIGHT + 1
