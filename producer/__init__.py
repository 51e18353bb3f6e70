"""keyq's producer SDK: ``from producer import Producer``."""

from broker.errors import (
    InvalidEvent,
    InvalidHeaders,
    InvalidKey,
    KeyqError,
    MessageTooLarge,
    ProducerClosed,
    PublishError,
    PublishTimeout,
)
from producer.producer import Producer, Receipt

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
