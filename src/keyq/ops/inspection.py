"""Everything keyq knows about one key, for ``keyq inspect``: its queue and depth, who holds it,
whether it is paused or parked, the queues its events wait in aside, its open sequence gaps,
its committed state and marks, how old its oldest waiting event is, and its dead letters (read
from their index, ``keyq.broker.dead_letter_index``: the dead-letter queue is not walked).

Read-only but for one thing: the age of the oldest waiting event is read by taking the head
of the key's queue unacked and handing it back (its channel closed), which RabbitMQ marks as
redelivered. That is done only while no worker holds or consumes the queue and no janitor is
retiring it, so no worker sees another order and no delete can catch it taken, and never on a
quorum queue, where the hand-back counts toward the queue's delivery limit.

In an auto-mode stream the key's *route* says which queue that is: its bucket, or once it is
promoted its own queue (``keyq.broker.routes``), whose holder applies it; the bucket producers
publish to, whose holder forwards its events there, is shown beside it, with the key's latest
route changes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import orjson
import pika
import pika.exceptions
import redis

from keyq.broker.clock import now_ms
from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.broker.envelope import HEADER_KEY, HEADER_PUBLISHED_AT
from keyq.broker.key_control import KeyControl, KeyStatus, ParkedKey
from keyq.broker.locks import FencedLocks, Lease
from keyq.broker.naming import Mode, incarnation_name
from keyq.broker.packs import HEADER_PACK, MalformedPack, decode_pack, is_pack
from keyq.broker.queue_probe import QueueCounts, QueueProbe
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.retirement import RetirementFence
from keyq.broker.routes import Route, RouteBook
from keyq.broker.stranded import Stranded, StrandedRecord, stranded_row
from keyq.broker.stream_policy import StreamPolicies
from keyq.broker.streams import StreamConfig
from keyq.broker.worker_report import WorkerReport
from keyq.ops.context import OperatorContext

DEAD_LETTERS_SHOWN = 100  # of a key, oldest first, from the index of dead letters
BUCKET_SCAN = 20  # messages looked at for the key's first event in a shared bucket queue
ROUTE_CHANGES_SHOWN = 10  # of a key in an auto-mode stream, newest first


def inspect_key(ctx: OperatorContext, key: str) -> dict[str, Any]:
    """The key's picture as JSON-ready data (see the module docstring)."""
    client, keys, config = ctx.redis, ctx.keys, ctx.config
    with ctx.services():
        auto = config.mode is Mode.AUTO
        book = RouteBook(client, ctx.stream) if auto else None
        status = KeyControl(client, ctx.stream).status(key)  # with its route, in auto mode
        route, bucket = status.route, config.queue_for(key)  # auto mode: the key's bucket
        queue = _current(client, keys, bucket if route is None else route.queue)
        policy = StreamPolicies(client, ctx.stream).load()
        lease = FencedLocks(client, ctx.stream).holder(queue)
        raw_state, raw_marks, raw_info, expiry, activity = _reads(ctx, key, lease, queue)
        connection = ctx.amqp()
        counts = _counts(connection, [queue, *status.aside, *([] if route is None else [bucket])])
        depth = counts[queue]
        held = lease is not None or (depth is not None and depth.consumers > 0)
        retiring = bool(RetirementFence(client, ctx.stream).marked([queue]))
        shared = config.mode.hashes and route is None  # an own queue holds the key alone
        oldest = _oldest(
            connection, queue, key, config, depth, shared=shared, busy=held or retiring
        )
        bucket_queue = None if route is None else _bucket_beside(ctx, bucket, counts[bucket])
        changes = [] if book is None else _changes(book.history(ROUTE_CHANGES_SHOWN, key=key))
        letters, letters_total = _letters(ctx, key)
        stranded = _stranded(
            StrandedRecord(client, ctx.stream).of(key),
            status,
            held=lease is not None,
            queue_there=depth is not None and activity is not None,
        )
    report = WorkerReport.parse(raw_info, worker=lease.owner, stream=ctx.stream) if lease else None
    seen = any(
        value is not None for value in (raw_state, raw_marks, depth, activity, status.parked)
    ) or bool(status.aside or status.paused_since_ms or letters or route or changes)
    return {
        "stream": ctx.stream,
        "key": key,
        "mode": config.mode.value,
        "known": seen,
        "route": _route(bucket, route, bucket_queue, changes) if auto else None,
        "queue": _queue(queue, depth, activity, retiring=retiring),
        "holder": _holder(lease, expiry, raw_info),
        "paused_since_ms": status.paused_since_ms,
        "parked": None if status.parked is None else _parked(status.parked),
        "stream_paused": policy.paused,
        "poison_policy": policy.poison_policy,
        "rate_limit": policy.rate_limit,
        "aside": [
            {"queue": name, "depth": None if (found := counts[name]) is None else found.ready}
            for name in status.aside
        ],
        "gaps": [] if report is None else [vars(gap) for gap in report.gaps if gap.key == key],
        "gaps_known": report is not None,
        "state": None if raw_state is None else orjson.loads(raw_state),
        "marks": None if raw_marks is None else orjson.loads(raw_marks),
        "oldest_waiting": oldest,
        "dead_letters": letters,
        "dead_letters_total": letters_total,
        "stranded": stranded,
    }


