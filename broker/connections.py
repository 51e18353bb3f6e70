"""Opening connections, and turning pika and redis errors into keyq's error tree.

Errors name the service and its URL without the password; library exception text is scrubbed
of the password too, and the original exception is not chained where it could carry it.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pika
import pika.exceptions
import redis
import redis.exceptions
from pika.adapters.utils import connection_workflow

from keyq.broker.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    ConfigurationError,
    KeyqError,
    RedisUnavailable,
)
from keyq.broker.redis_topology import connect, parse_redis_url
from keyq.broker.settings import Settings
from keyq.broker.urls import redact_url, scrub, split_urls

# Which of several AMQP URLs the next connection takes: each node in turn, process-wide,
# starting at a node of the process's own, so that processes spread over the nodes too.
_next_node = itertools.count(random.randrange(1 << 16))


def amqp_parameters(settings: Settings, name: str) -> pika.URLParameters:
    """Connection parameters with keyq's short heartbeats and bounded connect time. With
    several URLs (a cluster's nodes), each call takes the next, from a random first one:
    connections spread over the nodes, and every reconnect tries another node than the one
    just lost."""
    urls = split_urls(settings.amqp_url)
    url = urls[next(_next_node) % len(urls)]
    try:
        params = pika.URLParameters(url)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # malformed URL parts
        reason = scrub(str(exc), settings.amqp_url)
        raise ConfigurationError(
            f"KEYQ_AMQP_URL {redact_url(settings.amqp_url)!r} is invalid: {reason}"
        ) from None
    params.heartbeat = settings.amqp_heartbeat
    params.socket_timeout = settings.connect_timeout
    params.stack_timeout = handshake_timeout(settings)
    params.blocked_connection_timeout = None
    params.connection_attempts = 1
    params.client_properties = {
        "connection_name": f"keyq-{name}@{socket.gethostname()}:{os.getpid()}",
        "product": "keyq",
    }
    return params


def handshake_timeout(settings: Settings) -> float:
    """Seconds a connection attempt may take from TCP connect to an open AMQP connection
    (pika's stack timeout): twice ``connect_timeout``, which bounds the TCP connect alone."""
    return settings.connect_timeout * 2


_REFUSAL = re.compile(r"\b(403|530)\b|ACCESS_REFUSED|NOT_ALLOWED")
# What pika 1.x says when its stack timeout ends an attempt after TCP connected: a blocking
# connection raises AMQPConnectorStackTimeout ("Timeout during AMQP handshake…", or "…while
# setting up transport…" for TLS); an asynchronous one (the producer's) reports the
# connection it closed itself, ConnectionOpenAborted with "Timeout while setting up AMQP…".
_STACK_TIMEOUT = re.compile(r"Timeout (during AMQP handshake|while setting up (AMQP|transport))")


def _handshake_stalled(causes: list[BaseException]) -> str | None:
    """Which handshake a broker that accepted TCP never completed ("AMQP" or "TLS"), if that
    is why the attempt failed. A TCP connect that timed out is not one (nothing accepted it)."""
    if any(isinstance(c, connection_workflow.AMQPConnectorSocketConnectError) for c in causes):
        return None
    for cause in causes:
        timed_out = isinstance(cause, connection_workflow.AMQPConnectorStackTimeout) or (
            isinstance(cause, pika.exceptions.ConnectionOpenAborted)
            and _STACK_TIMEOUT.search(str(cause)) is not None
        )
        if timed_out:
            return "TLS" if "transport" in str(cause) else "AMQP"
    return None


def amqp_failure(exc: BaseException, url: str, *, handshake_s: float | None = None) -> KeyqError:
    """The keyq error for a failure to connect to, or a loss of, RabbitMQ. ``handshake_s``,
    the attempt's stack timeout, is named when the broker accepted TCP but did not finish
    the handshake in it."""
    causes = _flatten(exc)
    shown = redact_url(url)
    stalled = _handshake_stalled(causes)
    if stalled is not None:
        within = "in time" if handshake_s is None else f"in {handshake_s:g} s"
        return BrokerUnavailable(
            f"RabbitMQ at {shown} accepted the connection but did not complete the {stalled} "
            f"handshake {within} (a broker that is overloaded or stuck)"
        )
    # pika calls any connection lost during the login "probable" refusal; only the broker's
    # own answer (403 / 530) is one. A handshake cut short (a broker starting or stopping, a
    # slow link) is the broker being unavailable, and is retried.
    said_no = any(_REFUSAL.search(str(cause)) for cause in causes)
    if any(isinstance(cause, pika.exceptions.AuthenticationError) for cause in causes) or (
        said_no
        and any(isinstance(cause, pika.exceptions.ProbableAuthenticationError) for cause in causes)
    ):
        return AuthenticationFailed(
            f"RabbitMQ at {shown} refused the credentials (check user and password)"
        )
    denied = any(isinstance(cause, pika.exceptions.ProbableAccessDeniedError) for cause in causes)
    if denied and said_no:
        return AuthenticationFailed(
            f"RabbitMQ at {shown} denied access to the virtual host (check the vhost and "
            "the user's permissions)"
        )
    for cause in causes:
        closed = isinstance(cause, pika.exceptions.ConnectionClosedByBroker)
        if closed and getattr(cause, "reply_code", None) in (403, 530):
            text = scrub(str(cause), url)
            return AuthenticationFailed(f"RabbitMQ at {shown} refused access: {text}")
    root = next((cause for cause in reversed(causes) if isinstance(cause, OSError)), causes[-1])
    reason = scrub(describe_exception(root), url)
    return BrokerUnavailable(f"cannot reach RabbitMQ at {shown}: {reason}")


def _flatten(exc: BaseException, depth: int = 0) -> list[BaseException]:
    """``exc`` and every exception nested in it (pika wraps socket errors several deep)."""
    found = [exc]
    if depth > 5:
        return found
    nested: list[BaseException] = list(getattr(exc, "exceptions", None) or [])
    nested.extend(arg for arg in getattr(exc, "args", ()) if isinstance(arg, BaseException))
    for attribute in ("exception", "__cause__", "__context__"):
        inner = getattr(exc, attribute, None)
        if isinstance(inner, BaseException):
            nested.append(inner)
    for inner in nested:
        if inner is not exc:
            found.extend(_flatten(inner, depth + 1))
    return found


def describe_exception(exc: BaseException) -> str:
    text = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def open_blocking_connection(settings: Settings, name: str) -> pika.BlockingConnection:
    """A blocking connection for control work (worker, janitor, tools). With several nodes,
    each is tried once, from the next in turn, before the broker counts as unavailable: one
    node down must not fail the call. Refused credentials fail at once."""
    failure: KeyqError | None = None
    for _ in split_urls(settings.amqp_url):
        params = amqp_parameters(settings, name)
        try:
            return pika.BlockingConnection(params)
        except (
            pika.exceptions.AMQPError,
            connection_workflow.AMQPConnectorException,  # e.g. the handshake's stack timeout
            OSError,
        ) as exc:
            failure = amqp_failure(exc, settings.amqp_url, handshake_s=handshake_timeout(settings))
        except ValueError as exc:
            # pika raises ValueError when the socket is reset between connect() and its
            # getpeername() check: the broker went away mid-connect, not bad input.
            failure = amqp_failure(
                OSError(f"connection reset while connecting: {exc}"), settings.amqp_url
            )
        if not failure.retryable:
            break  # refused credentials: the next node would refuse them too
    assert failure is not None  # split_urls of a validated setting is never empty
    raise failure


def open_redis(
    settings: Settings, *, check: bool = True, client_name: str | None = None
) -> redis.Redis:
    """A Redis client with bounded timeouts; ``check`` pings so bad URLs fail here.

    ``client_name`` names every connection of the client (``CLIENT SETNAME``), which lets
    peers see whether this process still has a connection open.
    """
    url = settings.redis_url
    target = parse_redis_url(url)
    try:
        with redis_errors(url):  # a cluster client asks its nodes for the slots at once
            client = connect(
                target,
                decode_responses=True,
                socket_timeout=max(settings.connect_timeout, 1.0),
                socket_connect_timeout=settings.connect_timeout,
                health_check_interval=15,
                client_name=client_name,
            )
    except (ValueError, redis.exceptions.RedisError) as exc:
        reason = scrub(str(exc), url)
        raise ConfigurationError(
            f"KEYQ_REDIS_URL {redact_url(url)!r} is invalid: {reason}"
        ) from None
    if check:
        with redis_errors(url):
            client.ping()
    return client


# What a Cluster or Sentinel client raises while a primary fails over (a slot uncovered or
# moved, a former primary that is a replica now): the service is away for a moment.
FAILING_OVER: tuple[type[Exception], ...] = (
    redis.exceptions.ClusterError,
    redis.exceptions.RedisClusterException,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.AskError,
    redis.exceptions.TryAgainError,
)

_REDIS_AWAY: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.AuthenticationError,
    OSError,
    *FAILING_OVER,
)


def redis_failure(exc: BaseException, url: str) -> KeyqError:
    shown = redact_url(url)
    reason = scrub(describe_exception(exc), url)
    if (
        isinstance(exc, redis.exceptions.AuthenticationError)
        or "WRONGPASS" in reason
        or ("NOAUTH" in reason)
    ):
        return AuthenticationFailed(f"Redis at {shown} refused the credentials: {reason}")
    return RedisUnavailable(f"cannot reach Redis at {shown}: {reason}")


@contextmanager
def redis_errors(url: str) -> Iterator[None]:
    """Translate connection-level redis errors raised inside the block."""
    try:
        yield
    except _REDIS_AWAY as exc:
        raise redis_failure(exc, url) from None
    except redis.exceptions.ResponseError as exc:
        if any(word in str(exc) for word in ("NOAUTH", "WRONGPASS", "NOPERM")):
            raise redis_failure(exc, url) from None
        raise
