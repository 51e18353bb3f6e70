"""Producer throughput: keyq's SDK against raw pika on the same broker, payloads and keys.

Variants, each measured ``--repeats`` times in alternating order:

* ``raw_pika_unconfirmed``: BlockingConnection, persistent ``basic_publish`` to pre-declared
  durable queues through the default exchange, no confirms: the ceiling.
* ``raw_pika_confirm_each``: the same on a confirm-mode channel, each publish waiting for its
  confirm (and ``mandatory``, as keyq publishes).
* ``keyq``: ``Producer`` in key mode on a fresh stream; publish all, then ``flush``.
* ``new_keys``: keyq where every event has a fresh key, so one queue per event.
* ``raw_pika_new_queues``: the same fresh keys with raw pika: declare each durable queue
  (keyq's arguments) and publish one persistent event to it, on one channel.
* ``raw_pika_new_queues_parallel``: the same over four connections at once, a thread each:
  the broker's own ceiling for creating queues on this machine, which bounds ``new_keys``.

Raw variants send the same properties keyq does (persistent, content type, message id,
timestamp and keyq's five headers) and serialise the same dicts with orjson per event.
After each run the queues' message counts (and for keyq the Redis registry) are checked, and
everything the run created is deleted. Progress goes to stderr; one JSON object to stdout.

Usage: ``python -m bench.producer [--events N] [--keys K] [--payload-bytes B] [--repeats R]
[--new-keys M] [--out FILE]``
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pika
import pika.exceptions
import redis
from prometheus_client import CollectorRegistry

from bench.common import (
    Cleanup,
    amqp,
    declare_queues,
    emit,
    log,
    machine_info,
    mean_size,
    measure_then_clean,
    median,
    message_counts,
    non_negative,
    pad_for,
    padded_event,
    positive,
    publish_all,
    ratio,
    wait_for_total,
)
from keyq import Producer
from keyq.broker.clock import now_ms
from keyq.broker.connections import open_redis
from keyq.broker.envelope import (
    CONTENT_JSON,
    HEADER_KEY,
    HEADER_PRODUCER,
    HEADER_PUBLISHED_AT,
    HEADER_SEQ,
    HEADER_STREAM,
)
from keyq.broker.naming import dead_letter_queue_name, key_queue_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.settings import Settings, load_settings
from keyq.broker.topology import keyed_queue_arguments

RAW_UNCONFIRMED = "raw_pika_unconfirmed"
RAW_CONFIRM_EACH = "raw_pika_confirm_each"
KEYQ = "keyq"
KEYQ_METRICS = "keyq_metrics"  # keyq with its Prometheus metrics on (a private registry)
NEW_KEYS = "new_keys"
RAW_NEW_QUEUES = "raw_pika_new_queues"
RAW_NEW_PARALLEL = "raw_pika_new_queues_parallel"
NEW_QUEUE_VARIANTS = (NEW_KEYS, RAW_NEW_QUEUES, RAW_NEW_PARALLEL)
PARALLEL_CONNECTIONS = 4
THROUGHPUT_VARIANTS = (RAW_UNCONFIRMED, RAW_CONFIRM_EACH, KEYQ, KEYQ_METRICS)
SHORT_NAMES = {
    RAW_UNCONFIRMED: "raw",
    RAW_CONFIRM_EACH: "rawc",
    KEYQ: "kq",
    KEYQ_METRICS: "kqm",
    NEW_KEYS: "nk",
    RAW_NEW_QUEUES: "rnk",
    RAW_NEW_PARALLEL: "rnkp",
}

TARGET_KEYQ_VS_RAW = 0.8
TARGET_NEW_KEYS_PER_S = 1000.0
TARGET_NEW_KEYS_VS_CEILING = 0.9
CONFIRM_WINDOW = 10_000
FLUSH_TIMEOUT_S = 600.0
NEW_KEYS_SAMPLE = 50

Events = list[tuple[str, dict[str, Any]]]


@dataclass
class Run:
    """Parameters and results of one benchmark invocation."""

    events: int
    keys: int
    payload_bytes: int
    repeats: int
    new_keys: int
    distribution: str
    seed: int
    variants: tuple[str, ...] = (*THROUGHPUT_VARIANTS, *NEW_QUEUE_VARIANTS)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    rates: dict[str, list[float]] = field(default_factory=dict)
    seconds: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def stream(self, variant: str, repeat: int) -> str:
        return f"bench-{self.run_id}-{SHORT_NAMES[variant]}-{repeat}"

    def record(self, variant: str, count: int, elapsed: float) -> float:
        rate = count / elapsed
        self.rates.setdefault(variant, []).append(round(rate, 1))
        self.seconds.setdefault(variant, []).append(round(elapsed, 4))
        return rate


# ------------------------------------------------------------------------------ workload
def key_names(count: int) -> list[str]:
    return [f"key-{index:05d}" for index in range(count)]


def make_events(run: Run) -> Events:
    """``run.events`` events over ``run.keys`` keys, round robin or seeded random."""
    keys = key_names(run.keys)
    pad = pad_for(run.payload_bytes, keys[0])
    chooser = random.Random(run.seed)
    events: Events = []
    for index in range(run.events):
        if run.distribution == "random":
            key = keys[chooser.randrange(len(keys))]
        else:
            key = keys[index % len(keys)]
        events.append((key, padded_event(index, key, pad)))
    return events


def make_new_key_events(run: Run) -> Events:
    """``run.new_keys`` events, each with a key of its own."""
    pad = pad_for(run.payload_bytes, "nk-000000")
    keys = [f"nk-{index:06d}" for index in range(run.new_keys)]
    return [(key, padded_event(index, key, pad)) for index, key in enumerate(keys)]


# ------------------------------------------------------------------------------ variants
def publish_raw(
    channel: Any, stream: str, events: Events, queue_of: dict[str, str], mandatory: bool
) -> None:
    """Publish every event as keyq would (same properties and headers), minus keyq itself."""
    producer_id = uuid.uuid4().hex
    seqs: dict[str, int] = {}
    publish = channel.basic_publish
    for number, (key, event) in enumerate(events, 1):
        seq = seqs.get(key, 0) + 1
        seqs[key] = seq
        published_at = now_ms()
        properties = pika.BasicProperties(
            delivery_mode=pika.DeliveryMode.Persistent,
            content_type=CONTENT_JSON,
            message_id=f"{producer_id}:{number}",
            timestamp=published_at // 1000,
            headers={
                HEADER_STREAM: stream,
                HEADER_KEY: key,
                HEADER_PRODUCER: producer_id,
                HEADER_SEQ: seq,
                HEADER_PUBLISHED_AT: published_at,
            },
        )
        publish("", queue_of[key], orjson.dumps(event), properties, mandatory=mandatory)


def run_raw(
    run: Run, settings: Settings, cleanup: Cleanup, events: Events, stream: str, confirm: bool
) -> tuple[float, list[str]]:
    """One raw pika run; returns the elapsed seconds and the queues it filled."""
    queue_of = {key: key_queue_name(stream, key) for key in key_names(run.keys)}
    queues = sorted(set(queue_of.values()))
    cleanup.add_queues(queues)
    declare_queues(settings, queues, keyed_queue_arguments(stream))
    with amqp(settings, f"bench-{stream}") as connection:
        channel = connection.channel()
        if confirm:
            channel.confirm_delivery()
        started = time.perf_counter()
        publish_raw(channel, stream, events, queue_of, mandatory=confirm)
        if not confirm:
            # A synchronous round trip on the same channel: the broker has taken every
            # publish before it answers (the unconfirmed run is not timed to the last write).
            channel.basic_qos(prefetch_count=0)
        elapsed = time.perf_counter() - started
    return elapsed, queues


def run_keyq(
    settings: Settings, cleanup: Cleanup, events: Events, stream: str, *, metrics: bool = False
) -> tuple[float, list[str]]:
    """One keyq run in key mode (``metrics``: into a registry of its own); returns the
    elapsed seconds and the queues it filled."""
    cleanup.add_stream(stream)
    cleanup.add_queues([dead_letter_queue_name(stream)])
    queues = sorted({key_queue_name(stream, key) for key, _ in events})
    cleanup.add_queues(queues)
    registry = CollectorRegistry() if metrics else False
    with Producer(
        stream, mode="key", settings=settings, confirm_window=CONFIRM_WINDOW, metrics=registry
    ) as p:
        elapsed = publish_all(p, events, FLUSH_TIMEOUT_S)
        stats = p.stats
    if stats["returned"] or stats["resent"]:
        log(f"  note: keyq returned={stats['returned']} resent={stats['resent']}")
    return elapsed, queues


def run_raw_new_queues(
    settings: Settings, cleanup: Cleanup, events: Events, stream: str
) -> tuple[float, list[str]]:
    """Declare a queue per fresh key and publish one event to it, with plain pika."""
    queue_of = {key: key_queue_name(stream, key) for key, _ in events}
    queues = sorted(queue_of.values())
    cleanup.add_queues(queues)
    with amqp(settings, f"bench-{stream}") as connection:
        work = [(queue_of[key], event) for key, event in events]
        started = time.perf_counter()
        declare_and_publish(connection, work, keyed_queue_arguments(stream))
        elapsed = time.perf_counter() - started
    return elapsed, queues


def declare_and_publish(
    connection: pika.BlockingConnection,
    work: Sequence[tuple[str, dict[str, Any]]],
    arguments: dict[str, Any],
) -> None:
    """Declare each queue (keyq's arguments) and publish one persistent event to it."""
    channel = connection.channel()
    for queue, event in work:
        channel.queue_declare(queue, durable=True, arguments=arguments)
        channel.basic_publish(
            "",
            queue,
            orjson.dumps(event),
            pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent),
        )
    channel.basic_qos(prefetch_count=0)  # a round trip: the broker has taken everything


