"""Auto mode: a producer follows its keys' routes (``keyq.broker.routes``).

A promoted key's events go straight to its own queue, so its bucket's holder neither receives
nor forwards them. The producer's Redis thread reads the routes at most every ``REFRESH_S``,
and in full only when a promotion or a demotion happened since. A route read late is harmless:
the events a producer sends to the bucket of a key promoted meanwhile are forwarded, in order,
by the bucket's holder.

*The switch.* A producer's events of a key must reach the key's own queue in its order, so it
sends none there while any of its earlier ones are still in the bucket: its first events for
the own queue wait (``WaitReason.SWITCHING``) until the bucket's holder has forwarded or
applied its earlier ones (``RouteBook.passed``), and then go behind them. A switch that waits
longer than ``SWITCH_WAIT_S`` (a bucket backed up) is put off: the waiting events go to the
bucket, to be forwarded, and so do the key's next ones for ``SWITCH_BACKOFF_S``, or until the
bucket has caught up: every ``REFRESH_S`` the Redis thread marks the last seq sent there (the
held events among them), and the bucket passed a mark within ``CAUGHT_UP_S`` of its setting. A
switch is most often put off because the bucket's holder was killed, and a new holder is
through the backlog within seconds; every event sent to the bucket after that would only be
forwarded, consumed a second time. A bucket that stays behind (a stream published faster than
its workers apply it) keeps the whole put-off, so a switch that would wait again is not tried.

*The way back.* An own queue's publish lease is refused once its key's route is gone
(``broker.retirement``): the producer forgets the route, and the events that wait for the
queue, and the key's next ones, go to the bucket (``Producer.stats["rerouted"]``).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from keyq.broker.naming import is_bucket_queue
from keyq.broker.routes import RouteBook
from keyq.broker.streams import StreamConfig
from keyq.producer.context import IoContext
from keyq.producer.lanes import Lanes, WaitReason
from keyq.producer.outgoing import Outgoing

log = logging.getLogger("keyq.producer")

REFRESH_S = 0.25
SWITCH_CHECK_S = 0.05
# Long enough for the bucket's holder to finish a few batches (each may take most of a second),
# or a hot key's switch is put off again and again and its events keep going to the bucket.
SWITCH_WAIT_S = 3.0
SWITCH_BACKOFF_S = 10.0
# How soon after it is marked a put-off key's last event in the bucket must leave it for the
# switch to be tried again at once: well inside ``SWITCH_WAIT_S``, so that the switch is made.
CAUGHT_UP_S = 1.0


class Way(enum.Enum):
    """What the I/O thread does with an event addressed to a queue, by its key's switch."""

    SEND = "send"
    HOLD = "hold"  # its key's switch waits for the bucket
    TO_BUCKET = "to bucket"  # its key is not (or no longer) sent to its own queue


@dataclass
class _Switching:
    after: int  # the last seq of the key this producer sent to the bucket
    since: float
    latest: int  # the last seq it took for the own queue meanwhile: to the bucket if put off


@dataclass
class PutOff:
    """A key whose switch is put off, and how far behind its bucket runs."""

    until: float
    sent: int  # the last seq of the key this producer sent to the bucket
    mark: tuple[float, int] | None = None  # (when, ``sent`` then): for the bucket to pass

    def caught_up(self, passed: int, now: float) -> bool:
        """Whether the bucket, having passed ``passed``, passed the mark within
        ``CAUGHT_UP_S`` of its setting. Without a mark, or with one passed late, a new one is
        set at ``sent``, and the answer is whether the bucket passed that already."""
        if self.mark is not None and passed < self.mark[1]:
            return False
        if self.mark is not None and now - self.mark[0] <= CAUGHT_UP_S:
            return True
        self.mark = (now, self.sent)
        return passed >= self.sent


