"""Waking a key's queue so that a worker claims it within a tick, as a producer publishing to a
quiet queue does.

A key that is resumed, or whose dead letters were put back ahead, has work in queues only the
holder of its own queue drains (``broker.key_control``). Its own queue may be unheld, or gone
(the janitor deletes drained idle key-mode queues): it is declared as a producer declares it,
under a publish lease (so never while a deleter retires it, and under its current incarnation),
registered with its original key, announced, and noted as woken.

In an auto-mode stream a key's events are drained by the holder of its own queue once it is
promoted (``broker.routes``), by the holder of its bucket otherwise: that queue is the one woken,
an own queue registered with its key, a bucket with none (it is shared).
"""

from __future__ import annotations

import time

import pika
import redis

from keyq.broker.backoff import Backoff
from keyq.broker.clock import now_ms
from keyq.broker.errors import BrokerUnavailable
from keyq.broker.naming import Mode, incarnation_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.registry import QueueRegistry
from keyq.broker.retirement import RetirementFence
from keyq.broker.routes import RouteBook
from keyq.broker.streams import StreamConfig
from keyq.broker.topology import keyed_queue_arguments

RETIRING_WAIT_S = 30.0  # a deleter's mark lasts a grace period; then it is gone or lapsed
POLL_S = 0.2  # the first pause between two lease attempts; they grow up to POLL_MAX_S
POLL_MAX_S = 1.0


def wake_keys(
    client: redis.Redis,
    connection: pika.BlockingConnection,
    config: StreamConfig,
    keys: list[str],
) -> list[str]:
    """Declare, register, announce and mark as woken the queues of ``keys``; returns them."""
    by_base = queues_to_wake(client, config, keys)
    if not by_base:
        return []
    fence = RetirementFence(client, config.stream)
    deadline = time.monotonic() + RETIRING_WAIT_S
    backoff = Backoff(POLL_S, POLL_MAX_S)
    leased: dict[str, int] = {}
    while True:
        waiting = [base for base in by_base if base not in leased]
        for base, incarnation in fence.lease(waiting).items():
            if incarnation is not None:
                leased[base] = incarnation
        if len(leased) == len(by_base):
            break
        if time.monotonic() > deadline:
            retiring = sorted(set(by_base) - set(leased))
            raise BrokerUnavailable(
                f"queue {retiring[0]} is being deleted by a janitor for over "
                f"{RETIRING_WAIT_S:g} s; run the command again"
            )
        time.sleep(backoff.next())
    queues = {incarnation_name(base, leased[base]): key for base, key in by_base.items()}
    channel = connection.channel()
    arguments = keyed_queue_arguments(config.stream, config.queue_type)
    for queue in queues:
        channel.queue_declare(queue, durable=True, arguments=arguments)
    channel.close()
    QueueRegistry(client, config.stream).register(queues)
    client.zadd(StreamKeys(config.stream).woken, dict.fromkeys(queues, now_ms()))
    return list(queues)


def queues_to_wake(
    client: redis.Redis, config: StreamConfig, keys: list[str]
) -> dict[str, str | None]:
    """The base name of the queue draining each of ``keys`` -> the key to register it with
    (None for a queue keys share)."""
    routes = RouteBook(client, config.stream).routes(keys) if config.mode is Mode.AUTO else {}
    by_base: dict[str, str | None] = {}
    for key in keys:
        route = routes.get(key)
        if route is not None:
            by_base.setdefault(route.queue, key)
        else:
            by_base.setdefault(config.queue_for(key), key if config.mode is Mode.KEY else None)
    return by_base