def run_raw_new_queues_parallel(
    settings: Settings, cleanup: Cleanup, events: Events, stream: str
) -> tuple[float, list[str]]:
    """The same as ``run_raw_new_queues`` over ``PARALLEL_CONNECTIONS`` connections at once
    (connections opened before the clock starts)."""
    queue_of = {key: key_queue_name(stream, key) for key, _ in events}
    queues = sorted(queue_of.values())
    cleanup.add_queues(queues)
    work = [(queue_of[key], event) for key, event in events]
    slices = [work[n::PARALLEL_CONNECTIONS] for n in range(PARALLEL_CONNECTIONS)]
    connections = [
        pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
        for _ in range(PARALLEL_CONNECTIONS)
    ]
    failures: list[BaseException] = []

    def run_slice(connection: pika.BlockingConnection, part: list[tuple[str, Any]]) -> None:
        try:
            declare_and_publish(connection, part, keyed_queue_arguments(stream))
        except BaseException as exc:  # noqa: BLE001 - reported after the join
            failures.append(exc)

    try:
        threads = [
            threading.Thread(target=run_slice, args=(connection, part))
            for connection, part in zip(connections, slices, strict=True)
        ]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
    finally:
        for connection in connections:
            if connection.is_open:
                connection.close()
    if failures:
        raise failures[0]
    return elapsed, queues


