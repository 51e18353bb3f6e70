"""Stalled queues, each on a channel of its own; on the producer's I/O thread.

A queue whose confirm (or declaration) was overdue is *stalled* until it confirms again, and
its events go on a channel of its own, ``STALLED_QUEUE_IN_FLIGHT`` at a time. RabbitMQ 3.10
registers a channel with a quorum queue on its first publish there, synchronously, for up to
net_ticktime + 5 s (65 s), and again on the next publish if that timed out: a queue that
cannot reach a quorum froze the whole channel for minutes, and with it every other key of the
connection (the cluster soak: hundreds of queues, no confirm at all, reconnect after
reconnect). On a channel of its own it freezes only itself.

``OwnChannels`` is what the publisher sends through; ``StalledQueues`` opens those channels
(as soon as a queue stalls, and on each new connection) and handles what they answer.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from keyq.broker.connections import describe_exception
from keyq.producer.context import IoContext
from keyq.producer.ledger import ConfirmLedger
from keyq.producer.outgoing import Outgoing, events_in

log = logging.getLogger("keyq.producer")

STALLED_QUEUE_IN_FLIGHT = 1
REOPEN_AFTER_S = 1.0

Confirmed = Callable[[deque[Outgoing], Any, Callable[[str], None]], None]


@dataclass(slots=True, eq=False)
class OwnChannel:
    """A channel of its own for one stalled queue: its events go there one at a time, with
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
            and len(self.inflight) < STALLED_QUEUE_IN_FLIGHT
        )

    def track(self, message: Outgoing) -> None:
        """``message`` goes out on this channel now: it takes the next delivery tag."""
        message.tag = self.next_tag
        self.next_tag += 1
        self.inflight.append(message)


class OwnChannels(dict[str, OwnChannel]):
    """The stalled queues' own channels (the set of stalled queues is
    ``ConfirmWindow.stalled``)."""

    def channel_for(self, queue: str) -> Any:
        """The stalled ``queue``'s own channel if it has room for an event now, else None."""
        own = self.get(queue)
        return own.channel if own is not None and own.has_room() else None

    def track(self, queue: str, message: Outgoing) -> None:
        self[queue].track(message)

    def in_flight(self) -> int:
        """Events unconfirmed on the stalled queues' own channels (a pack counts each)."""
        return sum(events_in(own.inflight) for own in self.values())

    def collect(self) -> list[Outgoing]:
        """After a lost connection: every channel is gone; their unconfirmed events."""
        pending = [m for own in self.values() for m in own.inflight if not m.settled]
        self.clear()
        return pending


class StalledQueues:
    """Opens and resets the stalled queues' own channels, and settles what they confirm."""

    def __init__(
        self,
        ctx: IoContext,
        own: OwnChannels,
        *,
        ledger: ConfirmLedger,
        confirmed: Confirmed,  # ``Recovery.confirmed``
        take_back: Callable[[str, list[Outgoing]], None],  # ``Recovery.take_back``
        release: Callable[[str], None],  # ``Publisher.release``
    ) -> None:
        self._ctx = ctx
        self.own = own
        self._ledger = ledger
        self._confirmed = confirmed
        self._take_back = take_back
        self._release = release
        self.channel_resets = 0  # a stalled queue's own channel reopened: its confirm overdue

    def open_all(self) -> None:
        """On a new connection: a channel for each queue still stalled."""
        for queue in sorted(self._ctx.window.stalled):
            self.open(queue)

    def open(self, queue: str) -> None:
        """Open ``queue``'s own channel; its events go once confirm mode is on there."""
        ctx = self._ctx
        connection = ctx.connection
        if queue in self.own or connection is None or not connection.is_open or ctx.stopping:
            return  # its events wait in its lane; a reconnect collects them
        own = self.own[queue] = OwnChannel()

        def on_open(channel: Any) -> None:
            if self.own.get(queue) is not own:
                with contextlib.suppress(Exception):
                    channel.close()
                return
            own.channel = channel
            channel.add_on_close_callback(lambda _ch, why: self._on_closed(queue, own, why))
            channel.add_on_return_callback(self._ledger.on_return)
            channel.confirm_delivery(
                ack_nack_callback=lambda frame: self._on_confirm(queue, own, frame),
                callback=lambda _frame: self._on_ready(queue, own),
            )

        connection.channel(on_open_callback=on_open)

    def _on_ready(self, queue: str, own: OwnChannel) -> None:
        if self.own.get(queue) is own:
            own.ready = True
            self._release(queue)

    def _on_confirm(self, queue: str, own: OwnChannel, frame: Any) -> None:
        if self.own.get(queue) is own:
            self._confirmed(own.inflight, frame, self.heard_again)
        if queue in self._ctx.window.stalled:
            self._release(queue)  # the next one goes

    def heard_again(self, queue: str) -> None:
        """A stalled queue confirmed: its channel closes once nothing is in flight there,
        and its waiting events go on the publishing channel."""
        own = self.own.get(queue)
        if own is not None and not own.inflight:
            del self.own[queue]
            if own.channel is not None and own.channel.is_open:
                with contextlib.suppress(Exception):
                    own.channel.close()
        self._release(queue)

    def _on_closed(self, queue: str, own: OwnChannel, reason: BaseException) -> None:
        """Its unconfirmed events go back in front of the queue's waiting ones; unless the
        whole connection is going (which collects them), it is opened again a moment later."""
        if self.own.get(queue) is not own:
            return  # closed by us, or collected with its connection
        del self.own[queue]
        pending = [message for message in own.inflight if not message.settled]
        own.inflight.clear()
        if pending:
            self._take_back(queue, pending)
        if self._ctx.stopping or not self._ctx.connected:
            return
        log.warning(
            "the channel of stalled queue %s closed (%s); opening it again",
            queue,
            describe_exception(reason),
        )
        self._ctx.ioloop.call_later(REOPEN_AFTER_S, lambda: self._reopen(queue))

    def _reopen(self, queue: str) -> None:
        if queue in self._ctx.window.stalled:
            self.open(queue)
        else:
            self._release(queue)

    def reset_overdue(self, now: float) -> None:
        """A stalled queue's event unconfirmed past ``confirm_timeout`` on its own channel:
        that channel is closed (only it), and the event goes again on a fresh one."""
        timeout = self._ctx.settings.confirm_timeout
        for queue, own in list(self.own.items()):
            channel = own.channel
            if not own.inflight or channel is None or not channel.is_open:
                continue
            waited = now - own.inflight[0].sent_at
            if waited < timeout:
                continue
            self.channel_resets += 1
            log.warning(
                "stalled queue %s has not confirmed for %.0f s on its own channel; sending "
                "again on a fresh one",
                queue,
                waited,
            )
            with contextlib.suppress(Exception):
                channel.close()
