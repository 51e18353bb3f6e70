"""What a worker can hold: claim rate, broker memory, worker memory and renewal cost per queue.

A worker holds a queue with a fenced Redis lock and an exclusive consumer on a channel of its
own. This benchmark claims ``--queues`` empty key-mode queues the way a worker does, in claim
rounds (one script for the locks, one I/O-thread call for the consumers), against the same
claims made one at a time (a lock, then a consume, each its own round trip: how workers
claimed before claim rounds), on a private RabbitMQ node with the management API (for its
memory) and the Redis of ``KEYQ_REDIS_URL``. Renewal is timed as the claim loop does it:
every held lock in one script.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import declare_queues, emit, log, machine_info, positive, ratio
from bench.janitor import broker_memory
from keyq.broker.connections import open_redis
from keyq.broker.locks import FencedLocks, Lease
from keyq.broker.naming import key_queue_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.settings import Settings, load_settings
from keyq.worker.consumer import ConsumeOutcome, ConsumerLink
from keyq.worker.deliveries import DeliveryBuffer
from tests.servers import PrivateRabbit

ROUND = 50
TTL_MS = 60_000
RENEWALS = 21


def rss_bytes() -> int:
    """This process's resident memory now."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def start_link(settings: Settings, stream: str) -> ConsumerLink:
    link = ConsumerLink(
        settings=settings,
        stream=stream,
        name="bench-capacity",
        buffer=DeliveryBuffer(),
        prefetch=100,
        on_queue_lost=lambda *_args: None,
        on_disconnected=lambda _reason: None,
    )
    link.start()
    return link


def claim_one_at_a_time(
    link: ConsumerLink, locks: FencedLocks, queues: Sequence[str]
) -> list[Lease]:
    leases = []
    for queue in queues:
        lease = locks.acquire(queue, "bench-single", TTL_MS)
        assert lease is not None
        assert link.consume(queue, link.new_epoch()).outcome is ConsumeOutcome.CONSUMING
        leases.append(lease)
    return leases


def claim_in_rounds(link: ConsumerLink, locks: FencedLocks, queues: Sequence[str]) -> list[Lease]:
    leases: list[Lease] = []
    for start in range(0, len(queues), ROUND):
        taken = locks.acquire_many(queues[start : start + ROUND], "bench-rounds", TTL_MS)
        results = link.consume_many([(lease.queue, link.new_epoch()) for lease in taken])
        assert all(r.outcome is ConsumeOutcome.CONSUMING for r in results)
        leases.extend(taken)
    return leases


def measure(settings: Settings, stream: str, queues: Sequence[str], rounds: bool) -> dict[str, Any]:
    """One way of claiming, in a process of its own (so that its memory is its own): the
    claims' time, then memory and renewal cost while everything is held."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        result: dict[str, Any] = pool.apply(
            _measure, (settings.model_dump(), stream, queues, rounds)
        )
    time.sleep(6)  # the node's memory figure is refreshed every few seconds
    released = broker_memory(settings)
    held = result.pop("broker_bytes_held")
    result["broker_bytes_per_held_queue"] = (
        None if held is None or released is None else (held - released) // len(queues)
    )
    return result


def _measure(
    dumped: dict[str, Any], stream: str, queues: Sequence[str], rounds: bool
) -> dict[str, Any]:
    settings = load_settings(**dumped)
    client = open_redis(settings)
    locks = FencedLocks(client, stream)
    link = start_link(settings, stream)
    try:
        rss_before = rss_bytes()
        started = time.perf_counter()
        if rounds:
            leases = claim_in_rounds(link, locks, queues)
        else:
            leases = claim_one_at_a_time(link, locks, queues)
        seconds = time.perf_counter() - started
        time.sleep(6)  # the node's memory figure is refreshed every few seconds
        broker_held, rss_held = broker_memory(settings), rss_bytes()
        renewals = []
        for _ in range(RENEWALS):
            renew_started = time.perf_counter()
            locks.renew(leases, TTL_MS)
            renewals.append(time.perf_counter() - renew_started)
        locks.release(leases)
    finally:
        link.stop()
        client.close()
    return {
        "queues": len(queues),
        "claim_s": round(seconds, 3),
        "claims_per_s": round(len(queues) / seconds, 1),
        "broker_bytes_held": broker_held,
        "worker_rss_bytes_per_held_queue": (rss_held - rss_before) // len(queues),
        "renew_all_ms_median": round(statistics.median(renewals) * 1000, 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__)
    parser.add_argument("--queues", type=positive, default=2000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    base = load_settings()
    params = {"queues": args.queues, "round": ROUND, "out": str(args.out) if args.out else None}
    result: dict[str, Any] = {"benchmark": "capacity", "machine": machine_info(), "params": params}
    stream = f"bench-cap-{uuid.uuid4().hex[:6]}"
    queues = [key_queue_name(stream, f"device-{n:05d}") for n in range(args.queues)]
    with tempfile.TemporaryDirectory(prefix="keyq-bench-capacity-") as folder:
        rabbit = PrivateRabbit(Path(folder), management=True).start()
        try:
            settings = load_settings(
                redis_url=base.redis_url,
                amqp_url=rabbit.url,
                management_url=rabbit.management_url,
            )
            link = start_link(settings, stream)
            try:
                result["channel_capacity"] = link.capacity
            finally:
                link.stop()
            declare_started = time.perf_counter()
            declare_queues(settings, queues)
            log(f"declared {len(queues):,} queues in {time.perf_counter() - declare_started:.1f} s")
            single = measure(settings, stream, queues, rounds=False)
            log(f"one at a time: {single}")
            batched = measure(settings, stream, queues, rounds=True)
            log(f"claim rounds: {batched}")
        finally:
            rabbit.stop()
            client = open_redis(base)
            keys = StreamKeys(stream)
            for pattern in keys.all_patterns():
                for key in client.scan_iter(match=pattern, count=1000):
                    client.delete(key)
            client.close()
    result["one_at_a_time"] = single
    result["claim_rounds"] = batched
    result["claims_speedup"] = ratio(batched["claims_per_s"], single["claims_per_s"])
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
