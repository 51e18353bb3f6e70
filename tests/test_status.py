"""``keyq status``: every figure it shows is checked against what really is in RabbitMQ and
Redis, in-process and from the shell (table, JSON, ``--watch``, errors). A real worker's
host and pid in it: tests/test_metrics.py, which runs one anyway."""

from __future__ import annotations

import copy
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pika
import pytest

import keyq.ops.status as status_module
from keyq import Producer
from keyq.broker.locks import FencedLocks, Lease
from keyq.broker.membership import Membership
from keyq.broker.naming import dead_letter_queue_name, key_queue_name
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import Settings, load_settings
from keyq.cli.status import TABLE_LIMIT, render_table
from keyq.ops.status import StatusReader, collect_status
from tests.helpers import queue_depth
from tests.servers import free_port
from tests.workers import REPO, keyq_environment, run_keyq, wait_until

EXIT_FAILURE = 1
EXIT_USAGE = 2
# Long enough that the fake member outlives the subprocesses' start-up.
MEMBER_TTL_MS = 60_000
PUBLISHED = {"sensor-a": 3, "sensor-b": 2, "sensor-c": 1}
OWNER = "fake-worker"
GONE = "gone-worker"
RUN_STATUS = "from keyq.cli.status import status_command; status_command()"


@dataclass
class World:
    """What the test set up, to compare the status with."""

    stream: str
    queues: dict[str, str]  # key -> queue
    ghost: str  # registered, never declared
    owned: Lease  # held by OWNER, a live member
    orphaned: Lease  # held by GONE, not a member
    dlq: str


def publish_and_register_a_ghost(
    stream: Any, settings: Settings | None = None
) -> tuple[dict[str, str], str]:
    """Publishes ``PUBLISHED`` in key mode and registers a queue that was never declared;
    returns the queues by key and the ghost. Each event a message of its own (packing off):
    depths are what the broker counts, messages, and here they count the events too."""
    one_each = (settings or load_settings()).model_copy(update={"pack_max_events": 1})
    with Producer(stream.name, mode="key", settings=one_each) as producer:
        for key, count in PUBLISHED.items():
            for n in range(count):
                producer.publish(key, {"n": n})
        producer.flush()
    queues = {key: key_queue_name(stream.name, key) for key in PUBLISHED}
    ghost = key_queue_name(stream.name, "ghost")
    QueueRegistry(stream.redis, stream.name).register({ghost: "ghost"}, announce=False)
    return queues, ghost


@pytest.fixture
def world(stream: Any) -> World:
    queues, ghost = publish_and_register_a_ghost(stream)
    locks = FencedLocks(stream.redis, stream.name)
    owned = locks.acquire(queues["sensor-a"], OWNER, 120_000)
    orphaned = locks.acquire(queues["sensor-b"], GONE, 120_000)
    assert owned is not None and orphaned is not None
    Membership(stream.redis, stream.name, MEMBER_TTL_MS).heartbeat(
        OWNER, {"worker": OWNER, "events": 42, "batches": 7, "dead_lettered": 1}
    )
    return World(stream.name, queues, ghost, owned, orphaned, dead_letter_queue_name(stream.name))


# Every figure by a declare, exact at once, whatever the environment sets: a listing's figures
# are as old as the queue's last statistics (see test_with_a_listing_the_figures_come_from_it).
UNLISTED = {"prometheus_url": "", "management_url": ""}


def status_settings() -> Settings:
    return load_settings(member_ttl_ms=MEMBER_TTL_MS, **UNLISTED)


