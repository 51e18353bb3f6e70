"""``keyq``: one command for producing, inspecting and (later) running keyq's daemons.

Errors are printed in one line without a traceback, with exit codes scripts can rely on
(``keyq.cli.errors``): 0 ok, 1 a runtime failure (a service down, a timeout), 2 bad usage,
input or configuration, refused before any service is contacted, 3 a failed demo verdict.
"""

from __future__ import annotations

import sys
from typing import Any

import click
import orjson

from keyq.broker.settings import load_settings
from keyq.broker.streams import requested_config
from keyq.cli.checks import NON_NEGATIVE, POSITIVE, json_event, key_name, stream_name
from keyq.cli.console import console_command
from keyq.cli.control import key_group, pause_command, resume_command, stream_group
from keyq.cli.dead_letters import dead_letters_group
from keyq.cli.errors import EXIT_FAILURE, EXIT_VERDICT, OneLineGroup, exit_with, usage
from keyq.cli.inspect import inspect_command
from keyq.cli.settings import settings_command
from keyq.cli.status import status_command
from keyq.extras import require_worker_extra
from keyq.producer import Producer

stream_option = click.option("--stream", required=True, callback=stream_name, help="Stream name.")
mode_option = click.option(
    "--mode",
    type=click.Choice(["key", "bucket", "auto"]),
    default=None,
    help="A queue per key, per hash bucket, or per bucket with busy keys promoted to a queue "
    "of their own (auto); fixed at the stream's first use.",
)
buckets_option = click.option(
    "--buckets", type=int, default=None, help="Hash buckets in bucket and auto mode (default 64)."
)

metrics_port_option = click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics on this port (KEYQ_METRICS_PORT).",
)

# Checked here, so a misspelt level is a usage error naming the levels (exit 2), not a
# traceback from the logging module once the daemon has started; any case is accepted.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
log_level_option = click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="info",
    show_default=True,
)


@click.group(
    cls=OneLineGroup,
    context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "KEYQ"},
)
@click.version_option(package_name="keyq")
def cli() -> None:
    """Keyed event streams on RabbitMQ: per-key queues, one worker per key at a time."""


@cli.command("publish")
@stream_option
@click.option(
    "--key",
    "keys",
    multiple=True,
    required=True,
    callback=key_name,
    help="Key; repeat for several.",
)
@click.option("--event", required=True, callback=json_event, help="The event as a JSON object.")
@mode_option
@buckets_option
def publish(
    stream: str, keys: tuple[str, ...], event: dict[str, Any], mode: str | None, buckets: int | None
) -> None:
    """Publish one JSON event to each given key and wait until RabbitMQ confirmed them."""
    requested_config(stream, mode, buckets)
    with Producer(stream, mode=mode, buckets=buckets) as producer:
        receipts = [producer.publish(key, event) for key in keys]
    for receipt in receipts:
        click.echo(f"{receipt.key}\t{receipt.queue}\tseq={receipt.seq}")


@cli.command("worker")
@stream_option
@click.option(
    "--pipeline",
    required=True,
    help="The pipeline as module:function, e.g. keyq.demo.orders:pipeline.",
)
@click.option("--sink", default=None, help="Batch output: parquet:/path/to/folder (default none).")
@mode_option
@buckets_option
@click.option(
    "--until-idle",
    type=NON_NEGATIVE,
    default=None,
    help="Stop by itself once nothing arrived for this many seconds (drain mode).",
)
@click.option("--worker-id", default=None, help="Name in membership and locks (default host-pid).")
@metrics_port_option
@log_level_option
def worker_command(
    *,
    stream: str,
    pipeline: str,
    sink: str | None,
    mode: str | None,
    buckets: int | None,
    until_idle: float | None,
    worker_id: str | None,
    metrics_port: int | None,
    log_level: str,
) -> None:
    """Claim the stream's queues and process them in micro-batches on Spark.

    SIGTERM or Ctrl-C finishes the batch in flight, commits, acks and hands every queue back
    before exiting 0.
    """
    requested_config(stream, mode, buckets)
    require_worker_extra("keyq worker")
    from keyq.cli.daemons import run_worker_daemon  # noqa: PLC0415 - keeps startup light

    run_worker_daemon(
        stream=stream,
        pipeline=pipeline,
        sink=sink,
        mode=mode,
        buckets=buckets,
        until_idle=until_idle,
        worker_id=worker_id,
        metrics_port=metrics_port,
        log_level=log_level,
    )


