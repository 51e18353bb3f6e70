"""The demo's workload in each stream mode: end to end, latency, verdict and the broker's CPU.

Each round runs ``keyq demo --chaos``'s workload (``keyq.demo.runner.Demo``, in this process
as ``keyq demo`` runs it): ``--events`` order events over ``--orders`` Zipf-skewed orders,
published flat out, two workers and a janitor, one of them killed with -9 once a third of
the events are published (in every mode at the same point; ``keyq demo --chaos`` steps by the
clock, and a mode that publishes fast could finish before its first step), then every order's
state checked against a plain-Python fold of what was published. A round is one mode
(``--modes``, default key, bucket and auto); the modes take turns, in reverse order every
other round, ``--rounds`` of each.

Per round: the demo's end to end events/s (first publish until every order is committed),
its publish rate, its p50/p99 publish-to-commit latency (a sample of orders), its verdict,
and the CPU of the RabbitMQ node ``KEYQ_AMQP_URL`` names (``bench.proc_cpu``: the process
listening on its port and its children) from the first publish until the verdict is
reached, per 1,000 events. The node's CPU is read first over ``--idle-seconds`` with nothing
of the round running (``broker_idle_cores``): the whole node is counted, so whatever else
uses it meanwhile is in the figure too.

Summary: each mode's medians over its rounds, and the ratios auto/key, auto/bucket (and
bucket/key) of end to end, p99 and broker CPU per 1,000 events. Each round's stream (its
queues and Redis keys) is removed after it.

Progress on stderr; one JSON object on stdout (and ``--out``).

Usage: ``python -m bench.modes [--modes key,bucket,auto] [--rounds R] [--events N]
[--orders K] [--buckets B] [--out FILE]``
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import redis

from bench import proc_cpu
from bench.common import (
    Cleanup,
    emit,
    keyq_settings_from_env,
    log,
    machine_info,
    measure_then_clean,
    median,
    positive,
    ratio,
)
from bench.service_process import service_pid
from keyq.broker.connections import open_redis
from keyq.broker.routes import RouteBook
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import StreamConfig
from keyq.demo.runner import Demo, DemoOptions

MODES = ("key", "bucket", "auto")
RATIOS = (("auto", "key"), ("auto", "bucket"), ("bucket", "key"))
FIGURES = ("end_to_end_events_per_s", "p99_ms", "broker_cpu_s_per_1000_events")
KILL_AT = 1 / 3  # of the events published: where each round's worker is killed


def broker_seconds(pid: int | None) -> float | None:
    """CPU seconds so far of the broker's process tree (None: not measured)."""
    if pid is None:
        return None
    return proc_cpu.tree_seconds(pid, proc_cpu.snapshot())["total"]


class MeasuredDemo(Demo):
    """The demo, with the broker's CPU read when publishing starts and again when the run is
    judged, before its daemons are stopped (their shutdown is not the workload), and its
    chaos one kill -9 once ``KILL_AT`` of the events are published, the same point in every
    mode (the demo's own chaos steps by the clock, and a mode that publishes fast may be done
    before the first)."""

    def __init__(self, settings: Settings, options: DemoOptions, broker: int | None) -> None:
        super().__init__(settings, options, progress=self._tick, say=log)
        self._broker = broker
        self.cpu_before: float | None = None
        self.cpu_after: float | None = None
        self.measured_s: float | None = None
        self._started = 0.0
        self._ticked = 0
        self._kill_due = threading.Event()

    def _tick(self, done: int, total: int) -> None:
        if done >= total * KILL_AT:
            self._kill_due.set()
        if done % 20_000 == 0 and done != self._ticked:
            self._ticked = done
            log(f"published {done:,}/{total:,}")

    def _chaos_loop(self, client: redis.Redis) -> None:
        while not self._kill_due.wait(0.02):
            if self._stop.is_set():
                return
        self._chaos_monkey().kill_one(client)

    def _publish(
        self,
        config: StreamConfig,
        events: list[tuple[str, dict[str, Any]]],
        sample: set[str],
        sent: dict[tuple[str, int], float],
    ) -> dict[str, Any]:
        self.cpu_before = broker_seconds(self._broker)
        self._started = time.perf_counter()
        return super()._publish(config, events, sample, sent)

    def _stop_daemons(self) -> None:
        if self.cpu_before is not None and self.cpu_after is None:
            self.cpu_after = broker_seconds(self._broker)
            self.measured_s = time.perf_counter() - self._started
        super()._stop_daemons()


