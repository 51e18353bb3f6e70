"""keyq: keyed event streams on RabbitMQ, processed in order with Apache Spark.

The public API is ``from keyq import Producer, Worker, Janitor`` and the errors below. The
internals live in ``keyq.broker``, ``keyq.producer``, ``keyq.worker`` and ``keyq.janitor``.
Names resolve on first use, so a producer's ``from keyq import Producer`` does not import
Spark, and ``import keyq.broker`` imports nothing else. ``Worker``, ``BatchContext`` and
``KeyedState`` need the worker extra (``pip install 'keyq[worker]'``).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("keyq")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

if TYPE_CHECKING:
    from keyq.broker.errors import (
        AuthenticationFailed,
        BrokerUnavailable,
        CommitNotReplicated,
        CommitRefused,
        ConfigurationError,
        ConnectionFailed,
        HttpEndpointUnavailable,
        InvalidEvent,
        InvalidHeaders,
        InvalidInput,
        InvalidKey,
        InvalidStreamName,
        KeyqError,
        KeysStopped,
        LockLost,
        ManagementUnavailable,
        MessageTooLarge,
        PipelineError,
        ProducerClosed,
        PrometheusFormatError,
        PrometheusUnavailable,
        PublishError,
        PublishTimeout,
        RedisUnavailable,
        ServiceUnavailable,
        SparkUnavailable,
        StreamConfigMismatch,
        TopologyError,
    )
    from keyq.broker.naming import Mode
    from keyq.broker.settings import Settings, load_settings
    from keyq.janitor.janitor import Janitor
    from keyq.producer.producer import Producer
    from keyq.producer.receipt import Receipt
    from keyq.worker.daemon import Worker
    from keyq.worker.pipeline import BatchContext, KeyedState

__all__ = [
    "AuthenticationFailed",
    "BatchContext",
    "BrokerUnavailable",
    "CommitNotReplicated",
    "CommitRefused",
    "ConfigurationError",
    "ConnectionFailed",
    "HttpEndpointUnavailable",
    "InvalidEvent",
    "InvalidHeaders",
    "InvalidInput",
    "InvalidKey",
    "InvalidStreamName",
    "Janitor",
    "KeyedState",
    "KeyqError",
    "KeysStopped",
    "LockLost",
    "ManagementUnavailable",
    "MessageTooLarge",
    "Mode",
    "PipelineError",
    "Producer",
    "ProducerClosed",
    "PrometheusFormatError",
    "PrometheusUnavailable",
    "PublishError",
    "PublishTimeout",
    "Receipt",
    "RedisUnavailable",
    "ServiceUnavailable",
    "Settings",
    "SparkUnavailable",
    "StreamConfigMismatch",
    "TopologyError",
    "Worker",
    "load_settings",
]

# Where each public name is defined: the errors in keyq.broker.errors, the rest here.
_ELSEWHERE: dict[str, str] = {
    "Mode": "keyq.broker.naming",
    "Settings": "keyq.broker.settings",
    "load_settings": "keyq.broker.settings",
    "Producer": "keyq.producer.producer",
    "Receipt": "keyq.producer.producer",
    "Worker": "keyq.worker.daemon",
    "BatchContext": "keyq.worker.pipeline",
    "KeyedState": "keyq.worker.pipeline",
    "Janitor": "keyq.janitor.janitor",
}
_HOMES: dict[str, str] = {name: _ELSEWHERE.get(name, "keyq.broker.errors") for name in __all__}


if not TYPE_CHECKING:  # type checkers see the imports above, so a misspelt name is an error

    def __getattr__(name: str) -> Any:
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module 'keyq' has no attribute {name!r}")
        try:
            module = importlib.import_module(home)
        except ModuleNotFoundError as exc:
            from keyq.extras import WORKER_EXTRA, is_worker_module  # noqa: PLC0415 - rare path

            if not is_worker_module(exc.name):
                raise
            raise ModuleNotFoundError(
                f"keyq.{name} needs Spark ({exc.name} is not installed): {WORKER_EXTRA}",
                name=exc.name,
            ) from exc
        value = getattr(module, name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