def _reads(ctx: OperatorContext, key: str, lease: Lease | None, queue: str) -> list[Any]:
    """The key's state and marks, its holder's report and heartbeat, its queue's activity."""
    keys = ctx.keys
    pipe = ctx.redis.pipeline(transaction=False)
    pipe.hget(keys.state, key)
    pipe.hget(keys.marks, key)
    pipe.hget(keys.member_info, lease.owner if lease else "")
    pipe.zscore(keys.members, lease.owner if lease else "")
    pipe.zscore(keys.registry, queue)
    return list(pipe.execute())


def _letters(ctx: OperatorContext, key: str) -> tuple[list[dict[str, Any]], int]:
    """The key's first dead letters, numbered, and how many it has."""
    dead = DeadLetterIndex(ctx.redis, ctx.stream).of_key(key, DEAD_LETTERS_SHOWN)
    return [{"position": place} | row for place, row in enumerate(dead.rows)], dead.matched


def _current(client: redis.Redis, keys: StreamKeys, base: str) -> str:
    """The current incarnation of the queue ``base`` (a deleted quorum queue's is new)."""
    return incarnation_name(base, int(client.hget(keys.incarnations, base) or 0))


def _route(
    bucket: str,
    route: Route | None,
    bucket_queue: dict[str, Any] | None,
    changes: list[dict[str, Any]],
) -> dict[str, Any]:
    """An auto-mode key's route: ``to`` "bucket" (its bucket applies it) or "own" (its own
    queue does: ``queue``, since ``epoch``, the move from the bucket ``open`` or ``closed``,
    ``since_ms``, ``why``); ``bucket_queue``: the bucket's figures and holder while it
    forwards the key; ``changes``: the key's latest route changes, newest first."""
    found: dict[str, Any] = {"to": "bucket" if route is None else "own", "bucket": bucket}
    if route is None:
        found |= dict.fromkeys(("queue", "epoch", "move", "since_ms", "why"))
    else:
        found |= route.describe()
    return found | {"bucket_queue": bucket_queue, "changes": changes}


def _bucket_beside(ctx: OperatorContext, bucket: str, depth: QueueCounts | None) -> dict[str, Any]:
    """The bucket a promoted key's events are published to: its figures (all of its keys')
    and who holds it, forwarding the key's events to its own queue."""
    client, keys = ctx.redis, ctx.keys
    lease = FencedLocks(client, ctx.stream).holder(bucket)
    owner = lease.owner if lease else ""
    pipe = client.pipeline(transaction=False)
    pipe.hget(keys.member_info, owner)
    pipe.zscore(keys.members, owner)
    raw_info, expiry = pipe.execute()
    return {
        "name": bucket,
        "exists": depth is not None,
        "depth": None if depth is None else depth.ready,
        "consumers": None if depth is None else depth.consumers,
        "holder": _holder(lease, expiry, raw_info),
    }


def _changes(rows: list[dict[str, object]]) -> list[dict[str, Any]]:
    """Route changes as ``keyq inspect`` shows them: what, epoch, why (promotions), when."""
    return [
        {
            "what": row.get("what"),
            "epoch": row.get("e"),
            "why": row.get("why"),
            "at_ms": row.get("at"),
        }
        for row in rows
    ]


def _counts(
    connection: pika.BlockingConnection, queues: list[str]
) -> dict[str, QueueCounts | None]:
    """Each queue's counts by passive declare, on a channel of the probe's own."""
    probe = QueueProbe(connection.channel)
    try:
        return probe.counts_of(queues)
    finally:
        probe.close()