def promoted_keys(settings: Settings, stream: str, cleanup: Cleanup) -> dict[str, Any]:
    """Auto mode: how many keys the workers promoted and why; their own queues are given to
    ``cleanup`` (they are registered when declared; named too, should one not be)."""
    client = open_redis(settings)
    try:
        book = RouteBook(client, stream)
        promoted = book.promoted()
        cleanup.add_queues(route.queue for route in promoted.values())
        return {"promoted_now": len(promoted), "counts": book.counts()}
    finally:
        client.close()


def run_round(
    settings: Settings,
    mode: str,
    args: argparse.Namespace,
    broker: int | None,
    cleanup: Cleanup,
) -> dict[str, Any]:
    """One demo run in ``mode`` on a fresh stream."""
    stream = f"bench-modes-{mode}-{uuid.uuid4().hex[:6]}"
    cleanup.add_stream(stream)
    idle_before = broker_seconds(broker)
    time.sleep(args.idle_seconds)
    idle_after = broker_seconds(broker)
    options = DemoOptions(
        orders=args.orders,
        events=args.events,
        workers=args.workers,
        chaos=True,
        stream=stream,
        seed=args.seed,
        mode=mode,
        buckets=None if mode == "key" else args.buckets,
    )
    demo = MeasuredDemo(settings, options, broker)
    try:
        summary = demo.run()
    finally:
        routes = promoted_keys(settings, stream, cleanup) if mode == "auto" else None
    cpu = (
        None
        if demo.cpu_before is None or demo.cpu_after is None
        else demo.cpu_after - demo.cpu_before
    )
    latency = summary["latency_ms"]
    chaos = summary["chaos"]
    return {
        "mode": mode,
        "stream": stream,
        "buckets": summary["buckets"],
        "events": summary["events"],
        "orders": summary["orders"],
        "publish_events_per_s": summary["publish_events_per_s"],
        "end_to_end_events_per_s": summary["end_to_end_events_per_s"],
        "seconds_to_all_committed": summary["seconds_to_all_committed"],
        "latency_ms": latency,
        "p99_ms": latency["p99"],
        "verdict_ok": summary["verdict"]["ok"],
        "verdict": summary["verdict"],
        "failovers_s": chaos.get("failovers_s"),
        "chaos_actions": len(chaos.get("actions", [])),
        "chaos_failed_steps": chaos.get("failed_steps"),
        "queues_created": summary["queues_created"],
        "routes": routes,
        # Auto mode: events a producer sent to their bucket because a switch was put off.
        "rerouted": (summary.get("producer") or {}).get("rerouted"),
        "broker_cpu_s": None if cpu is None else round(cpu, 3),
        "broker_cpu_measured_s": None if demo.measured_s is None else round(demo.measured_s, 1),
        "broker_cpu_s_per_1000_events": (
            None if cpu is None else round(1000 * cpu / summary["events"], 4)
        ),
        "broker_idle_cores": (
            None
            if idle_before is None or idle_after is None
            else round((idle_after - idle_before) / args.idle_seconds, 3)
        ),
        "logs": summary["logs"],
    }


def measured_round(
    settings: Settings,
    mode: str,
    args: argparse.Namespace,
    broker: int | None,
    errors: list[str],
) -> dict[str, Any] | None:
    """``run_round``, then its stream's queues and keys removed whatever happened; a round
    that could not run (a worker that did not start, say) is an error, not a figure."""
    cleanup = Cleanup(settings)
    entries: list[dict[str, Any]] = []

    def measure() -> None:
        entries.append(run_round(settings, mode, args, broker, cleanup))

    try:
        measure_then_clean(measure, cleanup, errors)
    except RuntimeError as exc:
        errors.append(f"{mode}: {type(exc).__name__}: {exc}")
    return entries[0] if entries else None


