"""``keyq status`` at scale: one management API listing against a passive declare per queue.

Registers ``--queues`` key-mode queues of one stream (declared on a private RabbitMQ node with
the management API, registered in the Redis of ``KEYQ_REDIS_URL``), then times
``collect_status`` with ``KEYQ_MANAGEMENT_URL`` set and without it (the baseline: AMQP cannot
list queues, so every queue is declared passively), and checks that both report the same
depths.
"""

from __future__ import annotations

import argparse
import cProfile
import tempfile
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import (
    declare_queues,
    emit,
    log,
    machine_info,
    positive,
    ratio,
    stream_redis_keys,
)
from keyq.broker.connections import open_redis
from keyq.broker.management import queue_figures
from keyq.broker.naming import key_queue_name
from keyq.broker.registry import QueueRegistry
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import ensure_stream_config
from keyq.ops.status import collect_status
from tests.servers import PrivateRabbit

DECLARE_CONNECTIONS = 4
REGISTER_CHUNK = 10_000


def timed_status(settings: Settings, stream: str) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    status = collect_status(settings, stream)
    return time.perf_counter() - started, status


def depths(status: dict[str, Any]) -> dict[str, Any]:
    return {row["name"]: row["depth"] for row in status["queues"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.status", description=__doc__)
    parser.add_argument("--queues", type=positive, default=100_000)
    parser.add_argument("--profile", action="store_true", help="profile one status call")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    base = load_settings()
    params = {"queues": args.queues, "out": str(args.out) if args.out else None}
    result: dict[str, Any] = {"benchmark": "status", "machine": machine_info(), "params": params}
    stream = f"bench-status-{uuid.uuid4().hex[:6]}"
    names = [key_queue_name(stream, f"device-{n:06d}") for n in range(args.queues)]
    client = open_redis(base)
    with tempfile.TemporaryDirectory(prefix="keyq-bench-status-") as folder:
        rabbit = PrivateRabbit(Path(folder), management=True).start()
        try:
            plain = load_settings(redis_url=base.redis_url, amqp_url=rabbit.url)
            listed = load_settings(
                redis_url=base.redis_url,
                amqp_url=rabbit.url,
                management_url=rabbit.management_url,
            )
            ensure_stream_config(client, stream, mode="key")
            started = time.perf_counter()
            parts = [names[i::DECLARE_CONNECTIONS] for i in range(DECLARE_CONNECTIONS)]
            with ThreadPoolExecutor(DECLARE_CONNECTIONS) as pool:
                list(pool.map(lambda part: declare_queues(plain, part), parts))
            registry = QueueRegistry(client, stream)
            for start in range(0, len(names), REGISTER_CHUNK):
                chunk = names[start : start + REGISTER_CHUNK]
                registry.register(dict.fromkeys(chunk), announce=False)
            took = time.perf_counter() - started
            log(f"declared and registered {len(names):,} queues in {took:.0f} s")
            time.sleep(10)  # every queue's figures reach the management API
            listing_started = time.perf_counter()
            queue_figures(rabbit.management_url or "", "/", 60)
            result["listing_alone_s"] = round(time.perf_counter() - listing_started, 2)
            log(f"the management API's listing alone: {result['listing_alone_s']:.2f} s")
            if args.profile:
                cProfile.runctx(
                    "timed_status(listed, stream)", globals(), locals(), sort="cumulative"
                )
            listing_s, by_listing = timed_status(listed, stream)
            log(f"status from the management API: {listing_s:.2f} s")
            declaring_s, by_declaring = timed_status(plain, stream)
            log(f"status by declaring every queue: {declaring_s:.2f} s")
        finally:
            rabbit.stop()
            leftovers = stream_redis_keys(client, stream)
            if leftovers:
                client.delete(*leftovers)
            client.close()
    result["status_s"] = {"management_api": round(listing_s, 2), "declares": round(declaring_s, 2)}
    result["speedup"] = ratio(declaring_s, listing_s)
    result["same_depths"] = depths(by_listing) == depths(by_declaring)
    result["queues_reported"] = by_listing["totals"]["queues"]
    emit(result, args.out)
    return 0 if result["same_depths"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
