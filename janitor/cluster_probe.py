"""Whether every node the janitor was given answers, before it deletes quorum queues.

On RabbitMQ 3.10 a quorum queue declared while one of its nodes is down never gets that node's
replica back (the member is not started when the node returns; later releases start it, see
rabbitmq-server#8630). A janitor that deletes an idle quorum queue during an outage invites a
producer to declare it again at once, short of a replica for good, and one more node fault
then leaves it without a quorum: its keys stop until an operator repairs it. So while any
node of ``KEYQ_AMQP_URL`` does not accept a TCP connection, quorum queues are kept.

Only the nodes listed are probed: a single URL (a load balancer) says nothing of the others.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from keyq.broker.urls import split_urls

PROBE_TIMEOUT_S = 1.0
AMQP_PORT = 5672
AMQPS_PORT = 5671


def unreachable_nodes(amqp_url: str, timeout: float = PROBE_TIMEOUT_S) -> list[str]:
    """``host:port`` of each listed node that refuses or does not answer a TCP connection."""
    down = []
    for url in split_urls(amqp_url):
        try:
            parts = urlsplit(url)
            default = AMQPS_PORT if parts.scheme == "amqps" else AMQP_PORT
            host, port = parts.hostname or "localhost", parts.port or default
        except ValueError:
            continue  # the settings reject such a URL long before this
        try:
            with socket.create_connection((host, port), timeout):
                pass
        except OSError:
            down.append(f"{host}:{port}")
    return down
