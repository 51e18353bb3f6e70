"""Silent queues, each on a channel of its own; on the producer's I/O thread.

A queue whose confirm was overdue is *silent* until it confirms again, and its events go on a
channel of its own, ``SILENT_QUEUE_IN_FLIGHT`` at a time. RabbitMQ 3.10 registers a channel
with a quorum queue on its first publish there, synchronously, for up to net_ticktime + 5 s
(65 s), and again on the next publish if that timed out: a queue that cannot reach a quorum
froze the whole channel for minutes, and with it every other key of the connection (the
cluster soak: hundreds of queues, no confirm at all, reconnect after reconnect). On a channel
of its own it freezes only itself.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from keyq.broker.connections import describe_exception
from keyq.producer.outgoing import Outgoing, events_in

if TYPE_CHECKING:
    from keyq.producer.link import PublisherLink

log = logging.getLogger("keyq.producer")

SILENT_QUEUE_IN_FLIGHT = 1


@dataclass(slots=True, eq=False)
class AsideChannel:
    """A channel of its own for one silent queue: its events go there one at a time, with
    their own delivery tags, until one is confirmed."""

    channel: Any = None  # set once open
    ready: bool = False  # confirm mode is on
    next_tag: int = 1
    inflight: deque[Outgoing] = field(default_factory=deque)

    def has_room(self) -> bool:
        channel = self.channel
        return (
            channel is not None
            and self.ready
            and channel.is_open
            and len(self.inflight) < SILENT_QUEUE_IN_FLIGHT
        )

    def track(self, message: Outgoing) -> None:
        """``message`` goes out on this channel now: it takes the next delivery tag."""
        message.tag = self.next_tag
        self.next_tag += 1
        self.inflight.append(message)


class SilentQueues:
    """The channels of silent queues (the set of silent queues is ``ConfirmWindow.silent``)."""

    def __init__(self, link: PublisherLink) -> None:
        self._link = link
        self.asides: dict[str, AsideChannel] = {}  # silent queue -> its own channel
        self.channel_resets = 0  # a silent queue's own channel reopened: its confirm overdue

    def channel_for(self, queue: str) -> Any:
        """The silent ``queue``'s own channel if it has room for an event now, else None
        (opening it when there is none yet)."""
        aside = self.asides.get(queue)
        if aside is None:
            self._open(queue)
            return None
        return aside.channel if aside.has_room() else None

    def track(self, queue: str, message: Outgoing) -> None:
        self.asides[queue].track(message)

    def in_flight(self) -> int:
        """Events unconfirmed on the silent queues' own channels (a pack counts each)."""
        return sum(events_in(aside.inflight) for aside in self.asides.values())

    def collect(self) -> list[Outgoing]:
        """After a lost connection: every channel is gone; their unconfirmed events."""
        pending = [
            message
            for aside in self.asides.values()
            for message in aside.inflight
            if not message.settled
        ]
        self.asides.clear()
        return pending

    def _open(self, queue: str) -> None:
        link = self._link
        connection = link.connector.connection
        if connection is None or not connection.is_open or link.connector.stopping:
            return  # its events wait in ``parked``; a reconnect collects them
        aside = self.asides[queue] = AsideChannel()

        def on_open(channel: Any) -> None:
            if self.asides.get(queue) is not aside:
                with contextlib.suppress(Exception):
                    channel.close()
                return
            aside.channel = channel
            channel.add_on_close_callback(lambda _ch, why: self._on_closed(queue, aside, why))
            channel.add_on_return_callback(link.sender.on_return)
            channel.confirm_delivery(
                ack_nack_callback=lambda frame: self._on_confirm(queue, aside, frame),
                callback=lambda _frame: self._on_ready(queue, aside),
            )

        connection.channel(on_open_callback=on_open)

    def _on_ready(self, queue: str, aside: AsideChannel) -> None:
        if self.asides.get(queue) is aside:
            aside.ready = True
            self._link.sender.release_parked(queue)

    def _on_confirm(self, queue: str, aside: AsideChannel, frame: Any) -> None:
        sender = self._link.sender
        if self.asides.get(queue) is aside:
            sender.settle_confirmed(aside.inflight, frame)
        if queue in self._link.window.silent:
            sender.release_parked(queue)  # the next one goes

    def _on_closed(self, queue: str, aside: AsideChannel, reason: BaseException) -> None:
        """Its unconfirmed events go back in front of the queue's parked ones; unless the
        whole connection is going (which collects them), it is opened again a moment later."""
        if self.asides.get(queue) is not aside:
            return  # closed by us, or collected with its connection
        del self.asides[queue]
        link = self._link
        pending = [message for message in aside.inflight if not message.settled]
        aside.inflight.clear()
        if pending:
            link.sender.take_back(queue, pending)
        connection = link.connector.connection
        if link.connector.stopping or connection is None or not connection.is_open:
            return
        log.warning(
            "the channel of silent queue %s closed (%s); opening it again",
            queue,
            describe_exception(reason),
        )
        link.ioloop.call_later(1.0, lambda: link.sender.release_parked(queue))

    def reset_overdue(self, now: float) -> None:
        """A silent queue's event unconfirmed past ``confirm_timeout`` on its own channel: that
        channel is closed (only it), and the event goes again on a fresh one."""
        timeout = self._link.settings.confirm_timeout
        for queue, aside in list(self.asides.items()):
            channel = aside.channel
            if not aside.inflight or channel is None or not channel.is_open:
                continue
            waited = now - aside.inflight[0].sent_at
            if waited < timeout:
                continue
            self.channel_resets += 1
            log.warning(
                "silent queue %s has not confirmed for %.0f s on its own channel; sending "
                "again on a fresh one",
                queue,
                waited,
            )
            with contextlib.suppress(Exception):
                channel.close()

    def close(self, queue: str) -> None:
        """A silent queue confirmed: close its channel once nothing is in flight there."""
        aside = self.asides.get(queue)
        if aside is None or aside.inflight:
            return
        del self.asides[queue]
        if aside.channel is not None and aside.channel.is_open:
            with contextlib.suppress(Exception):
                aside.channel.close()