@cli.command("spark-cache")
def spark_cache_command() -> None:
    """Build the class-data archive a worker's local Spark starts from, in about half the
    time (once per Java, pyspark installation and KEYQ_SPARK_DRIVER_JAVA_OPTIONS); prints
    its path."""
    from keyq.worker.config import WorkerSettings  # noqa: PLC0415 - keeps startup light
    from keyq.worker.spark.classes import archive_path, build_archive  # noqa: PLC0415

    require_worker_extra("keyq spark-cache")
    settings = load_settings(WorkerSettings)
    if archive_path(settings) is None:
        usage("no archive: KEYQ_SPARK_CLASS_CACHE is off, or no java found")
    built = build_archive(settings)
    if built is None:
        exit_with("could not build Spark's class-data archive (see the log above)", EXIT_FAILURE)
    click.echo(str(built))


@cli.command("janitor")
@click.option(
    "--stream",
    "streams",
    multiple=True,
    callback=stream_name,
    help="Stream to tend; repeat. Default: all.",
)
@click.option(
    "--idle-ttl",
    type=NON_NEGATIVE,
    default=None,
    help="Seconds a queue must be idle before it is reclaimed (KEYQ_IDLE_TTL_S, default 60).",
)
@click.option("--once", is_flag=True, help="One pass, then exit (for cron and tests).")
@click.option("--janitor-id", default=None, help="Name in the leadership lease.")
@metrics_port_option
@log_level_option
def janitor_command(
    *,
    streams: tuple[str, ...],
    idle_ttl: float | None,
    once: bool,
    janitor_id: str | None,
    metrics_port: int | None,
    log_level: str,
) -> None:
    """Delete drained, idle, unheld queues of single keys (key mode's, and in auto mode
    promoted keys' own queues, demoting those keys) and keyq's stale Redis entries.

    Several janitors may run: one leads each stream, the others stand by. Services that are
    down are waited for; only bad configuration makes it exit (2).
    """
    from keyq.cli.daemons import run_janitor_daemon  # noqa: PLC0415 - keeps startup light

    run_janitor_daemon(
        streams=streams,
        idle_ttl=idle_ttl,
        once=once,
        janitor_id=janitor_id,
        metrics_port=metrics_port,
        log_level=log_level,
    )


