"""Reclaiming idle key-mode queues: keyq's janitor against raw pika deletes, and what the
broker's memory does.

One run:

* creates ``--queues`` key-mode queues the way producers leave them (declared with keyq's
  arguments, registered in Redis with their keys, one event published and then drained);
* measures the broker's memory (the management API's ``mem_used``, when
  ``KEYQ_MANAGEMENT_URL`` is set) before, with every queue there, and
  after the janitor reclaimed them all;
* times the janitor (production settings: 5 s retirement grace, batches of 5,000, 4
  connections) from its first pass until the registry is empty, and reports deletes/s;
* as the baseline, deletes ``--baseline-queues`` fresh queues with raw pika on one channel
  (``queue.delete`` with if_empty/if_unused, one after another).

Progress goes to stderr; one JSON object to stdout (and ``--out``).

Usage: ``python -m bench.janitor [--queues N] [--baseline-queues M] [--out FILE]``
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pika

from bench.common import Cleanup, amqp, declare_queues, emit, log, machine_info
from keyq.broker.connections import open_redis
from keyq.broker.errors import KeyqError, ManagementUnavailable
from keyq.broker.management import get_json
from keyq.broker.naming import key_queue_name
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import ensure_stream_config
from keyq.broker.topology import keyed_queue_arguments
from keyq.janitor.config import JanitorSettings
from keyq.janitor.janitor import Janitor

CREATE_CONNECTIONS = 8


def broker_memory(settings: Settings) -> int | None:
    """The broker's memory in bytes (every node's ``mem_used`` from the management API), or
    None when ``KEYQ_MANAGEMENT_URL`` is not set or the API does not answer."""
    if not settings.management_url:
        return None
    try:
        nodes = get_json(settings.management_url, "/api/nodes", timeout=30)
    except ManagementUnavailable:
        return None
    used = [node.get("mem_used") for node in nodes if isinstance(node, dict)]
    return sum(int(value) for value in used if value) or None


def create_queues(settings: Settings, stream: str, count: int) -> list[str]:
    """Declare, fill with one event, drain, and register ``count`` key-mode queues."""
    keys = [f"device-{i:06d}" for i in range(count)]
    names = [key_queue_name(stream, key) for key in keys]
    arguments = keyed_queue_arguments(stream)
    chunks = [names[i::CREATE_CONNECTIONS] for i in range(CREATE_CONNECTIONS)]

    def build(chunk: list[str]) -> None:
        declare_queues(settings, chunk, arguments)
        with amqp(settings, "bench-janitor-fill") as connection:
            channel = connection.channel()
            for name in chunk:
                channel.basic_publish("", name, orjson.dumps({"n": 1}))
            channel.basic_qos(prefetch_count=0)  # a round trip: every publish has landed
            for name in chunk:
                channel.queue_purge(name)

    with ThreadPoolExecutor(max_workers=CREATE_CONNECTIONS) as pool:
        list(pool.map(build, chunks))
    client = open_redis(settings)
    try:
        registry = QueueRegistry(client, stream)
        for start in range(0, count, 5000):
            batch = dict(zip(names[start : start + 5000], keys[start : start + 5000], strict=True))
            registry.register(batch, announce=False)
    finally:
        client.close()
    return names


def raw_delete_rate(settings: Settings, stream: str, count: int) -> float:
    names = [f"keyq.{stream}.k.raw-{i:06d}" for i in range(count)]
    declare_queues(settings, names, keyed_queue_arguments(stream))
    with amqp(settings, "bench-raw-delete") as connection:
        channel = connection.channel()
        started = time.perf_counter()
        for name in names:
            channel.queue_delete(name, if_unused=True, if_empty=True)
        return count / (time.perf_counter() - started)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.janitor", description=__doc__)
    parser.add_argument("--queues", type=int, default=20_000)
    parser.add_argument("--baseline-queues", type=int, default=5_000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    settings = load_settings()
    params = {**vars(args), "out": str(args.out) if args.out else None}
    result: dict[str, Any] = {"benchmark": "janitor", "machine": machine_info(), "params": params}
    errors: list[str] = []
    stream = f"bench-jan-{uuid.uuid4().hex[:6]}"
    cleanup = Cleanup(settings)
    cleanup.add_stream(stream)
    try:
        client = open_redis(settings)
        ensure_stream_config(client, stream, "key")
        memory_before = broker_memory(settings)
        started = time.perf_counter()
        names = create_queues(settings, stream, args.queues)
        created_s = time.perf_counter() - started
        log(f"created, drained and registered {len(names):,} queues in {created_s:.1f} s")
        memory_peak = broker_memory(settings)
        janitor = Janitor(
            [stream], settings=load_settings(JanitorSettings, idle_ttl_s=0), janitor_id="bench"
        )
        registry = QueueRegistry(client, stream)
        started = time.perf_counter()
        passes = 0
        while registry.count() and passes < 50:
            janitor.run(once=True)
            passes += 1
            log(f"pass {passes}: {registry.count():,} queues left, stats {dict(janitor.stats)}")
        reclaim_s = time.perf_counter() - started
        time.sleep(2)  # let the broker hand memory back before reading it
        memory_after = broker_memory(settings)
        deleted = janitor.stats["deleted"]
        grace_s = passes * janitor.settings.retire_grace_ms / 1000
        result.update(
            {
                "queues": len(names),
                "create_seconds": round(created_s, 1),
                "janitor_passes": passes,
                "janitor_deleted": deleted,
                "janitor_stats": dict(janitor.stats),
                "janitor_seconds": round(reclaim_s, 2),
                "janitor_deletes_per_s": round(deleted / reclaim_s),
                "janitor_deletes_per_s_outside_grace": round(deleted / (reclaim_s - grace_s))
                if reclaim_s > grace_s
                else None,
                "broker_memory_bytes": {
                    "before": memory_before,
                    "peak": memory_peak,
                    "after": memory_after,
                },
                "broker_memory_per_queue_bytes": round((memory_peak - memory_before) / len(names))
                if memory_peak and memory_before
                else None,
            }
        )
        if registry.count():
            errors.append(f"{registry.count()} queues were not reclaimed")
        if deleted != len(names):
            errors.append(f"the janitor deleted {deleted} of {len(names)} queues")
        baseline = raw_delete_rate(settings, stream, args.baseline_queues)
        log(f"raw pika deletes, one channel: {baseline:,.0f}/s")
        result["raw_pika_deletes_per_s"] = round(baseline)
        result["janitor_over_raw"] = round(result["janitor_deletes_per_s"] / baseline, 2)
        client.close()
    except (KeyqError, pika.exceptions.AMQPError, OSError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        try:
            cleanup.run()
        except (KeyqError, pika.exceptions.AMQPError, OSError) as exc:
            errors.append(f"cleanup failed: {exc}")
    result["errors"] = errors
    emit(result, args.out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
