"""The queue arguments every keyed queue is declared with, shared by producers and workers.

A queue must always be declared with the same arguments or RabbitMQ refuses the second
declaration, so they are computed here only.
"""

from __future__ import annotations

from typing import Any

from keyq.broker.naming import dead_letter_queue_name


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
    return args


def dead_letter_queue_arguments(queue_type: str = "classic") -> dict[str, Any]:
    return {} if queue_type == "classic" else {"x-queue-type": queue_type}
