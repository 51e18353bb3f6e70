"""Small helpers for reading what really landed in RabbitMQ."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

from keyq.broker.envelope import HEADER_KEY, HEADER_PRODUCER, HEADER_SEQ
from keyq.broker.naming import key_queue_name
from keyq.broker.packs import decode_pack, is_pack
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import ensure_stream_config
from keyq.broker.topology import keyed_queue_arguments
from keyq.worker.amqp.deliveries import Delivery


@dataclass(frozen=True)
class Landed:
    queue: str
    key: str
    producer: str
    seq: int
    body: bytes
    headers: dict[str, Any]
    content_type: str | None
    message_id: str | None

    def json(self) -> Any:
        return orjson.loads(self.body)


def unpacked(
    properties: Any, body: bytes
) -> list[tuple[dict[str, Any], str | None, str | None, bytes]]:
    """A message's events as (headers, content type, message id, body): a pack's, or itself."""
    if is_pack(properties.content_type):
        return [(e.headers, e.content_type, e.message_id, e.body) for e in decode_pack(body)]
    return [(dict(properties.headers or {}), properties.content_type, properties.message_id, body)]


def drain(
    channel: BlockingChannel, queue: str, *, ack: bool = True, limit: int | None = None
) -> list[Landed]:
    """Events now in ``queue`` (those of a pack each on its own, ``keyq.broker.packs``), in
    queue order, from at most ``limit`` messages; acked by default."""
    landed: list[Landed] = []
    messages = 0
    while limit is None or messages < limit:
        method, properties, body = channel.basic_get(queue, auto_ack=False)
        if method is None:
            return landed
        messages += 1
        for headers, content_type, message_id, event_body in unpacked(properties, body):
            key = headers.get(HEADER_KEY)
            key = key.decode() if isinstance(key, bytes) else str(key)
            producer, seq = str(headers.get(HEADER_PRODUCER)), int(headers.get(HEADER_SEQ, -1))
            landed.append(
                Landed(queue, key, producer, seq, event_body, headers, content_type, message_id)
            )
        if ack:
            channel.basic_ack(method.delivery_tag)
    return landed


def queue_depth(connection: BlockingConnection, queue: str) -> int | None:
    """Messages ready in ``queue``, or None if it does not exist."""
    return _on_a_throwaway_channel(
        connection, lambda channel: channel.queue_declare(queue, passive=True).method.message_count
    )


def events_in(connection: BlockingConnection, queue: str) -> int | None:
    """Events now in ``queue`` (a pack's each counted), read unacked, or None if it is missing."""
    return _on_a_throwaway_channel(
        connection, lambda channel: len(drain(channel, queue, ack=False))
    )


def _on_a_throwaway_channel(
    connection: BlockingConnection, read: Callable[[BlockingChannel], int]
) -> int | None:
    """``read`` on a channel of its own (a 404 closes it): None if the queue does not exist."""
    channel = connection.channel()
    try:
        return read(channel)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 404:
            return None
        raise
    finally:
        if channel.is_open:
            channel.close()


def open_keyed_queue(
    stream: Any, connection: BlockingConnection, key: str
) -> tuple[str, BlockingChannel]:
    """``key``'s queue of a key-mode classic stream, declared and registered as a producer
    would, and a confirm-mode channel to publish raw messages to it on."""
    queue = key_queue_name(stream.name, key)
    channel = connection.channel()
    channel.queue_declare(queue, durable=True, arguments=keyed_queue_arguments(stream.name))
    channel.confirm_delivery()
    QueueRegistry(stream.redis, stream.name).register({queue: key})
    ensure_stream_config(stream.redis, stream.name, "key", None, "classic")
    return queue, channel


def settings_with(settings: Settings, **changes: object) -> Settings:
    """``settings`` with some values changed (validated as keyq loads them)."""
    changed: Settings = load_settings(**{**settings.model_dump(), **changes})
    return changed


def poll_until(
    check: Callable[[], object],
    timeout: float,
    every: float,
    failure: Callable[[Exception | None], Exception],
) -> None:
    """Call ``check`` every ``every`` seconds until it returns something true. An exception
    from it is retried; after ``timeout``, raise ``failure(the last one)``."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            last = exc
        time.sleep(every)
    raise failure(last)


def plain_delivery(queue: str, tag: int, epoch: int = 1) -> Delivery:
    """A delivery of consumer ``epoch`` of ``queue`` with no headers, for buffer units."""
    return Delivery(queue, epoch, tag, False, {}, None, None, b"{}")


Item = TypeVar("Item")


def as_applied(items: list[Item], seq: Callable[[Item], int]) -> tuple[list[Item], int]:
    """One key's events in queue order as a worker applies them: each past the last seq kept.
    The others are copies a producer sent again (a confirm that came late, a connection lost
    on a loaded machine); returns what is kept and how many copies were dropped."""
    kept: list[Item] = []
    for item in items:
        if not kept or seq(item) > seq(kept[-1]):
            kept.append(item)
    return kept, len(items) - len(kept)


def sent_again(stats: Mapping[str, int]) -> int:
    """How many events a producer's stats say it published more than once."""
    return stats["late_confirms"] + stats["returned"] + stats["resent"]
