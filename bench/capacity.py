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
from keyq.broker.errors import ManagementUnavailable
from keyq.broker.locks import FencedLocks, Lease
from keyq.broker.management import get_json
from keyq.broker.naming import key_queue_name
from keyq.broker.settings import Settings, load_settings
from keyq.worker.amqp.consume_rounds import ConsumeOutcome
from keyq.worker.amqp.link import ConsumerLink
from tests.servers import PrivateRabbit
from tests.workers import bare_link

ROUND = 50
TTL_MS = 60_000
RENEWALS = 21


# The parts of a node's memory that a held queue adds to: its channel, and its consumer's
# state inside the queue process (``/api/nodes/NAME/memory``).
HOLDING_PARTS = ("connection_channels", "connection_other", "queue_procs")


def holding_memory(settings: Settings) -> int | None:
    """The node's memory in the parts a held queue costs, in bytes; None without the API."""
    if not settings.management_url:
        return None
    try:
        [node] = get_json(settings.management_url, "/api/nodes?columns=name", 30)
        report = get_json(settings.management_url, f"/api/nodes/{node['name']}/memory", 30)
    except ManagementUnavailable:
        return None
    memory = report.get("memory", {})
    return sum(int(memory.get(part, 0)) for part in HOLDING_PARTS)


def rss_bytes() -> int:
    """This process's resident memory now."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def start_link(settings: Settings, stream: str) -> ConsumerLink:
    link = bare_link(settings, stream, "bench-capacity", prefetch=100)
    link.start()
    return link


def claim_one_at_a_time(
    link: ConsumerLink, locks: FencedLocks, queues: Sequence[str]
) -> list[Lease]:
    leases = []
    for queue in queues:
        lease = locks.acquire(queue, "bench-single", TTL_MS)
        assert lease is not None
        assert (
            link.consumers.consume(queue, link.consumers.new_epoch()).outcome
            is ConsumeOutcome.CONSUMING
        )
        leases.append(lease)
    return leases


def claim_in_rounds(link: ConsumerLink, locks: FencedLocks, queues: Sequence[str]) -> list[Lease]:
    leases: list[Lease] = []
    for start in range(0, len(queues), ROUND):
        taken = locks.acquire_many(queues[start : start + ROUND], "bench-rounds", TTL_MS)
        results = link.consumers.consume_many(
            [(lease.queue, link.consumers.new_epoch()) for lease in taken]
        )
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
    time.sleep(2)
    released = holding_memory(settings)
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
        broker_held, rss_held = holding_memory(settings), rss_bytes()
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


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the runs (None if any run could not measure it)."""
    merged: dict[str, Any] = {}
    for name in runs[0]:
        values = [run[name] for run in runs]
        merged[name] = None if None in values else statistics.median(values)
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__)
    parser.add_argument("--queues", type=positive, default=2000)
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    base = load_settings()
    params = {
        "queues": args.queues,
        "repeats": args.repeats,
        "round": ROUND,
        "out": str(args.out) if args.out else None,
    }
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
            runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
            for _ in range(args.repeats):  # alternated, so that drift hits both alike
                for rounds in (False, True):
                    runs[rounds].append(measure(settings, stream, queues, rounds=rounds))
                    log(f"{'claim rounds' if rounds else 'one at a time'}: {runs[rounds][-1]}")
            single, batched = medians(runs[False]), medians(runs[True])
        finally:
            rabbit.stop()
            client = open_redis(base)
            leftovers = stream_redis_keys(client, stream)
            if leftovers:
                client.delete(*leftovers)
            client.close()
    result["one_at_a_time"] = single
    result["claim_rounds"] = batched
    result["claims_speedup"] = ratio(batched["claims_per_s"], single["claims_per_s"])
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
