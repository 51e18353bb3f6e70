"""``keyq status``: a stream's queues (depth, owner, idle time), its live workers, its dead letters,
and how close the broker is to its file-descriptor limit.

Everything is read, nothing is changed: Redis in three round trips (one pipeline for the
config, the registry and the members, one MGET for every lock, one HMGET for the original
keys), RabbitMQ in one scrape of each node's rabbitmq_prometheus when ``KEYQ_PROMETHEUS_URL``
is set, else in two listings of the management API when ``KEYQ_MANAGEMENT_URL`` is (its fd use
from the same place), else by passive declares on one channel (AMQP cannot list queues).
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import sys
import time
from types import TracebackType
from typing import Any, NoReturn, cast

import click
import orjson
import pika
import pika.exceptions
from rich import box
from rich.console import Console
from rich.table import Table

from keyq.broker.clock import now_ms
from keyq.broker.connections import amqp_failure, open_blocking_connection, open_redis, redis_errors
from keyq.broker.errors import (
    ConfigurationError,
    InvalidInput,
    KeyqError,
    ManagementUnavailable,
    PrometheusUnavailable,
)
from keyq.broker.fd_usage import FdUsage, read_fd_usage
from keyq.broker.locks import FencedLocks
from keyq.broker.management import queue_figures
from keyq.broker.naming import Mode, check_stream_name, dead_letter_queue_name, stream_prefix
from keyq.broker.prometheus_api import queue_figures as prometheus_figures
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import StreamConfig
from keyq.broker.urls import vhost_of

log = logging.getLogger("keyq.status")

EXIT_FAILURE = 1
EXIT_USAGE = 2
TABLE_LIMIT = 50
NOT_FOUND = 404
PIPE_WIDTH = 400  # output to a pipe or file is never wrapped, so names stay greppable
FD_REFRESH_S = 10.0  # --watch reads the broker's fd use at most this often
LISTING_TIMEOUT_S = 30.0  # one listing of every queue of the vhost (management, prometheus)
HTTP_BAD_REQUEST = 400
# What RabbitMQ 4.x answers /api/consumers with when its management metrics collection is off.
METRICS_OFF_HINT = (
    "; the broker's management metrics collection is off, as RabbitMQ 4.x allows: "
    "KEYQ_PROMETHEUS_URL reads the figures from rabbitmq_prometheus instead"
)


class StreamNotFound(KeyqError):
    """The stream has no recorded config: nothing has produced to it yet."""


class StatusReader:
    """Reads one stream's status; keeps its connections between reads (for ``--watch``).

    RabbitMQ is only connected once Redis has shown that the stream exists.
    """

    def __init__(self, settings: Settings, stream: str) -> None:
        self.settings = settings
        self.stream = check_stream_name(stream)
        self._keys = StreamKeys(self.stream)
        self._dlq = dead_letter_queue_name(self.stream)
        self._redis = open_redis(settings)
        self._registry = QueueRegistry(self._redis, self.stream)
        self._locks = FencedLocks(self._redis, self.stream)
        self._connection: Any = None
        self._channel: Any = None
        self._fd_usage: FdUsage | None = None
        self._fd_read_at = 0.0

    def __enter__(self) -> StatusReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def collect(self) -> dict[str, Any]:
        """One snapshot of the stream (see ``collect_status`` for its fields)."""
        keys = self._keys
        now = now_ms()
        with redis_errors(self.settings.redis_url):
            pipe = self._redis.pipeline(transaction=False)
            pipe.get(keys.config)
            pipe.zrange(keys.registry, 0, -1, withscores=True)
            pipe.zrangebyscore(keys.members, now, "+inf", withscores=True)
            pipe.hgetall(keys.member_info)
            raw_config, registered, members, infos = pipe.execute()
        if raw_config is None:
            raise StreamNotFound(
                f"stream {self.stream!r} has no producer yet (no config recorded in Redis)"
            )
        config = StreamConfig.from_json(self.stream, str(raw_config))
        activity = {
            str(queue): int(score)
            for queue, score in cast(list[tuple[str, float]], registered)
            if queue != self._dlq
        }
        names = list(activity)
        with redis_errors(self.settings.redis_url):
            holders = self._locks.holders(names)
            # A bucket queue holds many keys (the registry keeps the first one seen).
            keyed = config.mode is Mode.KEY
            originals = self._registry.original_keys(names) if keyed else dict.fromkeys(names)
        declared = self._figures([*names, self._dlq])
        live = {str(worker): int(expiry) for worker, expiry in members}

        queues: list[dict[str, Any]] = []
        held_by: dict[str, int] = {}
        for name in names:
            lease = holders[name]
            if lease is not None:
                held_by[lease.owner] = held_by.get(lease.owner, 0) + 1
            queues.append(
                _queue_row(name, originals[name], declared[name], dead_letter=False)
                | {
                    "owner": None if lease is None else lease.owner,
                    "token": None if lease is None else lease.token,
                    "owner_alive": None if lease is None else lease.owner in live,
                    "idle_ms": max(0, now - activity[name]),
                }
            )
        queues.sort(key=_deepest_first)
        dead_letter = _queue_row(self._dlq, None, declared[self._dlq], dead_letter=True) | {
            "owner": None,
            "token": None,
            "owner_alive": None,
            "idle_ms": None,
        }
        workers = [
            _worker_row(
                worker,
                expiry,
                now=now,
                ttl_ms=self.settings.member_ttl_ms,
                raw_info=infos.get(worker),
                held_by=held_by,
            )
            for worker, expiry in sorted(live.items())
        ]
        held = sum(1 for row in queues if row["owner"] is not None)
        return {
            "stream": self.stream,
            "broker": self._broker_fds().as_dict(),
            "mode": config.mode.value,
            "buckets": config.buckets,
            "at_ms": now,
            "dead_letter_queue": self._dlq,
            "queues": [*queues, dead_letter],
            "workers": workers,
            "totals": {
                "queues": len(queues),
                "lag": sum(row["depth"] for row in queues if row["depth"] is not None),
                "dead_letter_depth": dead_letter["depth"],
                "held": held,
                "unheld": len(queues) - held,
                "missing": sum(1 for row in queues if row["missing"]),
                "workers": len(workers),
                "events_per_s": None,
            },
        }

    def _broker_fds(self) -> FdUsage:
        """The broker's fd use, read again only every ``FD_REFRESH_S`` under ``--watch``."""
        if self._fd_usage is None or time.monotonic() - self._fd_read_at >= FD_REFRESH_S:
            self._fd_usage = read_fd_usage(self.settings)
            self._fd_read_at = time.monotonic()
        return self._fd_usage

    def wait(self, seconds: float) -> None:
        """Sleep between refreshes, answering RabbitMQ's heartbeats meanwhile."""
        if self._connection is None or not self._connection.is_open:
            time.sleep(seconds)
            return
        try:
            self._connection.sleep(seconds)
        except (pika.exceptions.AMQPError, OSError):
            self._close_amqp()  # reconnected at the next refresh

    def close(self) -> None:
        self._close_amqp()
        with contextlib.suppress(Exception):
            self._redis.close()

    def _figures(self, queues: list[str]) -> dict[str, tuple[int, int] | None]:
        """(ready messages, consumers) of each queue, None for one that does not exist: from
        rabbitmq_prometheus when ``KEYQ_PROMETHEUS_URL`` is set, else from the management
        API's listings when ``KEYQ_MANAGEMENT_URL`` is (either may report a depth a few
        seconds late), else, or if neither answers, by declaring. A queue they do not report
        (declared a moment ago, or on a node not listed) is declared."""
        settings = self.settings
        vhost = vhost_of(settings.amqp_url)
        if settings.prometheus_url:
            try:
                reported = prometheus_figures(
                    settings.prometheus_url,
                    vhost,
                    LISTING_TIMEOUT_S,
                    prefix=stream_prefix(self.stream),
                )
            except PrometheusUnavailable as exc:
                fallback = "from the management API" if settings.management_url else "by declaring"
                log.warning("queue figures %s instead: %s", fallback, exc)
            else:
                found: dict[str, tuple[int, int] | None] = {
                    queue: reported[queue] for queue in queues if queue in reported
                }
                unreported = [queue for queue in queues if queue not in reported]
                if unreported:
                    found.update(self._declare(unreported))
                return found
        if not settings.management_url:
            return self._declare(queues)
        try:
            listed = queue_figures(settings.management_url, vhost, LISTING_TIMEOUT_S)
        except ManagementUnavailable as exc:
            hint = METRICS_OFF_HINT if exc.status == HTTP_BAD_REQUEST else ""
            log.warning("queue figures by declaring instead: %s%s", exc, hint)
            return self._declare(queues)
        found = {queue: listed.get(queue) for queue in queues}
        # Listed without a depth: ask the queue itself.
        unknown = [queue for queue in queues if queue in listed and listed[queue] is None]
        if unknown:
            found.update(self._declare(unknown))
        return found

    def _declare(self, queues: list[str]) -> dict[str, tuple[int, int] | None]:
        """(ready messages, consumers) of each queue, None for a queue that does not exist."""
        found: dict[str, tuple[int, int] | None] = {}
        try:
            channel = self._open_channel()
            for queue in queues:
                try:
                    method = channel.queue_declare(queue, passive=True).method
                except pika.exceptions.ChannelClosedByBroker as exc:
                    if exc.reply_code != NOT_FOUND:
                        raise
                    found[queue] = None
                    channel = self._channel = self._connection.channel()
                    continue
                found[queue] = (int(method.message_count), int(method.consumer_count))
        except (pika.exceptions.AMQPError, OSError) as exc:
            self._close_amqp()
            raise amqp_failure(exc, self.settings.amqp_url) from None
        return found

    def _open_channel(self) -> Any:
        if self._connection is None or not self._connection.is_open:
            self._channel = None
            self._connection = open_blocking_connection(self.settings, f"status-{self.stream}")
        if self._channel is None or not self._channel.is_open:
            self._channel = self._connection.channel()
        return self._channel

    def _close_amqp(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            with contextlib.suppress(Exception):
                connection.close()


def collect_status(settings: Settings, stream: str) -> dict[str, Any]:
    """A snapshot of ``stream``, as plain JSON-ready data.

    ``queues``: every registered queue, deepest first, then the dead-letter queue, each with
    ``name``, ``key`` (original key; None in bucket mode), ``depth`` (ready messages; None and
    ``missing`` when the queue does not exist), ``consumers``, ``owner``/``token`` (lock
    holder), ``owner_alive`` and ``idle_ms`` (since last registry activity). ``workers``: the
    live members with ``heartbeat_age_ms`` (expiry minus ``settings.member_ttl_ms``), ``held``
    (locks held now) and their reported counters; ``events_per_s`` is None in a snapshot
    (see ``add_rates``). ``totals``: queue count, lag (sum of keyed depths), dead-letter depth,
    held/unheld/missing queues, workers. ``broker``: ``fd_used``/``fd_limit``/``fd_ratio`` of
    the broker node closest to its fd limit and ``near_limit`` (at ``settings.fd_warn_ratio``),
    or None figures and ``unknown_reason`` without rabbitmq_prometheus or the management
    API, and the ``source`` they came from. Raises
    ``StreamNotFound`` for an unused stream.
    """
    with StatusReader(settings, stream) as reader:
        return reader.collect()


def add_rates(current: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]:
    """Fill each worker's ``events_per_s`` from the growth of its ``events`` counter since
    ``previous`` (workers publish the counter with each heartbeat, so rates are approximate;
    a worker that is new or restarted keeps None)."""
    seconds = (current["at_ms"] - previous["at_ms"]) / 1000
    before = {row["worker"]: row["events"] for row in previous["workers"]}
    rates: list[float] = []
    for row in current["workers"]:
        then, now = before.get(row["worker"]), row["events"]
        if seconds > 0 and isinstance(then, int) and isinstance(now, int) and now >= then:
            row["events_per_s"] = round((now - then) / seconds, 1)
            rates.append(row["events_per_s"])
    current["totals"]["events_per_s"] = round(sum(rates), 1) if rates else None
    return current


def _queue_row(
    name: str, key: str | None, declared: tuple[int, int] | None, *, dead_letter: bool
) -> dict[str, Any]:
    return {
        "name": name,
        "key": key,
        "dead_letter": dead_letter,
        "depth": None if declared is None else declared[0],
        "consumers": None if declared is None else declared[1],
        "missing": declared is None,
    }


def _deepest_first(row: dict[str, Any]) -> tuple[int, str]:
    depth = row["depth"]
    return (-depth if depth is not None else 1, row["name"])


def _worker_row(
    worker: str,
    expiry: int,
    *,
    now: int,
    ttl_ms: int,
    raw_info: str | None,
    held_by: dict[str, int],
) -> dict[str, Any]:
    info: dict[str, Any] = {}
    if raw_info is not None:
        with contextlib.suppress(orjson.JSONDecodeError):
            parsed = orjson.loads(raw_info)
            info = parsed if isinstance(parsed, dict) else {}
    return {
        "worker": worker,
        "heartbeat_age_ms": max(0, now - (expiry - ttl_ms)),
        "held": held_by.get(worker, 0),
        "events": _count(info.get("events")),
        "batches": _count(info.get("batches")),
        "dead_lettered": _count(info.get("dead_lettered")),
        "waiting": _count(info.get("waiting")),
        "gaps_open": _count(info.get("gaps_open")),
        "gaps_skipped": _count(info.get("gaps_skipped")),
        "late": _count(info.get("late")),
        "gaps": _gaps(info.get("gaps")),
        "events_per_s": None,
        "host": info.get("host"),
        "pid": info.get("pid"),
        "ready": info.get("ready") is True,
        "started_ms": info.get("started_ms"),
    }


def _gaps(value: object) -> list[dict[str, Any]]:
    """The open sequence gaps a worker reported (key, producer, first, last, waited_s)."""
    if not isinstance(value, list):
        return []
    return [gap for gap in value if isinstance(gap, dict) and {"key", "first"} <= set(gap)]


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# ---- rendering ---------------------------------------------------------------------------


def render_table(status: dict[str, Any], *, width: int = PIPE_WIDTH) -> str:
    """The status for people: a header with the totals, the deepest queues, the workers."""
    console = Console(
        file=io.StringIO(),
        width=width,
        color_system=None,
        force_terminal=False,
        highlight=False,
        markup=False,
        emoji=False,
    )
    totals = status["totals"]
    mode = status["mode"] + (f" ({status['buckets']} buckets)" if status["buckets"] else "")
    rate = totals["events_per_s"]
    console.print(f"stream {status['stream']}   mode {mode}")
    console.print(
        f"queues {totals['queues']} (held {totals['held']}, unheld {totals['unheld']}"
        + (f", missing {totals['missing']}" if totals["missing"] else "")
        + f")   lag {totals['lag']}   dead letters {_depth(totals['dead_letter_depth'])}"
        + f"   workers {totals['workers']}"
        + ("" if rate is None else f"   {rate} events/s")
    )
    if status.get("broker") is not None:
        fds = FdUsage.from_dict(status["broker"])
        console.print(f"broker file descriptors {fds.summary()}")
        warning = fds.warning()
        if warning is not None:
            console.print(f"WARNING: {warning}")

    console.print()
    keyed = [row for row in status["queues"] if not row["dead_letter"]]
    queues = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    queues.add_column("queue", overflow="fold")
    queues.add_column("key", overflow="fold")
    for title in ("depth", "consumers"):
        queues.add_column(title, justify="right")
    queues.add_column("owner", overflow="fold")
    queues.add_column("token", justify="right")
    queues.add_column("idle", justify="right")
    for row in keyed[:TABLE_LIMIT]:
        owner = row["owner"]
        if owner is not None and not row["owner_alive"]:
            owner += " (not alive)"
        queues.add_row(
            row["name"],
            _printable(row["key"]),
            _depth(row["depth"]),
            _blank(row["consumers"]),
            owner or "-",
            _blank(row["token"]),
            _duration(row["idle_ms"]),
        )
    console.print(queues)
    if len(keyed) > TABLE_LIMIT:
        console.print(f"… and {len(keyed) - TABLE_LIMIT} more queues")
    elif not keyed:
        console.print("no queues registered")

    console.print()
    if status["workers"]:
        workers = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        workers.add_column("worker", overflow="fold")
        for title in ("heartbeat", "held", "events", "events/s", "batches", "dead-lettered"):
            workers.add_column(title, justify="right")
        workers.add_column("host", overflow="fold")
        for row in status["workers"]:
            workers.add_row(
                row["worker"],
                _duration(row["heartbeat_age_ms"]) + " ago",
                str(row["held"]),
                _blank(row["events"]),
                _blank(row["events_per_s"]),
                _blank(row["batches"]),
                _blank(row["dead_lettered"]),
                f"{row['host'] or '-'}:{row['pid'] or '-'}",
            )
        console.print(workers)
        _print_gaps(console, status["workers"])
    else:
        console.print("no live workers")
    console.print()
    console.print(
        f"dead-letter queue {status['dead_letter_queue']}: "
        f"{_depth(totals['dead_letter_depth'])} messages"
    )
    text = cast(io.StringIO, console.file).getvalue()
    return "".join(line.rstrip() + "\n" for line in text.splitlines())


def _print_gaps(console: Console, workers: list[dict[str, Any]]) -> None:
    """Events held back for a missing seq, and gaps given up: never silent."""
    waiting = sum(row["waiting"] or 0 for row in workers)
    skipped = sum(row["gaps_skipped"] or 0 for row in workers)
    late = sum(row["late"] or 0 for row in workers)
    gaps = [dict(gap, worker=row["worker"]) for row in workers for gap in row["gaps"]]
    if not (waiting or skipped or late or gaps):
        return
    console.print(
        f"sequence gaps: {sum(row['gaps_open'] or 0 for row in workers)} open, {waiting} "
        f"events waiting; given up {skipped}, late arrivals dead-lettered {late}"
    )
    for gap in sorted(gaps, key=lambda gap: -float(gap.get("waited_s") or 0))[:TABLE_LIMIT]:
        console.print(
            f"  key {_printable(str(gap['key']))} producer {gap.get('producer')}: waiting for "
            f"seq {gap['first']}..{gap.get('last')} for {gap.get('waited_s')}s "
            f"({gap['worker']})"
        )


def _depth(depth: int | None) -> str:
    return "missing" if depth is None else str(depth)


def _blank(value: object) -> str:
    return "-" if value is None else str(value)


def _printable(key: str | None) -> str:
    if key is None:
        return "-"
    return key if key.isprintable() else repr(key)


def _duration(ms: int | None) -> str:
    if ms is None:
        return "-"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


# ---- the command -------------------------------------------------------------------------


def _fail(exc: KeyqError) -> NoReturn:
    code = EXIT_USAGE if isinstance(exc, (ConfigurationError, InvalidInput)) else EXIT_FAILURE
    click.echo(f"keyq: {exc}", err=True)
    sys.exit(code)


def _show(status: dict[str, Any], as_json: bool, *, watching: bool) -> None:
    if as_json:
        option = 0 if watching else orjson.OPT_INDENT_2
        click.echo(orjson.dumps(status, option=option).decode())
        return
    interactive = sys.stdout.isatty()
    width = shutil.get_terminal_size().columns if interactive else PIPE_WIDTH
    text = render_table(status, width=width)
    if watching and interactive:
        click.clear()
    click.echo(text, nl=False)
    if watching and not interactive:
        click.echo()


def _watch(reader: StatusReader, as_json: bool, every: float) -> None:
    previous: dict[str, Any] | None = None
    while True:
        status = reader.collect()
        if previous is not None:
            add_rates(status, previous)
        _show(status, as_json, watching=True)
        previous = status
        reader.wait(every)


@click.command("status")
@click.option("--stream", required=True, help="Stream name.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option(
    "--watch",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="Refresh every SECONDS until Ctrl-C; with --json, one JSON object per line.",
)
def status_command(stream: str, as_json: bool, watch: float | None) -> None:
    """Show a stream's queues (depth, owner, idle time), live workers and dead letters."""
    try:
        reader = StatusReader(load_settings(), stream)
    except KeyqError as exc:
        _fail(exc)
    try:
        if watch is None:
            _show(reader.collect(), as_json, watching=False)
        else:
            _watch(reader, as_json, watch)
    except KeyqError as exc:
        reader.close()
        _fail(exc)
    except KeyboardInterrupt:
        pass  # Ctrl-C ends --watch; exit 0
    finally:
        reader.close()
