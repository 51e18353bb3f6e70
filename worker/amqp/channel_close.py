"""Closing a consuming channel without a moment in which its queue looks unused.

pika's ``BlockingChannel.close()`` first cancels the channel's consumers and waits for the
broker's cancel-ok, and only then sends ``channel.close``. Between the two, the queue has no
consumer while this channel still holds its unacked deliveries, and RabbitMQ's
``queue.delete(if_empty, if_unused)`` counts neither: it sees no ready message and no
consumer, deletes the queue, and the unacked messages go with it. A janitor deleting idle
queues hits that window whenever a worker stops a queue whose lock it has just lost.

Closing the channel with its consumers still registered lets the broker drop the consumer
and requeue the unacked messages in one step of the queue's own process, so the queue is
never both consumer-less and holding our deliveries. pika has no public way to skip the
cancels: this module marks the consumers as already cancelled and closes the channel beneath
pika's blocking wrapper. ``tests/test_consumer_close.py`` pins the pika internals used here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

CLOSE_TEXT = "keyq: consumer stopped"


def close_keeping_consumers(channel: BlockingChannel) -> None:
    """Close ``channel`` without cancelling its consumers first (see the module doc).

    Raises pika's errors if the close cannot be sent or the connection fails meanwhile; a
    channel that is already closed or closing is left alone.
    """
    close_all_keeping_consumers([channel])


def close_all_keeping_consumers(channels: Sequence[BlockingChannel]) -> None:
    """Close every channel of ``channels`` (all of one connection) as
    ``close_keeping_consumers`` does, with the round trip of one: every ``channel.close``
    is sent, then the replies are awaited together. A worker handing back hundreds of idle
    queues at a batch boundary would otherwise wait for the broker once per queue.

    A channel whose close cannot be sent does not keep the others open: they are closed,
    then the first such error is raised. Raises pika's connection errors if the connection
    fails meanwhile; channels already closed or closing are left alone.
    """
    sent: list[BlockingChannel] = []
    refused: Exception | None = None
    try:
        for channel in channels:
            if not channel.is_open:
                continue
            impl: Any = channel._impl
            # pika sends no basic.cancel on close for tags it believes cancelled. The
            # blocking wrapper keeps its own record of them until the close completes (a
            # cancel the broker sends meanwhile is looked up there), so its close, which
            # would cancel, is bypassed.
            impl._cancelled.update(impl._consumers)
            try:
                impl.close(200, CLOSE_TEXT)
            except pika.exceptions.AMQPError as exc:
                refused = refused or exc
                continue
            sent.append(channel)
        if sent:
            connection: Any = sent[0].connection
            connection._flush_output(lambda: all(channel.is_closed for channel in sent))
    finally:
        for channel in sent:
            # Drops deliveries read but not yet handed to the callback: unacked like the
            # rest, the close gives them back to the queue.
            blocking: Any = channel
            blocking._cleanup()
    if refused is not None:
        raise refused