def check_against_world(
    status: dict[str, Any], world: World, amqp: pika.BlockingConnection
) -> None:
    """Every figure of ``status`` equals the real state."""
    assert (status["stream"], status["mode"], status["buckets"]) == (world.stream, "key", None)
    rows = {row["name"]: row for row in status["queues"]}
    assert set(rows) == {*world.queues.values(), world.ghost, world.dlq}
    for key, queue in world.queues.items():
        row = rows[queue]
        assert queue_depth(amqp, queue) == PUBLISHED[key] == row["depth"]
        flags = [row[f] for f in ("key", "consumers", "missing", "dead_letter")]
        assert flags == [key, 0, False, False]
        assert 0 <= row["idle_ms"] < 600_000
    owned, orphaned = rows[world.owned.queue], rows[world.orphaned.queue]
    owner = (owned["owner"], owned["token"], owned["owner_alive"])
    assert owner == (OWNER, world.owned.token, True)
    assert (orphaned["owner"], orphaned["owner_alive"]) == (GONE, False)
    for name in (world.queues["sensor-c"], world.ghost, world.dlq):
        assert rows[name]["owner"] is None and rows[name]["token"] is None
    ghost, dlq = rows[world.ghost], rows[world.dlq]
    assert queue_depth(amqp, world.ghost) is None
    assert (ghost["missing"], ghost["depth"], ghost["key"]) == (True, None, "ghost")
    assert queue_depth(amqp, world.dlq) == 0
    assert (dlq["dead_letter"], dlq["depth"]) == (True, 0)
    assert status["queues"][-1]["name"] == world.dlq
    # Deepest first, missing last.
    assert [row["depth"] for row in status["queues"] if not row["dead_letter"]] == [3, 2, 1, None]
    assert status["totals"] == {
        "queues": 4,
        "lag": sum(PUBLISHED.values()),
        "dead_letter_depth": 0,
        "held": 2,
        "unheld": 2,
        "missing": 1,
        "workers": 1,
        "events_per_s": status["totals"]["events_per_s"],
    }
    [worker] = status["workers"]
    figures = ("worker", "held", "events", "batches", "dead_lettered", "pid")
    assert {name: worker[name] for name in figures} == {
        "worker": OWNER,
        "held": 1,
        "events": 42,
        "batches": 7,
        "dead_lettered": 1,
        "pid": os.getpid(),
    }
    assert 0 <= worker["heartbeat_age_ms"] < MEMBER_TTL_MS


STATUS_ENV = {
    "KEYQ_MEMBER_TTL_MS": str(MEMBER_TTL_MS),
    **{f"KEYQ_{name.upper()}": value for name, value in UNLISTED.items()},
}


