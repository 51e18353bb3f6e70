"""Auto mode: a producer follows its keys' routes (``keyq.broker.routes``).

A promoted key's events go straight to its own queue, so its bucket's holder neither receives
nor forwards them. The producer's Redis thread reads the routes at most every ``REFRESH_S``,
and in full only when a promotion or a demotion happened since. A route read late is harmless:
the events a producer sends to the bucket of a key promoted meanwhile are forwarded by the
bucket's holder, and the own queue's holder applies the key's events by their seqs, waiting
for the forwarded ones it lacks (a sequence gap). An own queue's publish lease is refused once
its key's route is gone (``broker.retirement``): the events that wait for it then go to the
key's bucket, and so do the key's next events.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from keyq.broker.naming import is_bucket_queue
from keyq.broker.routes import RouteBook
from keyq.broker.streams import StreamConfig
from keyq.producer.context import IoContext
from keyq.producer.lanes import Lanes, WaitReason
from keyq.producer.outgoing import Outgoing

log = logging.getLogger("keyq.producer")

REFRESH_S = 0.25


class RouteFollower:
    """The own queues of an auto stream's promoted keys, as this producer last read them."""

    def __init__(self, book: RouteBook, config: StreamConfig) -> None:
        self._book = book
        self._config = config
        self._own: dict[str, str] = {}  # key -> own queue; replaced whole, never changed
        self._version: tuple[int, int] | None = None
        self.due = 0.0  # monotonic time of the next read

    def queue_for(self, key: str) -> str:
        """Where ``key``'s next event goes (any thread)."""
        own = self._own.get(key)
        return own if own is not None else self._config.queue_for(key)

    def bucket_for(self, key: str) -> str:
        return self._config.queue_for(key)

    def routed_key(self, queue: str, key: str) -> str | None:
        """The key whose route a lease of ``queue`` needs: its own queue's key, else none."""
        return None if is_bucket_queue(self._config.stream, queue) else key

    def refresh(self) -> None:
        """On the Redis thread: read the routes again if they changed."""
        self.due = time.monotonic() + REFRESH_S
        version = self._book.version()
        if version == self._version:
            return
        self._own = {key: route.queue for key, route in self._book.promoted().items()}
        self._version = version

    def forget(self, key: str) -> None:
        """On the I/O thread: ``key`` has no route now; the next read is in full."""
        if key in self._own:
            own = dict(self._own)
            del own[key]
            self._own = own
        self._version = None


class Rerouting:
    """On the I/O thread: an own queue whose key lost its route hands its waiting events, in
    order, to the key's bucket. Events still in flight there settle first: sent under a lease,
    they reached the queue before it could be deleted, or come back returned."""

    def __init__(
        self,
        ctx: IoContext,
        lanes: Lanes,
        follower: RouteFollower,
        send_all: Callable[[list[Outgoing]], None],
        ask_again: Callable[[str], None],
    ) -> None:
        self._ctx = ctx
        self._lanes = lanes
        self._follower = follower
        self._send_all = send_all
        self._ask_again = ask_again
        self.rerouted = 0  # events sent to their bucket instead

    def unrouted(self, queue: str, lease_s: float) -> None:
        lane = self._lanes.get(queue)
        if lane is None or lane.key is None:
            return
        self._follower.forget(lane.key)
        lane.refused_lease()  # nothing more goes to the own queue
        if lane.inflight or lane.returned or lane.reasons - {WaitReason.UNLEASED}:
            self._ctx.ioloop.call_later(lease_s / 4, lambda: self._ask_again(queue))
            return
        waiting = [*lane.take_gathered(), *lane.waiting]
        events = sorted(
            (event for message in waiting for event in message.members),
            key=lambda event: event.number,
        )
        del self._lanes[queue]
        bucket = self._follower.bucket_for(lane.key)
        self._ctx.window.moved(queue, bucket, len(events))
        for event in events:
            event.queue = bucket
        log.debug("%s lost its route: %d events go to %s", queue, len(events), bucket)
        self.rerouted += len(events)
        self._send_all(events)
