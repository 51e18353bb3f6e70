"""Whether every node the janitor was given answers, before it deletes quorum queues.

On RabbitMQ 3.10 a quorum queue declared while one of its nodes is down never gets that node's
replica back (the member is not started when the node returns; later releases start it, see
rabbitmq-server#8630). A janitor that deletes an idle quorum queue during an outage invites a
producer to declare it again at once, short of a replica for good, and one more node fault
then leaves it without a quorum: its keys stop until an operator repairs it. So while any
node of ``KEYQ_AMQP_URL`` does not complete an AMQP handshake, quorum queues are kept. The
nodes are probed at the start of a pass, again before each delete and after the last: a quorum
queue deleted while one of its nodes was restarting was seen left behind broken on 3.10 (the
node kept its record of the queue, with no replica running anywhere), refusing every event;
and one deleted while a node was down left that node's replica behind, which at the node's
next restart replaced the log of the queue declared again under its name, confirmed events
and all (docs/operations.md, "Deleting quorum queues").

A handshake, not a TCP connect: a proxy or load balancer in front of a node that is down
still accepts TCP. Only the nodes listed are probed: a single URL (a load balancer) says
nothing of the others.
"""

from __future__ import annotations

from keyq.broker.connections import open_blocking_connection
from keyq.broker.errors import ServiceUnavailable
from keyq.broker.settings import Settings
from keyq.broker.urls import redact_url, split_urls

PROBE_TIMEOUT_S = 2.0


def unreachable_nodes(settings: Settings, timeout: float = PROBE_TIMEOUT_S) -> list[str]:
    """Each listed node (its URL without the password) that does not accept a connection."""
    urls = split_urls(settings.amqp_url)
    if len(urls) < 2:
        return []  # one URL: its own outage fails the pass anyway
    down = []
    for url in urls:
        node = settings.model_copy(
            update={"amqp_url": url, "connect_timeout": min(settings.connect_timeout, timeout)}
        )
        try:
            open_blocking_connection(node, "janitor-probe").close()
        except ServiceUnavailable:  # refused credentials are no node down: they propagate
            down.append(redact_url(url))
    return down
