"""What RabbitMQ's ``404 NOT_FOUND`` about a queue means: gone, or there but unreachable.

A classic queue whose node is down answers 404 to a declare, a consume or a passive declare,
exactly as a queue that does not exist. The two call for opposite actions: a missing queue is
declared again (producer) or forgotten (janitor); an unreachable one keeps its messages and
comes back with its node, so it must be waited for and never forgotten.

The broker's words for "unreachable" change between releases (3.10: "home node '…' of durable
queue '…' in vhost '…' is down or inaccessible"; 4.3: "queue '…' in vhost '…' process is
stopped by supervisor"). What has not changed is the form of "missing": the broker's one
not-found helper writes "no queue '…' in vhost '…'". So a 404 that names a queue and is not
that form means "there, not reachable now", whatever it says; it is the safe reading too,
since waiting for a queue that turns out to be missing costs a retry, while forgetting one
that is only unreachable strands its messages.
"""

from __future__ import annotations

import enum
import re

NOT_FOUND = 404
# A crash inside the broker while it handles the command: 4.3 answers ``queue.delete`` of a
# classic queue whose node is down this way, and closes the whole connection.
INTERNAL_ERROR = 541

_MISSING = re.compile(r"(?:^|\s)no queue '")
_NAMED_QUEUE = re.compile(r"queue '(?P<queue>[^']*)' in vhost '[^']*'")


class QueueRefusal(enum.Enum):
    """A 404's meaning for the queue it was about."""

    MISSING = "missing"  # the queue does not exist
    UNREACHABLE = "unreachable"  # it exists, but its node (or process) cannot serve it now
    OTHER = "other"  # not about a queue (an exchange, a binding) or not a 404


def classify(reply_code: int, reply_text: str) -> QueueRefusal:
    """The meaning of a channel close, for the queue the closed command was about."""
    if reply_code != NOT_FOUND:
        return QueueRefusal.OTHER
    if _MISSING.search(reply_text):
        return QueueRefusal.MISSING
    if _NAMED_QUEUE.search(reply_text):
        return QueueRefusal.UNREACHABLE
    return QueueRefusal.OTHER


def unreachable_queue(reply_code: int, reply_text: str) -> str | None:
    """The name of the queue a 404 says is there but unreachable, or None."""
    if classify(reply_code, reply_text) is not QueueRefusal.UNREACHABLE:
        return None
    named = _NAMED_QUEUE.search(reply_text)
    return named.group("queue") if named else None
