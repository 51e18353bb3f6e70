"""Which keyq error a failed connection attempt becomes, from exceptions built as pika builds
them (the blocking adapter wraps them in ``AMQPConnectionWorkflowFailed``). Real listeners are
in tests/test_silent_broker.py; this makes a pika upgrade that changes the mapping fail here."""

from __future__ import annotations

import pika.exceptions
import pytest
from pika.adapters.utils import connection_workflow

from keyq.broker.connections import amqp_failure
from keyq.broker.errors import AuthenticationFailed, BrokerUnavailable

URL = "amqp://keyq:s3cret-pass@broker.example:5672/%2F"


def _blocking_failure(*errors: BaseException) -> BaseException:
    return pika.exceptions.AMQPConnectionError(
        connection_workflow.AMQPConnectionWorkflowFailed(list(errors))
    )


def _shown(error: Exception) -> str:
    text = str(error)
    assert "s3cret-pass" not in text
    return text


def test_a_handshake_that_never_completes_is_a_broker_that_is_unavailable() -> None:
    stalled = connection_workflow.AMQPConnectorStackTimeout(
        "Timeout during AMQP handshake'127.0.0.1'/(2, 1, 6, '', ('127.0.0.1', 5672)); ssl=False"
    )
    error = amqp_failure(_blocking_failure(stalled), URL, handshake_s=10)
    assert isinstance(error, BrokerUnavailable)
    assert not isinstance(error, AuthenticationFailed)
    assert "did not complete the AMQP handshake in 10 s" in _shown(error)


@pytest.mark.parametrize(
    ("text", "handshake"),
    [
        ("Timeout while setting up AMQP to ('127.0.0.1', 5672); ssl=False", "AMQP"),
        ("Timeout while setting up transport to ('127.0.0.1', 5671); ssl=True", "TLS"),
    ],
)
def test_the_asynchronous_adapters_stalled_handshake_reads_the_same(
    text: str, handshake: str
) -> None:
    error = amqp_failure(pika.exceptions.ConnectionOpenAborted(text), URL, handshake_s=4)
    assert isinstance(error, BrokerUnavailable)
    assert f"did not complete the {handshake} handshake in 4 s" in _shown(error)


def test_a_tcp_connect_that_timed_out_is_not_a_stalled_handshake() -> None:
    refused = connection_workflow.AMQPConnectorSocketConnectError(TimeoutError("timed out"))
    stalled = connection_workflow.AMQPConnectorStackTimeout("Timeout during AMQP handshake")
    error = amqp_failure(_blocking_failure(refused, stalled), URL, handshake_s=10)
    assert isinstance(error, BrokerUnavailable)
    assert "accepted the connection" not in _shown(error)


def test_refused_credentials_stay_final() -> None:
    refusal = pika.exceptions.ProbableAuthenticationError(
        "Client was disconnected at a connection stage indicating a probable authentication "
        "error: ('ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN', 403)"
    )
    error = amqp_failure(_blocking_failure(refusal), URL)
    assert isinstance(error, AuthenticationFailed)
    _shown(error)
