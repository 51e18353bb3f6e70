"""The error tree says what a retry can cure: only ``ServiceUnavailable`` is retryable, and
refused credentials are a ``ConnectionFailed`` that is not one."""

from __future__ import annotations

import inspect

import pytest

import keyq
from keyq.broker import errors
from keyq.broker.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    CommitNotReplicated,
    ConnectionFailed,
    HttpEndpointUnavailable,
    KeyqError,
    ManagementUnavailable,
    PrometheusUnavailable,
    RedisUnavailable,
    ServiceUnavailable,
    SparkUnavailable,
)

SERVICES_AWAY = [
    BrokerUnavailable,
    RedisUnavailable,
    CommitNotReplicated,
    HttpEndpointUnavailable,
    ManagementUnavailable,
    PrometheusUnavailable,
    SparkUnavailable,
]


@pytest.mark.parametrize("error", SERVICES_AWAY, ids=lambda error: error.__name__)
def test_a_service_away_is_retryable(error: type[KeyqError]) -> None:
    assert issubclass(error, ServiceUnavailable)
    assert issubclass(error, ConnectionFailed)
    assert error.retryable is True


def test_refused_credentials_are_a_connection_failure_that_is_not_retried() -> None:
    refused = AuthenticationFailed("RabbitMQ refused the credentials")
    assert isinstance(refused, ConnectionFailed)  # code that catches ConnectionFailed still does
    assert not isinstance(refused, ServiceUnavailable)
    assert refused.retryable is False
    with pytest.raises(AuthenticationFailed):
        try:
            raise refused
        except ServiceUnavailable:  # a retry loop's catch lets it through
            pytest.fail("refused credentials were caught as retryable")


def test_only_a_service_away_is_retryable_and_an_instance_answers_like_its_class() -> None:
    assert ServiceUnavailable.__mro__[1] is ConnectionFailed
    assert keyq.ServiceUnavailable is ServiceUnavailable, "public"
    tree = [
        value
        for _, value in inspect.getmembers(errors, inspect.isclass)
        if issubclass(value, KeyqError)
    ]
    assert KeyqError.retryable is False and ServiceUnavailable in tree
    for error in tree:
        assert error.retryable is issubclass(error, ServiceUnavailable), error.__name__
    assert BrokerUnavailable("down").retryable is True
    assert HttpEndpointUnavailable("503", status=503).retryable is True
    assert KeyqError("x").retryable is False
