"""Acks of many consuming channels, written to the socket together.

pika's ``BlockingChannel.basic_ack`` flushes the connection after each ack: a poll and a send
per ack. A key-mode batch settles hundreds of queues, each on a channel of its own, so a batch
cost hundreds of round trips through the event loop for frames that fit in one write. Here the
acks go into the connection's outgoing buffer, as ``basic_ack`` puts them there, and one flush
sends them all. ``tests/test_consume_rounds.py`` exercises it on the real broker.
"""

from __future__ import annotations

from typing import Any

import pika
from pika.adapters.blocking_connection import BlockingChannel


def buffer_ack(channel: BlockingChannel, delivery_tag: int, multiple: bool) -> None:
    """``basic.ack`` queued on the connection, sent by the next ``flush_acks``."""
    blocking: Any = channel
    blocking._impl.basic_ack(delivery_tag=delivery_tag, multiple=multiple)


def flush_acks(connection: pika.BlockingConnection) -> None:
    """Send everything queued (raises pika's errors if the connection is gone)."""
    blocking: Any = connection
    blocking._flush_output()
