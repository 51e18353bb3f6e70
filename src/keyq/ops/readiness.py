"""Waiting for RabbitMQ and Redis to accept connections, for one-shot commands.

A daemon retries its services for as long as it runs. A command that runs once (the demo)
started beside its services, as in a compose deployment, must not fail because it was
seconds early: it waits, up to a bound, and says what it waits for. Refused credentials and
bad settings are never waited out.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from keyq.broker.backoff import Backoff
from keyq.broker.connections import open_blocking_connection, open_redis
from keyq.broker.errors import BrokerUnavailable, ConfigurationError, RedisUnavailable
from keyq.broker.settings import Settings

FIRST_PAUSE_S = 0.1
MAX_PAUSE_S = 2.0


def wait_for_services(
    settings: Settings,
    timeout: float,
    *,
    say: Callable[[str], None] = lambda text: None,
    name: str = "readiness",
) -> float:
    """Block until RabbitMQ accepts an AMQP connection and Redis answers a ping, or
    ``timeout`` seconds have passed; returns the seconds waited.

    Raises the last ``BrokerUnavailable`` / ``RedisUnavailable`` when the time is up (with
    ``timeout`` 0, at the first failure), and ``AuthenticationFailed`` or
    ``ConfigurationError`` at once.
    """
    if math.isnan(timeout) or timeout < 0:
        raise ConfigurationError(f"a wait for the services must be 0 s or more, not {timeout}")
    started = time.monotonic()
    deadline = started + timeout
    pauses = Backoff(FIRST_PAUSE_S, MAX_PAUSE_S)
    told: set[str] = set()
    while True:
        try:
            open_blocking_connection(settings, name).close()
            open_redis(settings).close()
        except (BrokerUnavailable, RedisUnavailable) as exc:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waited = time.monotonic() - started
                if timeout == 0 or waited < 0.5:
                    raise  # no waiting was asked for, or there was none
                raise type(exc)(f"{exc} (waited {waited:.0f} s)") from None
            service = "RabbitMQ" if isinstance(exc, BrokerUnavailable) else "Redis"
            if service not in told:
                told.add(service)
                say(f"waiting up to {timeout:.0f} s for {service}: {exc}")
            time.sleep(min(pauses.next(), remaining))
            continue
        return time.monotonic() - started
