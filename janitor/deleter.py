"""Conditional queue deletes, in parallel over a few connections.

``queue.delete`` with ``if_empty`` and ``if_unused``: RabbitMQ refuses (406) a queue that holds
a message or has a consumer, which for the janitor means "not now", never an error. A refusal
closes the channel, so each connection keeps opening a fresh one; a sequential channel does
~500 deletes/s here, hence several connections.

Quorum queues refuse those flags (540 NOT_IMPLEMENTED, which closes the whole connection), so
they are *checked* instead: a passive declare reads ready messages and consumers, a short
exclusive consume confirms that nothing is there (the declare's counts can lag, see
``_finds_a_message``), and only an empty queue without consumers is deleted. That is safe
only because nothing can change in between: the caller holds the queue's retirement mark (no
producer publishes) and its lock (no worker starts consuming).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from keyq.broker.connections import amqp_failure, open_blocking_connection
from keyq.broker.errors import BrokerUnavailable
from keyq.broker.queue_probe import QueueProbe
from keyq.broker.queue_refusals import INTERNAL_ERROR, NOT_FOUND, QueueRefusal, classify
from keyq.broker.settings import Settings

log = logging.getLogger("keyq.janitor")

# How long a consumer registered on a quorum queue waits for a message before the queue counts
# as empty (a delivery follows the consume's registration within milliseconds).
EMPTY_CHECK_WAIT_S = 0.25


class Outcome(enum.Enum):
    DELETED = "deleted"
    NOT_EMPTY = "not_empty"
    IN_USE = "in_use"
    # It did not exist, as a broker that answers 404 says; RabbitMQ 3.10 answers delete-ok
    # for a missing queue, which counts as DELETED (either way it is no longer there).
    GONE = "gone"
    # On a cluster, the node that holds the queue is down: the queue and its messages come
    # back with the node, so this is "not now", never "gone".
    UNREACHABLE = "unreachable"
    # Not tried: the queue's retirement mark lapsed before its turn came (the janitor was
    # slower than the mark's ttl), so producers may be publishing to it again.
    LAPSED = "mark_lapsed"
    # Not tried: the queue's key has events aside (its holder drains them), so it must stay.
    ASIDE = "kept_aside"


class _Lane:
    """One connection and its current channel, used by one thread at a time."""

    def __init__(self, settings: Settings, name: str) -> None:
        self._settings = settings
        self._name = name
        self._connection: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        # Shares the lane's channel: it opens it again (through the lane) after a 404.
        self._probe = QueueProbe(self._open_channel)
        self._look_first = False  # see _broke_on

    def connect(self) -> None:
        try:
            self._open_channel()
        except (pika.exceptions.AMQPError, OSError) as exc:
            self.close()
            raise amqp_failure(exc, self._settings.amqp_url) from None

    def _open_channel(self) -> BlockingChannel:
        if self._connection is None or not self._connection.is_open:
            self._connection = open_blocking_connection(self._settings, self._name)
        if self._channel is None or not self._channel.is_open:
            self._channel = self._connection.channel()
        return self._channel

    def delete(self, queue: str, checked: bool = False) -> Outcome:
        """One queue's outcome. A connection lost mid-call is retried once on a fresh one: a
        cut connection (a node restarting, a proxy) is not a broker that is down, and failing
        the whole pass for it left every other queue waiting for the next one. Deleting twice
        is harmless: the second call finds the queue gone."""
        try:
            return self._delete_once(queue, checked)
        except BrokerUnavailable:
            return self._delete_once(queue, checked)

    def _delete_once(self, queue: str, checked: bool) -> Outcome:
        looked = checked or self._look_first  # a passive declare answered before the delete
        try:
            # A 404 for a queue whose node is down closes only the channel (see _broke_on).
            found = self._probe.look(queue) if looked else None
            if isinstance(found, QueueRefusal):
                return Outcome.GONE if found is QueueRefusal.MISSING else Outcome.UNREACHABLE
            channel = self._open_channel()
            if checked and found is not None:
                if found.ready:
                    return Outcome.NOT_EMPTY
                if found.consumers:
                    return Outcome.IN_USE
                if self._finds_a_message(channel, queue):
                    return Outcome.NOT_EMPTY
                deleted = channel.queue_delete(queue).method.message_count
                if deleted:
                    # Nothing was ready and no consumer was attached, yet the broker counts
                    # messages: held unacked by a consumer it no longer lists (seen after a
                    # quorum leader change). Said loudly: they are gone with the queue.
                    log.error(
                        "queue %s: the broker counted %d messages when deleting it, with none "
                        "ready and no consumer",
                        queue,
                        deleted,
                    )
                log.debug("queue %s: checked and deleted", queue)
            else:
                channel.queue_delete(queue, if_unused=True, if_empty=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._channel = None
            if exc.reply_code == NOT_FOUND:
                missing = classify(exc.reply_code, exc.reply_text) is QueueRefusal.MISSING
                return Outcome.GONE if missing else Outcome.UNREACHABLE
            if exc.reply_code == INTERNAL_ERROR:
                return self._broke_on(queue, exc, looked)
            if exc.reply_code == 406:
                return Outcome.NOT_EMPTY if "not empty" in exc.reply_text else Outcome.IN_USE
            if exc.reply_code == 403 and checked:
                return Outcome.IN_USE  # the exclusive consume met a consumer
            raise amqp_failure(exc, self._settings.amqp_url) from None
        except pika.exceptions.ConnectionClosedByBroker as exc:
            self.close()
            if exc.reply_code == INTERNAL_ERROR:
                return self._broke_on(queue, exc, looked)
            raise amqp_failure(exc, self._settings.amqp_url) from None
        except (pika.exceptions.AMQPError, OSError) as exc:
            self.close()
            raise amqp_failure(exc, self._settings.amqp_url) from None
        return Outcome.DELETED

    def _broke_on(self, queue: str, exc: pika.exceptions.AMQPError, looked: bool) -> Outcome:
        """The broker failed inside the command (541, which closes the whole connection).

        RabbitMQ 4.3.6 answers so the delete of a classic queue whose node is down: that
        queue is left for a later pass and the others go on, and from then on this lane looks
        each queue up first, since such a queue answers a passive declare with a 404 that
        closes only the channel (not one connection per queue). A 541 for a queue that did
        answer the look-up is the broker failing, not the queue's node: the pass fails and
        backs off, as for a broker that is down."""
        self.close()
        if looked:
            raise amqp_failure(exc, self._settings.amqp_url) from None
        self._look_first = True
        log.warning("queue %s: the broker failed on it (%s); left for a later pass", queue, exc)
        return Outcome.UNREACHABLE

    def _finds_a_message(self, channel: BlockingChannel, queue: str) -> bool:
        """Consume the queue exclusively for a moment and requeue whatever comes.

        A quorum queue's passive declare answered 0 ready messages for a queue holding 31
        events, right after its leader changed (the cluster soak; the janitor deleted them).
        A consume is a command through the queue's leader: once it is registered, every
        message the queue holds at that point of its log is on its way to this consumer. It
        is exclusive, so a consumer the declare did not count makes it fail (403, in use).
        Quorum queues refuse ``basic.get`` with single-active-consumer, hence a consume."""
        found: list[int] = []

        def on_message(_ch: Any, method: Any, _properties: Any, _body: bytes) -> None:
            found.append(method.delivery_tag)

        channel.basic_qos(prefetch_count=1)
        tag = channel.basic_consume(queue, on_message, auto_ack=False, exclusive=True)
        assert self._connection is not None
        deadline = time.monotonic() + EMPTY_CHECK_WAIT_S
        while not found and time.monotonic() < deadline:
            self._connection.process_data_events(time_limit=0.02)
        for delivery_tag in found:
            channel.basic_nack(delivery_tag, requeue=True)
        channel.basic_cancel(tag)  # pika nacks anything delivered but not yet dispatched
        return bool(found)

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            # Closing a broken connection can fail inside pika itself (seen: AttributeError
            # from its poller); the connection is dropped either way.
            with contextlib.suppress(Exception):
                connection.close()


class QueueDeleter:
    """Deletes queues conditionally over ``lanes`` connections."""

    def __init__(self, settings: Settings, lanes: int, name: str = "janitor") -> None:
        self._lanes = [_Lane(settings, f"{name}-{i}") for i in range(lanes)]
        self._pool = ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="keyq-delete")
        self._lock = threading.Lock()

    def delete(self, queues: Sequence[str], checked: bool = False) -> dict[str, Outcome]:
        """Each queue's outcome; raises ``BrokerUnavailable`` if RabbitMQ is gone. With
        ``checked`` (quorum queues), see the module's docstring for what the caller holds."""
        if not queues:
            return {}
        shares = [list(queues[i :: len(self._lanes)]) for i in range(len(self._lanes))]
        with self._lock:
            results = self._pool.map(
                lambda pair: {q: pair[0].delete(q, checked) for q in pair[1]},
                [(lane, share) for lane, share in zip(self._lanes, shares, strict=True) if share],
            )
            outcomes: dict[str, Outcome] = {}
            for part in results:
                outcomes.update(part)
        return outcomes

    def check(self) -> None:
        """Connect one lane now, so a broker that is down or refuses us shows at every pass,
        not only when there is something to delete."""
        self._lanes[0].connect()

    def release(self) -> None:
        """Close the connections between passes (an idle blocking connection would miss its
        heartbeats and be dropped by the broker anyway)."""
        for lane in self._lanes:
            lane.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.release()
