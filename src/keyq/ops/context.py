"""What every operator command starts from: the settings, Redis, the stream's recorded config
(a stream nothing has used yet is bad input, exit 2), and RabbitMQ once it is needed."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import pika
import pika.exceptions
import redis

from keyq.broker.connections import amqp_failure, open_blocking_connection, open_redis, redis_errors
from keyq.broker.errors import InvalidInput
from keyq.broker.naming import check_stream_name, encode_key
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import StreamConfig, load_stream_config


class StreamNotKnown(InvalidInput):
    """No config is recorded for the stream: nothing ever produced to it."""


def check_keys(keys: Iterator[str] | list[str] | tuple[str, ...]) -> list[str]:
    """Keys as given, each checked as a producer would (``InvalidKey`` names the bad one)."""
    checked: list[str] = []
    for key in keys:
        try:
            encode_key(key)
        except InvalidInput as exc:
            raise type(exc)(f"key {key!r}: {exc}") from None
        checked.append(key)
    return checked


def keys_in_file(path: str) -> list[str]:
    """The keys of a keys file (``-``: stdin), one a line, blank lines left out. A key's own
    spaces are kept: a key may begin or end with one."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise InvalidInput(f"cannot read the keys file {path}: {reason}") from None
    return [line.rstrip("\r") for line in text.split("\n") if line.strip()]


def read_keys(keys: tuple[str, ...], keys_file: str | None) -> list[str]:
    """The keys of ``--key`` and ``--keys-file`` together, in order, each once, checked."""
    named = list(keys)
    if keys_file is not None:
        named += keys_in_file(keys_file)
    return list(dict.fromkeys(check_keys(named)))


class OperatorContext:
    """Connections of one command on one stream; ``with`` closes them."""

    def __init__(self, stream: str, settings: Settings | None = None) -> None:
        self.stream = check_stream_name(stream)
        self.keys = StreamKeys(self.stream)
        self.settings = settings if settings is not None else load_settings()
        self.redis: redis.Redis = open_redis(self.settings)
        self._connection: pika.BlockingConnection | None = None
        try:
            with redis_errors(self.settings.redis_url):
                config = load_stream_config(self.redis, self.stream)
        except BaseException:
            self.close()
            raise
        if config is None:
            self.close()
            raise StreamNotKnown(f"stream {self.stream} does not exist")
        self.config: StreamConfig = config

    def amqp(self) -> pika.BlockingConnection:
        if self._connection is None or not self._connection.is_open:
            self._connection = open_blocking_connection(self.settings, f"keyq-ops-{self.stream}")
        return self._connection

    @contextlib.contextmanager
    def services(self) -> Iterator[None]:
        """Translate RabbitMQ's and Redis' connection errors inside the block into keyq's."""
        try:
            with redis_errors(self.settings.redis_url):
                yield
        except (pika.exceptions.AMQPError, OSError) as exc:
            raise amqp_failure(exc, self.settings.amqp_url) from None

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and connection.is_open:
            with contextlib.suppress(Exception):
                connection.close()
        with contextlib.suppress(Exception):
            self.redis.close()

    def __enter__(self) -> OperatorContext:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