class RouteFollower:
    """The own queues of an auto stream's promoted keys as this producer last read them, and
    its switches to them."""

    def __init__(self, book: RouteBook, config: StreamConfig, producer_id: str) -> None:
        self._book = book
        self._config = config
        self._producer_id = producer_id
        self._own: dict[str, str] = {}  # key -> own queue; replaced whole, never changed
        self._version: tuple[int, int] | None = None
        self._refresh_due = 0.0
        self._check_due = 0.0  # of the switches waiting
        self._lock = threading.Lock()
        self._direct: set[str] = set()  # keys switched: their events go to their own queue
        self._switching: dict[str, _Switching] = {}
        self._put_off: dict[str, PutOff] = {}
        self.on_switched: Callable[[str, str, bool], None] | None = None  # key, queue, done

    # ------------------------------------------------------------- application threads
    def queue_for(self, key: str, last_seq: int) -> str:
        """Where ``key``'s next event goes; ``last_seq`` is the last seq this producer took
        for the key. Called with the confirm window's lock held, so seqs follow this order."""
        own = self._own.get(key)
        if own is None:
            if key in self._direct or key in self._switching:
                self.forget(key)
            return self._config.queue_for(key)
        with self._lock:
            switching = self._switching.get(key)
            if switching is not None:
                switching.latest = last_seq + 1
            if key in self._direct or switching is not None:
                return own
            put_off = self._put_off.get(key)
            if put_off is not None and put_off.until > time.monotonic():
                put_off.sent = last_seq + 1
                return self._config.queue_for(key)
            self._put_off.pop(key, None)
            if last_seq == 0:
                self._direct.add(key)  # nothing of it ever went to the bucket
            else:
                self._switching[key] = _Switching(last_seq, time.monotonic(), last_seq + 1)
        return own

    # ------------------------------------------------------------------ I/O thread
    def way(self, key: str, queue: str) -> Way:
        """What to do with an event of ``key`` addressed to ``queue``."""
        if is_bucket_queue(self._config.stream, queue):
            return Way.SEND
        with self._lock:
            if key in self._direct:
                return Way.SEND
            return Way.HOLD if key in self._switching else Way.TO_BUCKET

    def switched(self, key: str, done: bool) -> bool:
        """The key's switch is over: done, or put off. False if it was not switching."""
        with self._lock:
            switching = self._switching.pop(key, None)
            if switching is None:
                return False
            if done:
                self._direct.add(key)
            else:
                until = time.monotonic() + SWITCH_BACKOFF_S
                self._put_off[key] = PutOff(until, switching.latest)  # its held events too
        return True

    def forget(self, key: str) -> None:
        """``key`` has no route now; the next read of the routes is in full."""
        with self._lock:
            self._direct.discard(key)
            self._switching.pop(key, None)
            self._put_off.pop(key, None)
            if key in self._own:
                own = dict(self._own)
                del own[key]
                self._own = own
            self._version = None

    def bucket_for(self, key: str) -> str:
        return self._config.queue_for(key)

    def routed_key(self, queue: str, key: str) -> str | None:
        """The key whose route a lease of ``queue`` needs: its own queue's key, else none."""
        return None if is_bucket_queue(self._config.stream, queue) else key

    # ---------------------------------------------------------------- Redis thread
    @property
    def due(self) -> float:
        """When the Redis thread next has work here."""
        if self._switching:
            return min(self._refresh_due, self._check_due)
        return self._refresh_due

    def step(self) -> None:
        """Read the routes again if they changed, end the put-offs of keys whose bucket has
        caught up, and settle the switches that may be."""
        now = time.monotonic()
        if now >= self._refresh_due:
            self._refresh_due = now + REFRESH_S
            version = self._book.version()
            if version != self._version:
                self._own = {key: route.queue for key, route in self._book.promoted().items()}
                self._version = version
            self._end_put_offs_caught_up()
        with self._lock:
            waiting = dict(self._switching)
        if not waiting:
            return
        self._check_due = now + SWITCH_CHECK_S
        passed = self._book.passed(waiting, self._producer_id)
        now = time.monotonic()
        for key, switching in waiting.items():
            done = passed.get(key, 0) >= switching.after
            if (done or now - switching.since > SWITCH_WAIT_S) and self.on_switched is not None:
                self.on_switched(key, self._config.own_queue_for(key), done)

    def _end_put_offs_caught_up(self) -> None:
        now = time.monotonic()
        with self._lock:
            for key in [key for key, put_off in self._put_off.items() if put_off.until <= now]:
                del self._put_off[key]  # run out
            keys = [key for key in self._put_off if key in self._own]
        if not keys:
            return
        passed = self._book.passed(keys, self._producer_id)
        now = time.monotonic()
        with self._lock:
            for key in keys:
                put_off = self._put_off.get(key)
                if put_off is not None and put_off.caught_up(passed.get(key, 0), now):
                    log.debug("key %r: its bucket caught up, so its switch is tried again", key)
                    del self._put_off[key]


class Rerouting:
    """On the I/O thread: events addressed to a key's own queue that must go to its bucket
    (``Way.TO_BUCKET``), and the switches the Redis thread settled."""

    def __init__(
        self,
        ctx: IoContext,
        lanes: Lanes,
        follower: RouteFollower,
        release: Callable[[str], None],  # ``Publisher.release``
        ask_again: Callable[[str], None],
    ) -> None:
        self._ctx = ctx
        self._lanes = lanes
        self._follower = follower
        self._release = release
        self._ask_again = ask_again
        self.rerouted = 0  # events sent to their bucket instead of their own queue

    def to_bucket(self, message: Outgoing) -> None:
        """Address ``message`` (an event or a pack, all of one key) to its key's bucket."""
        bucket = self._follower.bucket_for(message.key)
        self._ctx.window.moved(message.queue, bucket, message.count)
        for event in message.members:
            event.queue = bucket
        message.queue = bucket
        self.rerouted += message.count

    def switched(self, key: str, queue: str, done: bool) -> None:
        """From the Redis thread: ``key``'s switch to ``queue`` is over (``done``, or put off:
        its waiting events then go to the bucket)."""
        with contextlib.suppress(RuntimeError, OSError, AttributeError):  # the loop is gone
            self._ctx.ioloop.add_callback_threadsafe(lambda: self._switched(key, queue, done))

    def _switched(self, key: str, queue: str, done: bool) -> None:
        if not self._follower.switched(key, done):
            return
        log.debug("key %r: switch to %s %s", key, queue, "done" if done else "put off")
        lane = self._lanes.get(queue)
        if lane is not None and lane.waits_for(WaitReason.SWITCHING):
            lane.release(WaitReason.SWITCHING)
            self._release(queue)

    def unrouted(self, queue: str, lease_s: float) -> None:
        """An own queue's lease was refused because its key has no route: its waiting events
        go to the bucket once nothing of it is in flight (sent under a lease, those reached
        the queue before it could be deleted, or come back returned)."""
        lane = self._lanes.get(queue)
        if lane is None or lane.key is None:
            return
        self._follower.forget(lane.key)
        lane.refused_lease()
        if lane.inflight or lane.returned or lane.reasons - {WaitReason.UNLEASED}:
            self._ctx.ioloop.call_later(lease_s / 4, lambda: self._ask_again(queue))
            return
        log.debug("%s lost its route: its waiting events go to the bucket", queue)
        lane.release(WaitReason.UNLEASED)
        self._release(queue)  # each goes through ``Way.TO_BUCKET``
