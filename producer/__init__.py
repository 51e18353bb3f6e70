"""keyq's producer SDK; users import it as ``from keyq import Producer``."""

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
from keyq.producer.producer import Producer
from keyq.producer.receipt import Receipt

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