# ------------------------------------------------------------------------------- checks
def check_total(
    run: Run, settings: Settings, variant: str, queues: Sequence[str], expected: int
) -> None:
    # keyq packs events: its queues are counted in events, the raw variants' in messages.
    total, missing = wait_for_total(
        settings, queues, expected, events=variant in (KEYQ, KEYQ_METRICS)
    )
    if missing or total != expected:
        run.errors.append(
            f"{variant}: {total} events in {len(queues)} queues, expected {expected}"
            + (f"; {len(missing)} queues missing, e.g. {missing[:3]}" if missing else "")
        )


def check_registry(run: Run, client: redis.Redis, variant: str, stream: str, expected: int) -> int:
    registered = int(client.zcard(StreamKeys(stream).registry))
    if registered != expected:
        run.errors.append(
            f"{variant}: {registered} queues registered in Redis, expected {expected}"
        )
    return registered


def check_new_keys(
    run: Run, settings: Settings, client: redis.Redis, stream: str, queues: Sequence[str]
) -> None:
    """Every fresh key got a queue: registry count, and a sample holding one message each."""
    check_registry(run, client, NEW_KEYS, stream, len(queues))
    sample = random.Random(run.seed).sample(list(queues), min(NEW_KEYS_SAMPLE, len(queues)))
    counts = message_counts(settings, sample)
    wrong = {queue: count for queue, count in counts.items() if count != 1}
    if wrong:
        run.errors.append(
            f"{NEW_KEYS}: {len(wrong)} of {len(sample)} sampled queues missing or not holding "
            f"exactly one message, e.g. {sorted(wrong.items())[:3]}"
        )


