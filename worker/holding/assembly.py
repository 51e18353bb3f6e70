"""The held queues of a serving session, assembled with the parts they work with: the aside
queues drained under their leases, and the watch for starved quorum queues that observes their
hand-backs."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from keyq.broker.key_control import KeyControl
from keyq.broker.locks import FencedLocks
from keyq.broker.registry import QueueRegistry
from keyq.broker.routes import applying_queue
from keyq.broker.streams import StreamConfig
from keyq.worker.amqp.deliveries import DeliveryBuffer
from keyq.worker.amqp.link import ConsumerLink
from keyq.worker.amqp.starvation import StarvedQueues
from keyq.worker.holding.aside_drains import AsideDrains
from keyq.worker.holding.held_queues import HeldQueues, QueueEvents


@dataclass(frozen=True)
class Holding:
    drains: AsideDrains
    starved: StarvedQueues
    held: HeldQueues


def assemble_holding(
    config: StreamConfig,
    *,
    client: redis.Redis,
    link: ConsumerLink,
    registry: QueueRegistry,
    control: KeyControl,
    buffer: DeliveryBuffer,
    events: QueueEvents,
) -> Holding:
    drains = AsideDrains(
        control=control,
        consumers=link.consumers,
        counts=link.counts,
        dead_letters=link.dead_letters,
        buffer=buffer,
        queue_of_key=lambda key, status: applying_queue(config, key, status.route),
    )
    starved = StarvedQueues(
        link=link,
        consumers=link.consumers,
        counts=link.counts,
        buffer=buffer,
        queue_type=config.queue_type,
    )
    held = HeldQueues(
        consumers=link.consumers,
        gone=link.gone,
        buffer=buffer,
        locks=FencedLocks(client, config.stream),
        registry=registry,
        events=events,
        aside=drains,
        observers=[starved],
    )
    return Holding(drains, starved, held)