@cli.command("produce")
@stream_option
@click.option("--keys", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--events", type=click.IntRange(min=1), default=100_000, show_default=True)
@click.option("--rate", type=NON_NEGATIVE, default=0.0, show_default=True, help="events/s; 0 = max")
@click.option(
    "--skew", type=NON_NEGATIVE, default=1.1, show_default=True, help="Zipf exponent; 0 = even"
)
@click.option("--payload-bytes", type=click.IntRange(min=0), default=200, show_default=True)
@mode_option
@buckets_option
@click.option("--seed", type=int, default=1, show_default=True)
def produce_command(
    *,
    stream: str,
    keys: int,
    events: int,
    rate: float,
    skew: float,
    payload_bytes: int,
    mode: str | None,
    buckets: int | None,
    seed: int,
) -> None:
    """Publish synthetic keyed load and print what was done as JSON."""
    from keyq.ops.produce import Load, produce  # noqa: PLC0415 - keeps startup light

    requested_config(stream, mode, buckets)
    done = produce(Load(stream, keys, events, rate, skew, payload_bytes, mode, buckets, seed))
    click.echo(orjson.dumps(done).decode())


@cli.command("demo")
@click.option("--orders", type=click.IntRange(min=1), default=2000, show_default=True)
@click.option("--events", type=click.IntRange(min=1), default=100_000, show_default=True)
@click.option("--workers", type=click.IntRange(min=1, max=16), default=2, show_default=True)
@click.option("--chaos", is_flag=True, help="Kill, restart and scale workers while it runs.")
@click.option(
    "--external-workers",
    is_flag=True,
    help="Use workers already running (e.g. docker compose) on --stream (default orders).",
)
@click.option(
    "--stream",
    default=None,
    callback=stream_name,
    help="Stream name (default: a fresh demo-… stream).",
)
@click.option("--seed", type=int, default=7, show_default=True)
@click.option(
    "--idle-ttl", type=NON_NEGATIVE, default=30.0, show_default=True, help="Janitor idle ttl."
)
@click.option(
    "--timeout", type=POSITIVE, default=600.0, show_default=True, help="Drain timeout, s."
)
@click.option("--rate", type=NON_NEGATIVE, default=0.0, show_default=True, help="events/s; 0 = max")
@click.option(
    "--wait-for-services",
    type=NON_NEGATIVE,
    default=120.0,
    show_default=True,
    help="Seconds to wait for RabbitMQ and Redis to accept connections; 0 = fail at once.",
)
@click.option(
    "--mode",
    type=click.Choice(["key", "bucket", "auto"]),
    default="key",
    show_default=True,
    help="A queue per order, a queue per hash bucket of the orders, or buckets whose busy "
    "orders are promoted to a queue of their own (auto).",
)
@click.option(
    "--buckets",
    type=click.IntRange(min=1),
    default=None,
    help="Buckets in bucket and auto mode (default: the stream's, else 64).",
)
@click.option(
    "--queue-type",
    type=click.Choice(["classic", "quorum"]),
    default=None,
    help="Type of the stream's queues (default: KEYQ_QUEUE_TYPE, else classic).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def demo_command(
    *,
    orders: int,
    events: int,
    workers: int,
    chaos: bool,
    external_workers: bool,
    stream: str | None,
    seed: int,
    idle_ttl: float,
    timeout: float,
    rate: float,
    wait_for_services: float,
    mode: str,
    buckets: int | None,
    queue_type: str | None,
    as_json: bool,
) -> None:
    """Order events through real workers and a janitor, checked against what was published.

    Exit 0 when every order's state equals a plain-Python fold of its events (nothing lost,
    reordered or applied twice), 3 when it does not, 1 on a runtime failure.
    """
    from keyq.demo.console import run_demo  # noqa: PLC0415
    from keyq.demo.runner import DemoOptions  # noqa: PLC0415 - keeps startup light

    if not external_workers:
        require_worker_extra("keyq demo without --external-workers")
    if events < orders:
        usage(f"--events ({events}) must be at least --orders ({orders}): an order has events")
    options = DemoOptions(
        orders=orders,
        events=events,
        workers=workers,
        chaos=chaos,
        external_workers=external_workers,
        stream=stream,
        seed=seed,
        idle_ttl=idle_ttl,
        drain_timeout=timeout,
        rate=rate,
        wait_for_services=wait_for_services,
        mode=mode,
        buckets=buckets,
        queue_type=queue_type,
    )
    if not run_demo(options, as_json=as_json):
        sys.exit(EXIT_VERDICT)


@cli.command("state")
@stream_option
@click.option("--key", required=True, callback=key_name, help="The key whose state to print.")
@click.option("--marks", is_flag=True, help="Also print the exactly-once marks (per producer).")
def state_command(stream: str, key: str, marks: bool) -> None:
    """Print a key's committed state as JSON (exit 1 if it has none)."""
    from keyq.ops.state import read_state  # noqa: PLC0415 - keeps startup light

    found, value, key_marks = read_state(stream, key)
    if not found:
        exit_with(f"no state for key {key!r} in stream {stream!r}", EXIT_FAILURE)
    shown: Any = {"key": key, "state": value, "marks": key_marks} if marks else value
    click.echo(orjson.dumps(shown, option=orjson.OPT_INDENT_2).decode())


cli.add_command(status_command)
cli.add_command(console_command)
cli.add_command(settings_command)

for operator_command in (
    dead_letters_group,
    pause_command,
    resume_command,
    key_group,
    stream_group,
    inspect_command,
):
    cli.add_command(operator_command)


def main() -> None:
    cli()