def keyq_status(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return run_keyq(settings, "status", *args, env=STATUS_ENV, timeout=60)


# Ctrl-C as a terminal sends it: a run started as a background job of a shell without job
# control inherits SIGINT ignored, and Python then keeps it ignored.
RUN_STATUS_CTRL_C = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "


def test_status_in_process_from_the_shell_watched_and_with_a_listing_down_is_the_real_state(
    world: World, settings: Settings, amqp: Any, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The table shows the deepest queues; ``--json --watch`` prints one object per refresh
    until Ctrl-C; a listing that does not answer falls back to declaring. Rates are in
    tests/test_status_rows.py and at the end of this test."""
    status = collect_status(status_settings(), world.stream)
    check_against_world(status, world, amqp)
    assert status["workers"][0]["events_per_s"] is None
    assert status["totals"]["events_per_s"] is None
    orjson.dumps(status)  # JSON-ready as it is

    text = render_table(status)
    for queue in (*world.queues.values(), world.ghost, world.dlq):
        assert queue in text
    assert OWNER in text
    assert f"{GONE} (not alive)" in text
    assert "more queues" not in text
    crowded = copy.deepcopy(status)
    extra = [
        {**status["queues"][0], "name": f"keyq.{world.stream}.k.extra-{n:03d}", "depth": n}
        for n in range(TABLE_LIMIT + 10)
    ]
    crowded["queues"] = sorted(extra, key=lambda row: -row["depth"]) + crowded["queues"]
    text = render_table(crowded)
    assert f"… and {len(crowded['queues']) - 1 - TABLE_LIMIT} more queues" in text
    assert f"extra-{TABLE_LIMIT + 9:03d}" in text  # the deepest is shown
    assert "extra-000" not in text

    done = keyq_status(settings, "--stream", world.stream, "--json")
    assert done.returncode == 0, done.stderr
    check_against_world(orjson.loads(done.stdout), world, amqp)
    done = keyq_status(settings, "--stream", world.stream)
    assert done.returncode == 0, done.stderr
    for queue in (*world.queues.values(), world.ghost, world.dlq):
        assert queue in done.stdout
    assert OWNER in done.stdout
    assert "lag 6" in done.stdout

    for listing in ("prometheus_url", "management_url"):
        caplog.clear()
        closed = f"http://guest:guest@127.0.0.1:{free_port()}"
        unanswered = load_settings(member_ttl_ms=MEMBER_TTL_MS, **(UNLISTED | {listing: closed}))
        check_against_world(collect_status(unanswered, world.stream), world, amqp)
        [warning] = [r.getMessage() for r in caplog.records if r.name == "keyq.status"]
        assert warning.startswith("queue figures by declaring instead: "), listing
        assert "did not answer" in warning and "guest:guest" not in warning, listing

    out_path = tmp_path / "out.jsonl"
    with out_path.open("wb") as out:
        command = [sys.executable, "-c", RUN_STATUS_CTRL_C + RUN_STATUS, "--stream", world.stream]
        process = subprocess.Popen(
            [*command, "--json", "--watch", "0.5"],
            stdout=out,
            stderr=subprocess.PIPE,
            env=keyq_environment(settings, STATUS_ENV),
            cwd=REPO,
        )
        try:
            # Start-up (imports, connections) is not part of the 1.5 s.
            wait_until(out_path.read_bytes, 30, "the first refresh")
            time.sleep(1.5)
            process.send_signal(signal.SIGINT)
            code = process.wait(30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    assert process.stderr is not None
    stderr = process.stderr.read().decode()
    assert code == 0, stderr
    assert "Traceback" not in stderr
    lines = out_path.read_bytes().splitlines()
    assert len(lines) >= 2
    snapshots = [orjson.loads(line) for line in lines]
    for snapshot in snapshots:
        check_against_world(snapshot, world, amqp)
    assert snapshots[0]["workers"][0]["events_per_s"] is None
    # The fake worker's counter stands still: a rate of zero from the second refresh on.
    assert all(s["workers"][0]["events_per_s"] == 0.0 for s in snapshots[1:])
    assert [s["at_ms"] for s in snapshots] == sorted(s["at_ms"] for s in snapshots)


def test_before_a_producer_status_fails_then_bucket_mode_shows_buckets_without_keys(
    stream: Any, settings: Settings, amqp: Any
) -> None:
    """A stream nothing produced to fails, and a bad name is a usage error, in one line."""
    done = keyq_status(settings, "--stream", stream.name)
    assert done.returncode == EXIT_FAILURE
    assert done.stderr.strip() == (
        f"keyq: stream {stream.name!r} has no producer yet (no config recorded in Redis)"
    )
    assert done.stdout == ""
    done = keyq_status(settings, "--stream", "no spaces")
    assert done.returncode == EXIT_USAGE
    assert done.stderr.startswith("keyq: Invalid value for '--stream': invalid stream name")
    assert len(done.stderr.strip().splitlines()) == 1
    one_each = load_settings(pack_max_events=1)  # depths count messages: one event each
    with Producer(stream.name, mode="bucket", buckets=4, settings=one_each) as producer:
        receipts = [producer.publish(key, {"n": 1}) for key in ("a", "b", "c", "d", "e")]
        producer.flush()
    status = collect_status(status_settings(), stream.name)
    assert (status["mode"], status["buckets"]) == ("bucket", 4)
    keyed = [row for row in status["queues"] if not row["dead_letter"]]
    assert {row["name"] for row in keyed} == {receipt.queue for receipt in receipts}
    for row in keyed:
        assert row["key"] is None  # a bucket queue holds many keys
        assert row["depth"] == queue_depth(amqp, row["name"])
    assert status["totals"]["lag"] == len(receipts)
    assert "mode bucket (4 buckets)" in render_table(status)


@pytest.mark.broker_versions
@pytest.mark.parametrize("source", ["prometheus", "management", "both"])
def test_with_a_listing_the_figures_come_from_it(
    source: str,
    stream: Any,
    private_rabbit: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A status of 100,000 queues cannot declare each one: with ``KEYQ_PROMETHEUS_URL`` or
    ``KEYQ_MANAGEMENT_URL`` the depths and consumers come from the broker's own listing, and
    agree with the queues themselves. rabbitmq_prometheus comes first; a queue it does not
    report (the ghost, never declared) is declared. On RabbitMQ 4.x, whose management metrics
    collection is off here, the management API alone answers 400: every queue is declared,
    with a warning that says what to set; with rabbitmq_prometheus too, nothing is said."""
    prometheus = source in ("prometheus", "both")
    management = source in ("management", "both")
    metrics_off = private_rabbit.release.rabbitmq_major >= 4
    settings = load_settings(
        amqp_url=private_rabbit.url,
        prometheus_url=private_rabbit.prometheus_url if prometheus else "",
        management_url=private_rabbit.management_url if management else "",
        member_ttl_ms=MEMBER_TTL_MS,
    )
    queues, ghost = publish_and_register_a_ghost(stream, settings)
    dlq = dead_letter_queue_name(stream.name)
    declared: list[str] = []
    real_declare = StatusReader._declare

    def counted(reader: StatusReader, names: list[str]) -> dict[str, tuple[int, int] | None]:
        declared.extend(names)
        return real_declare(reader, names)

    listings: list[str] = []
    real_listing = status_module.queue_figures

    def listing(*args: Any) -> dict[str, tuple[int, int] | None]:
        listings.append("management")
        return real_listing(*args)

    monkeypatch.setattr(StatusReader, "_declare", counted)
    monkeypatch.setattr(status_module, "queue_figures", listing)
    caplog.set_level(logging.WARNING, logger="keyq")
    amqp = pika.BlockingConnection(pika.URLParameters(private_rabbit.url))
    consumed = queues["sensor-b"]
    # Declared at each status: what the listing does not report, or everything.
    expected = [ghost] if prometheus else []
    if not prometheus and metrics_off:
        expected = [*queues.values(), ghost, dlq]
    try:
        holder = amqp.channel()  # a worker's consumer: one of its two events unacked
        holder.basic_qos(prefetch_count=1)
        holder.basic_consume(consumed, lambda *_args: None, exclusive=True)
        wait_until(lambda: queue_depth(amqp, consumed) == 1, 10, "one event delivered")
        real = {queue: queue_depth(amqp, queue) for queue in [*queues.values(), ghost, dlq]}

        def listed() -> dict[str, Any] | None:
            declared.clear()
            status = collect_status(settings, stream.name)
            depths = {row["name"]: row["depth"] for row in status["queues"]}
            consumers = {row["name"]: row["consumers"] for row in status["queues"]}
            settled = sorted(declared) == sorted(expected) and consumers[consumed] == 1
            return status if settled and depths == real else None

        # A new queue's figures reach the listing within seconds (till then it is declared),
        # and a listing's figures are as old as the queue's last statistics.
        status = wait_until(listed, 20, "the listing to give every queue's figures", every=0.5)
    finally:
        amqp.close()
        cleanup = pika.BlockingConnection(pika.URLParameters(private_rabbit.url))
        for queue in [*queues.values(), dlq]:
            cleanup.channel().queue_delete(queue)
        cleanup.close()
    rows = {row["name"]: row for row in status["queues"]}
    assert sorted(declared) == sorted(expected)
    assert {name: row["depth"] for name, row in rows.items()} == real
    assert real[queues["sensor-a"]] == PUBLISHED["sensor-a"]
    assert rows[ghost]["missing"] is True
    assert rows[consumed]["consumers"] == 1
    assert all(row["consumers"] == 0 for name, row in rows.items() if name not in (ghost, consumed))
    assert status["totals"]["lag"] == sum(PUBLISHED.values()) - 1  # one event is unacked
    assert bool(listings) == (source == "management")  # rabbitmq_prometheus comes first
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("keyq")]
    if source == "management" and metrics_off:
        assert warnings and all("KEYQ_PROMETHEUS_URL" in warning for warning in warnings)
        assert all("HTTP 400" in warning for warning in warnings), warnings
    else:
        assert warnings == []
    assert all("guest:guest" not in warning for warning in warnings)
