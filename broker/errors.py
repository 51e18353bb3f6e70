"""One error tree for keyq.

Library errors (pika, redis) are wrapped at the boundary into these, so callers catch
``KeyqError`` and never see a credential in a message. The tree says what a retry can cure:
a retry loop catches ``ServiceUnavailable`` (or asks ``exc.retryable``), never
``ConnectionFailed``, so refused credentials are never retried forever.
"""

from __future__ import annotations

from typing import ClassVar


class KeyqError(Exception):
    """Base of every error keyq raises on purpose."""

    retryable: ClassVar[bool] = False
    """Whether the same call may succeed later without anything being changed."""


class ConfigurationError(KeyqError, ValueError):
    """Settings that can never work (a malformed URL, a bad option); retrying will not help."""


class StreamConfigMismatch(ConfigurationError):
    """A producer or worker asked for a mode or bucket count other than the stream's."""


class InvalidInput(KeyqError, ValueError):
    """Input rejected before anything was sent, so nothing is lost or half-published."""


class InvalidStreamName(InvalidInput):
    """Stream names become part of queue names and Redis hash tags, so they are restricted."""


class InvalidKey(InvalidInput):
    """A key that is not a non-empty string of at most the allowed UTF-8 length."""


class InvalidEvent(InvalidInput):
    """An event that cannot be serialised to JSON, or is of an unsupported type."""


class InvalidHeaders(InvalidInput):
    """Headers that are not a string-keyed mapping, or that use keyq's reserved prefix."""


class MessageTooLarge(InvalidInput):
    """An encoded message above the configured size limit."""


class ConnectionFailed(KeyqError):
    """A service could not be reached, dropped us, or refused us; the message names it without
    password. Whether to retry depends on the subclass: ``ServiceUnavailable`` is retryable,
    ``AuthenticationFailed`` is not."""


class ServiceUnavailable(ConnectionFailed):
    """A service is down, dropped us, or is too slow to answer: it may be back later, so this
    (and only this) kind of connection failure is retried."""

    retryable: ClassVar[bool] = True


class BrokerUnavailable(ServiceUnavailable):
    """RabbitMQ could not be reached, or the connection was lost and not recovered in time."""


class RedisUnavailable(ServiceUnavailable):
    """Redis could not be reached or answered with a connection-level error."""


class CommitNotReplicated(RedisUnavailable):
    """Fewer Redis replicas than required confirmed a commit in time. Its events are not
    acked: the batch runs again, finds them applied (or, after a failover that lost the
    commit, applies them again), and acks once a commit is confirmed."""


class HttpEndpointUnavailable(ServiceUnavailable):
    """An HTTP endpoint of the broker did not answer, refused us, or answered with something
    keyq cannot read; ``status`` is the HTTP status it answered with, if it did."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ManagementUnavailable(HttpEndpointUnavailable):
    """RabbitMQ's management API is not configured, not reachable, or refused us: what only it
    reports (file descriptors, the queue list) is unknown, and keyq carries on without it."""


class PrometheusUnavailable(HttpEndpointUnavailable):
    """No node's ``rabbitmq_prometheus`` endpoint answered with its metrics: the figures read
    there (queue depths and consumers, file descriptors, the queue list) come from elsewhere
    or are unknown, and keyq carries on without them."""


class PrometheusFormatError(KeyqError, ValueError):
    """A line that is not in Prometheus's text exposition format."""


class AuthenticationFailed(ConnectionFailed):
    """The service refused the credentials or the vhost; retrying will not help, so it is a
    ``ConnectionFailed`` but not a ``ServiceUnavailable``."""


class TopologyError(KeyqError):
    """The broker refused a queue declaration (e.g. a queue of that name exists with other
    arguments), so events for that queue cannot be published."""


class PublishError(KeyqError):
    """Events could not be confirmed by the broker."""


class PublishTimeout(PublishError, TimeoutError):
    """Backpressure (full in-flight window or broker flow control) outlasted the timeout, or
    ``flush`` did not see every event confirmed in time. Nothing was dropped: unconfirmed
    events are still being retried until ``close``."""


class ProducerClosed(PublishError):
    """The producer is closed, or failed for good; see ``__cause__`` for why."""


class LockLost(KeyqError):
    """A fenced lock is no longer ours: stop work on that queue, commit nothing."""


class PipelineError(KeyqError):
    """A pipeline (user code or its Spark job) failed on a batch; the batch is retried, then
    the message that makes it fail is isolated and dead-lettered."""


class CommitRefused(LockLost):
    """A batch's fenced commit was refused because a lock it needed had moved on."""

    def __init__(self, message: str, lost: frozenset[str]) -> None:
        super().__init__(message)
        self.lost = lost


class KeysStopped(KeyqError):
    """A key of a batch was paused (or its stream was) while the batch ran: its commit wrote
    nothing, and the batch runs again, setting that key's events aside."""


class SparkUnavailable(ServiceUnavailable):
    """The Spark session or cluster is gone; batches wait for it and are never blamed."""