# --------------------------------------------------------------------------------- main
def measure(run: Run, settings: Settings, cleanup: Cleanup) -> None:
    """All repeats of all variants, cleaning up after each run."""
    events = make_events(run)
    chosen = tuple(variant for variant in THROUGHPUT_VARIANTS if variant in run.variants)
    log(
        f"{run.events} events over {run.keys} keys ({run.distribution}), "
        f"payload ~{mean_size(events[:1000]):.0f} bytes, {run.repeats} repeats, run {run.run_id}"
    )
    client = open_redis(settings)
    try:
        for repeat in range(run.repeats):
            order = chosen if repeat % 2 == 0 else chosen[::-1]
            for variant in order:
                stream = run.stream(variant, repeat)
                if variant in (KEYQ, KEYQ_METRICS):
                    metered = variant == KEYQ_METRICS
                    elapsed, queues = run_keyq(settings, cleanup, events, stream, metrics=metered)
                else:
                    confirm = variant == RAW_CONFIRM_EACH
                    elapsed, queues = run_raw(run, settings, cleanup, events, stream, confirm)
                rate = run.record(variant, len(events), elapsed)
                log(f"repeat {repeat + 1}/{run.repeats} {variant}: {rate:,.0f} events/s")
                check_total(run, settings, variant, queues, len(events))
                if variant in (KEYQ, KEYQ_METRICS):
                    check_registry(run, client, variant, stream, len(queues))
                cleanup.run()

        fresh = make_new_key_events(run) if run.new_keys else []
        creators = tuple(v for v in NEW_QUEUE_VARIANTS if v in run.variants)
        for repeat in range(run.repeats if fresh else 0):
            for variant in creators if repeat % 2 == 0 else creators[::-1]:
                stream = run.stream(variant, repeat)
                if variant == NEW_KEYS:
                    elapsed, queues = run_keyq(settings, cleanup, fresh, stream)
                elif variant == RAW_NEW_PARALLEL:
                    elapsed, queues = run_raw_new_queues_parallel(settings, cleanup, fresh, stream)
                else:
                    elapsed, queues = run_raw_new_queues(settings, cleanup, fresh, stream)
                rate = run.record(variant, len(fresh), elapsed)
                log(f"repeat {repeat + 1}/{run.repeats} {variant}: {rate:,.0f} new queues/s")
                if variant == NEW_KEYS:
                    check_new_keys(run, settings, client, stream, queues)
                else:
                    check_total(run, settings, variant, queues, len(fresh))
                cleanup.run()
    finally:
        client.close()


