"""keyq's asyncio producer: ``from keyq.aio import Producer``.

The same window, I/O thread and guarantees as ``keyq.Producer``, driven from an event loop
without ever blocking it::

    async with Producer("orders", mode="key") as producer:
        receipt = await producer.publish("order-17", {"type": "created"})
        await receipt  # this one event is durable (optional)
        await producer.flush()

The errors are keyq's own (``keyq.broker.errors``), the same the threaded producer raises.
"""

from keyq.broker.errors import (
    InvalidEvent,
    InvalidHeaders,
    InvalidKey,
    KeyqError,
    MessageTooLarge,
    ProducerClosed,
    PublishError,
    PublishTimeout,
)
from keyq.producer.async_producer import AsyncProducer as Producer
from keyq.producer.async_producer import AsyncReceipt as Receipt

__all__ = [
    "InvalidEvent",
    "InvalidHeaders",
    "InvalidKey",
    "KeyqError",
    "MessageTooLarge",
    "Producer",
    "ProducerClosed",
    "PublishError",
    "PublishTimeout",
    "Receipt",
]
