"""The bookkeeping of ``keyq.producer.declarers``: which declaration stopped a channel, which
waited behind it, and a replacement channel. Pure logic, so fake channels stand in; the real
broker's side is in tests/test_connection_failures.py and tests/test_producer_order.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keyq.producer import declarers
from keyq.producer.declarers import DECLARING_CHANNELS, Declarers


class FakeChannel:
    def __init__(self, number: int) -> None:
        self.channel_number = number
        self.is_open = True
        self.asked: list[tuple[str, Callable[[Any], None]]] = []
        self.on_close: list[Callable[[Any, BaseException], None]] = []

    def add_on_close_callback(self, callback: Callable[[Any, BaseException], None]) -> None:
        self.on_close.append(callback)

    def queue_declare(self, queue: str, **kwargs: Any) -> None:
        self.asked.append((queue, kwargs["callback"]))

    def close(self) -> None:
        self.is_open = False
        for callback in self.on_close:
            callback(self, RuntimeError("closed by the client"))


class FakeConnection:
    def __init__(self) -> None:
        self.channels: list[FakeChannel] = []

    def channel(self, on_open_callback: Callable[[Any], None]) -> None:
        opened = FakeChannel(len(self.channels) + 1)
        self.channels.append(opened)
        on_open_callback(opened)


def test_declarations_take_turns_and_an_overdue_channel_is_replaced(monkeypatch: Any) -> None:
    clock = [100.0]
    monkeypatch.setattr(declarers.time, "monotonic", lambda: clock[0])
    connection = FakeConnection()
    closed_by_broker: list[Any] = []
    pool = Declarers(connection, lambda channel, _reason: closed_by_broker.append(channel))  # type: ignore[arg-type]
    answered: list[str] = []
    for n in range(2 * DECLARING_CHANNELS):
        assert pool.declare(f"q{n}", {}, lambda n=n: answered.append(f"q{n}"))
    first = connection.channels[0]
    assert [queue for queue, _ in first.asked] == ["q0", f"q{DECLARING_CHANNELS}"]

    # Every channel but the first answers; the first's oldest declaration never does.
    for channel in connection.channels[1:]:
        for _queue, callback in channel.asked:
            callback(None)
    clock[0] += 5
    assert pool.overdue(10.0).stuck == []  # not overdue yet
    clock[0] += 6
    overdue = pool.overdue(10.0)
    assert overdue.stuck == ["q0"]
    assert overdue.behind == [f"q{DECLARING_CHANNELS}"]
    assert not first.is_open
    assert closed_by_broker == []  # closed on purpose: the producer does not reconnect for it
    assert len(connection.channels) == DECLARING_CHANNELS + 1  # a replacement was opened
    assert pool.overdue(10.0).stuck == []

    # A late answer on the closed channel changes nothing; the next declarations avoid it.
    first.asked[0][1](None)
    assert "q0" in answered
    for n in range(DECLARING_CHANNELS):
        pool.declare(f"later{n}", {}, lambda: None)
    assert len(first.asked) == 2


def test_a_channel_the_broker_closes_is_reported_and_with_none_open_the_publisher_declares() -> (
    None
):
    connection = FakeConnection()
    reported: list[Any] = []
    pool = Declarers(connection, lambda channel, _reason: reported.append(channel))  # type: ignore[arg-type]
    connection.channels[1].close()
    assert reported == [connection.channels[1]]
    for n in range(2 * DECLARING_CHANNELS):
        pool.declare(f"q{n}", {}, lambda: None)
    assert connection.channels[1].asked == []
    # No open channel left: the publishing channel declares.
    for channel in list(connection.channels):
        channel.is_open = False
    assert not pool.declare("q", {}, lambda: None)


def test_time_queued_behind_answered_declarations_is_not_overdue(monkeypatch: Any) -> None:
    """A channel with thousands of declarations queued answers them one after another: only
    the time since the last answer counts, not how long the oldest has been queued."""
    clock = [100.0]
    monkeypatch.setattr(declarers.time, "monotonic", lambda: clock[0])
    connection = FakeConnection()
    pool = Declarers(connection, lambda _channel, _reason: None)  # type: ignore[arg-type]
    for n in range(40 * DECLARING_CHANNELS):
        pool.declare(f"q{n}", {}, lambda: None)
    for step in range(39):
        clock[0] += 1.0  # each channel answers one declaration a second
        for channel in connection.channels:
            channel.asked[step][1](None)
        assert pool.overdue(10.0) == declarers.Overdue([], [])