def report(run: Run, machine: dict[str, Any]) -> dict[str, Any]:
    """The machine-readable summary."""
    machine = {**machine, "loadavg_end": list(os.getloadavg())}
    medians = {variant: median(rates) for variant, rates in run.rates.items()}
    variants: dict[str, Any] = {}
    for variant in (*THROUGHPUT_VARIANTS, *NEW_QUEUE_VARIANTS):
        if variant in run.rates:
            variants[variant] = {
                "unit": "new queues/s" if variant in NEW_QUEUE_VARIANTS else "events/s",
                "rates": run.rates[variant],
                "seconds": run.seconds[variant],
                "median": medians[variant],
            }
    vs_raw = ratio(medians.get(KEYQ), medians.get(RAW_UNCONFIRMED))
    vs_confirm = ratio(medians.get(KEYQ), medians.get(RAW_CONFIRM_EACH))
    metered = ratio(medians.get(KEYQ_METRICS), medians.get(KEYQ))
    new_keys = medians.get(NEW_KEYS)
    vs_raw_new = ratio(new_keys, medians.get(RAW_NEW_QUEUES))
    vs_ceiling = ratio(new_keys, medians.get(RAW_NEW_PARALLEL))
    targets = {
        "keyq/raw_pika_unconfirmed": {
            "target": TARGET_KEYQ_VS_RAW,
            "value": vs_raw,
            "meets_target": vs_raw is not None and vs_raw >= TARGET_KEYQ_VS_RAW,
        },
        "new_keys_per_s": {
            "target": TARGET_NEW_KEYS_PER_S,
            "value": new_keys,
            "meets_target": new_keys is not None and new_keys >= TARGET_NEW_KEYS_PER_S,
        },
        "new_keys/raw_pika_new_queues_parallel": {
            "target": TARGET_NEW_KEYS_VS_CEILING,
            "value": vs_ceiling,
            "meets_target": vs_ceiling is not None and vs_ceiling >= TARGET_NEW_KEYS_VS_CEILING,
        },
    }
    return {
        "benchmark": "producer",
        "ok": not run.errors,
        "errors": run.errors,
        "machine": machine,
        "parameters": {
            "events": run.events,
            "keys": run.keys,
            "payload_bytes": run.payload_bytes,
            "repeats": run.repeats,
            "new_keys": run.new_keys,
            "distribution": run.distribution,
            "seed": run.seed,
            "confirm_window": CONFIRM_WINDOW,
            "variants": list(run.variants),
            "run_id": run.run_id,
        },
        "variants": variants,
        "ratios": {
            "keyq/raw_pika_unconfirmed": vs_raw,
            "keyq/raw_pika_confirm_each": vs_confirm,
            "keyq_metrics/keyq": metered,
            "new_keys/raw_pika_new_queues": vs_raw_new,
            "new_keys/raw_pika_new_queues_parallel": vs_ceiling,
            "paired_keyq/raw_pika_unconfirmed": [
                round(keyq / raw, 3)
                for keyq, raw in zip(
                    run.rates.get(KEYQ, []), run.rates.get(RAW_UNCONFIRMED, []), strict=False
                )
            ],
        },
        "targets": targets,
        "meets_targets": all(target["meets_target"] for target in targets.values()),
    }


def variant_list(text: str) -> tuple[str, ...]:
    known = (*THROUGHPUT_VARIANTS, *NEW_QUEUE_VARIANTS)
    chosen = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [part for part in chosen if part not in known]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(known)}; got {text!r}")
    return chosen


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.producer", description=__doc__)
    parser.add_argument("--events", type=positive, default=50_000, help="events per run")
    parser.add_argument("--keys", type=positive, default=100, help="distinct keys")
    parser.add_argument("--payload-bytes", type=positive, default=200, help="JSON body size")
    parser.add_argument("--repeats", type=positive, default=3, help="runs per variant")
    parser.add_argument(
        "--new-keys", type=non_negative, default=5000, help="events (= queues) of new_keys; 0 skips"
    )
    parser.add_argument("--distribution", choices=("round-robin", "random"), default="round-robin")
    parser.add_argument("--seed", type=int, default=1, help="for --distribution random")
    parser.add_argument(
        "--variants",
        type=variant_list,
        default=(*THROUGHPUT_VARIANTS, *NEW_QUEUE_VARIANTS),
        help="comma-separated subset to run (e.g. keyq for profiling); default: all",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(
        events=args.events,
        keys=args.keys,
        payload_bytes=args.payload_bytes,
        repeats=args.repeats,
        new_keys=args.new_keys,
        distribution=args.distribution,
        seed=args.seed,
        variants=args.variants,
    )
    settings = load_settings()
    machine = machine_info()
    log(f"machine: {machine}")
    cleanup = Cleanup(settings)
    measure_then_clean(lambda: measure(run, settings, cleanup), cleanup, run.errors)
    result = report(run, machine)
    emit(result, args.out)
    for error in run.errors:
        log(f"FAILED: {error}")
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