def summarise(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A mode's medians over its rounds."""

    def med(name: str) -> float | None:
        value = median([r[name] for r in rounds if r.get(name) is not None])
        return None if value is None else round(value, 4)

    return {
        "rounds": len(rounds),
        "verdicts_ok": sum(1 for r in rounds if r["verdict_ok"]),
        "publish_events_per_s": med("publish_events_per_s"),
        "end_to_end_events_per_s": med("end_to_end_events_per_s"),
        "p50_ms": median([r["latency_ms"]["p50"] for r in rounds if r["latency_ms"]["p50"]]),
        "p99_ms": med("p99_ms"),
        "broker_cpu_s_per_1000_events": med("broker_cpu_s_per_1000_events"),
        "broker_idle_cores": med("broker_idle_cores"),
        "failover_max_s": max(
            (s for r in rounds for s in r.get("failovers_s") or []), default=None
        ),
    }


def compare(medians: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """``a/b`` of each figure, for the pairs of ``RATIOS`` both measured."""
    ratios: dict[str, dict[str, float | None]] = {}
    for top, bottom in RATIOS:
        if top in medians and bottom in medians:
            ratios[f"{top}/{bottom}"] = {
                name: (
                    None
                    if (value := ratio(medians[top][name], medians[bottom][name])) is None
                    else round(value, 3)
                )
                for name in FIGURES
            }
    return ratios


def modes_list(text: str) -> list[str]:
    """An argparse type: comma-separated modes, each once."""
    modes = [part.strip() for part in text.split(",") if part.strip()]
    wrong = [mode for mode in modes if mode not in MODES]
    if not modes or wrong or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"give distinct modes among {', '.join(MODES)}")
    return modes


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.modes", description=__doc__)
    parser.add_argument("--modes", type=modes_list, default=list(MODES))
    parser.add_argument("--rounds", type=positive, default=2, help="rounds of each mode")
    parser.add_argument("--events", type=positive, default=100_000)
    parser.add_argument("--orders", type=positive, default=2000)
    parser.add_argument(
        "--buckets", type=positive, default=None, help="bucket and auto mode (default: 64)"
    )
    parser.add_argument("--workers", type=positive, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--idle-seconds", type=float, default=2.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.orders > args.events:
        parser.error("--orders must be at most --events")
    if args.idle_seconds <= 0:
        parser.error("--idle-seconds must be more than 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    logging.getLogger("keyq.demo").setLevel(logging.INFO)
    settings: Settings = load_settings()
    broker, broker_how = service_pid(
        settings.amqp_url, 5672, "beam.smp", ("rabbit@localhost", "rabbit boot")
    )
    params = {**vars(args), "out": str(args.out) if args.out else None, "chaos": True}
    params["pack_max_events"] = settings.pack_max_events
    result: dict[str, Any] = {
        "benchmark": "modes",
        "machine": machine_info(),
        "params": params,
        "processes": {"broker": {"pid": broker, "found": broker_how}},
        "environment": keyq_settings_from_env(),
    }
    errors: list[str] = []
    if broker is None:
        errors.append(f"broker CPU not measured: {broker_how}")
    rounds: list[dict[str, Any]] = []
    for number in range(1, args.rounds + 1):
        order = args.modes if number % 2 else list(reversed(args.modes))
        for mode in order:
            log(f"round {number}/{args.rounds}, {mode} mode")
            entry = measured_round(settings, mode, args, broker, errors)
            if entry is None:
                continue
            rounds.append(entry)
            if not entry["verdict_ok"]:
                errors.append(f"{mode} round {number}: verdict FAILED ({entry['verdict']})")
            log(orjson.dumps({k: v for k, v in entry.items() if k != "verdict"}).decode())
    medians = {
        mode: summarise([r for r in rounds if r["mode"] == mode])
        for mode in args.modes
        if any(r["mode"] == mode for r in rounds)
    }
    result.update({"medians": medians, "ratios": compare(medians), "rounds": rounds})
    result["errors"] = errors
    emit(result, args.out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
