"""The queue arguments every keyed queue is declared with, shared by producers and workers.

A queue must always be declared with the same arguments or RabbitMQ refuses the second
declaration, so they are computed here only.
"""

from __future__ import annotations

from typing import Any

from keyq.broker.naming import dead_letter_queue_name

# How often a quorum queue may hand a message out before it dead-letters it. RabbitMQ 4 counts
# every return, a consumer's death included, and defaults to 20, after which it would drop the
# message; keyq isolates poison events itself (without returning them), so the broker's limit
# is only a last resort against a message that kills every worker it reaches, and it goes to
# the stream's dead-letter queue. One fixed value: every declaration must carry the same.
QUORUM_DELIVERY_LIMIT = 1000


def keyed_queue_arguments(stream: str, queue_type: str = "classic") -> dict[str, Any]:
    """Durable keyed queue: rejected messages go to the stream's dead-letter queue."""
    args: dict[str, Any] = {
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": dead_letter_queue_name(stream),
    }
    if queue_type != "classic":
        args["x-queue-type"] = queue_type
    if queue_type == "quorum":
        # Quorum queues accept a second "exclusive" consumer; single active consumer keeps
        # a newcomer idle until the previous consumer is gone, as exclusivity does for
        # classic queues, so a key is never consumed by two workers at once.
        args["x-single-active-consumer"] = True
        args["x-delivery-limit"] = QUORUM_DELIVERY_LIMIT
    return args


def dead_letter_queue_arguments(queue_type: str = "classic") -> dict[str, Any]:
    return {} if queue_type == "classic" else {"x-queue-type": queue_type}