def _queue(
    queue: str, depth: QueueCounts | None, activity: Any, *, retiring: bool
) -> dict[str, Any]:
    """The key's queue: its counts, when it was last active, whether it is being retired."""
    return {
        "name": queue,
        "exists": depth is not None,
        "depth": None if depth is None else depth.ready,
        "consumers": None if depth is None else depth.consumers,
        "registered": activity is not None,
        "idle_ms": None if activity is None else max(0, now_ms() - int(activity)),
        "retiring": retiring,
    }


def _holder(lease: Lease | None, expiry: Any, raw_info: Any) -> dict[str, Any] | None:
    """Who holds the key's queue, whether it is alive, and where it runs."""
    if lease is None:
        return None
    info = orjson.loads(raw_info) if raw_info else {}
    return {
        "worker": lease.owner,
        "token": lease.token,
        "alive": expiry is not None and float(expiry) >= now_ms(),
        "host": info.get("host"),
        "pid": info.get("pid"),
    }


def _parked(parked: ParkedKey) -> dict[str, Any]:
    return {
        "at_ms": parked.at_ms,
        "reason": parked.reason,
        "producer": parked.producer,
        "seq": parked.seq,
    }


def _oldest(
    connection: pika.BlockingConnection,
    queue: str,
    key: str,
    config: StreamConfig,
    depth: QueueCounts | None,
    *,
    shared: bool,
    busy: bool,
) -> dict[str, Any]:
    """How old the key's oldest waiting event is, where it may be looked at (``shared``: in
    a bucket queue, among other keys' events)."""
    if depth is None or not depth.ready:
        return {"age_ms": None, "note": "nothing waits in the queue"}
    if config.queue_type == "quorum":
        note = "not looked at: on a quorum queue a hand-back counts toward its delivery limit"
        return {"age_ms": None, "note": note}
    return _oldest_waiting(connection, queue, key, shared=shared, busy=busy)


def _stranded(
    found: Stranded | None, status: KeyStatus, *, held: bool, queue_there: bool
) -> dict[str, object] | None:
    """Why the key does not move, as the janitor's watchdog last found it; or, for a key
    whose events wait aside with no queue of its own to drain them, said here and now."""
    if found is not None:
        return stranded_row(found)
    if status.aside and not status.stopped and not held and not queue_there:
        reason = (
            "its events wait aside but its own queue is gone or unregistered, so no worker "
            "drains them: a janitor's watchdog declares it again on its next pass (is a "
            "janitor running?), as does `keyq resume --key`"
        )
        return {"key": "", "queue": "", "reason": reason, "since_ms": None, "repaired": False}
    return None


def _oldest_waiting(
    connection: pika.BlockingConnection, queue: str, key: str, *, shared: bool, busy: bool
) -> dict[str, Any]:
    """The age of the key's first event in its queue, taken unacked and handed back."""
    if busy:
        return {"age_ms": None, "note": "not looked at: the queue is held, or being retired"}
    channel = connection.channel()
    try:
        limit = BUCKET_SCAN if shared else 1
        for looked in range(1, limit + 1):
            try:
                method, properties, body = channel.basic_get(queue, auto_ack=False)
            except pika.exceptions.ChannelClosedByBroker as exc:
                return {"age_ms": None, "note": f"not looked at: {exc.reply_text}"}
            if method is None:
                note = "the queue is empty" if looked == 1 else "no event of the key among them"
                return {"age_ms": None, "note": note, "looked_at": looked - 1}
            found, published = _first_of_key(properties, body, key, shared)
            if found:
                age = None if published is None else max(0, now_ms() - int(published))
                return {"age_ms": age, "note": None, "looked_at": looked}
        return {
            "age_ms": None,
            "note": f"none of the first {limit} messages of the shared bucket queue holds "
            "an event of the key",
            "looked_at": limit,
        }
    finally:
        with contextlib.suppress(pika.exceptions.AMQPError):
            if channel.is_open:
                channel.close()


def _first_of_key(
    properties: pika.BasicProperties, body: bytes, key: str, shared: bool
) -> tuple[bool, Any]:
    """Whether a message holds an event of ``key``, and when the first such was published.
    In a key's own queue every message is the key's (a pack carries its earliest publish
    time); in a bucket queue a pack may hold several keys' events, each with its own headers."""
    headers = properties.headers or {}
    if not shared:
        return True, headers.get(HEADER_PUBLISHED_AT)
    events = [headers]
    if is_pack(properties.content_type):
        try:
            events = [event.headers for event in decode_pack(body, headers.get(HEADER_PACK))]
        except MalformedPack:
            return False, None
    owners = (key, key.encode())
    for found in events:
        if found.get(HEADER_KEY) in owners:
            return True, found.get(HEADER_PUBLISHED_AT)
    return False, None
