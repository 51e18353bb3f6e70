"""Broker CPU per key-mode queue, step by step: what a queue of its own per key costs
RabbitMQ beside the messages it carries.

A key-mode queue lives through these steps, each run here for ``--queues`` queues in a row, as
keyq runs them:

* ``declare``: the producer's durable declare, with keyq's queue arguments;
* ``first_message``: its first persistent message, confirmed;
* ``consume``: a worker's channel, prefetch and exclusive consumer (pipelined, as a claim
  round opens them: ``keyq.worker.amqp.consume_rounds``);
* ``deliver_ack``: that message delivered and acked;
* ``close``: the channel closed with its consumer on it, all in one round trip (as a
  hand-back closes them: ``keyq.worker.amqp.channel_close``);
* ``delete``: the janitor's ``queue.delete(if_empty, if_unused)``.

Around each step the broker's CPU is read from ``/proc`` (the process listening on the port
``KEYQ_AMQP_URL`` names, and its children), less its idle rate over the same time, read just
before. Baseline in the same run, rounds alternating: the same life cycle with every consumer
on one shared channel, which keyq does not do (a refused exclusive consume closes its whole
channel, and handing one queue back must close its channel to return its unacked messages in
order without a moment in which the queue looks unused). Figures are medians over rounds, in
milliseconds of broker CPU per queue.

Progress on stderr; one JSON object on stdout (and ``--out``).

Usage: ``python -m bench.queue_lifecycle [--queues N] [--rounds R] [--out FILE]``
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika
from pika.adapters.blocking_connection import BlockingChannel

from bench import proc_cpu
from bench.common import amqp, delete_queues, emit, log, machine_info, median, positive, ratio
from bench.service_process import service_pid
from keyq.broker.settings import Settings, load_settings
from keyq.broker.topology import keyed_queue_arguments
from keyq.worker.amqp.channel_close import close_all_keeping_consumers
from keyq.worker.amqp.consume_rounds import ConsumeRequest, open_consumers

STEPS = ("declare", "first_message", "consume", "deliver_ack", "close", "delete")
LAYOUTS = ("channel_per_queue", "shared_channel")
IDLE_S = 1.0  # the broker's idle rate is read over this long before each round
SETTLE_S = 0.5  # after each step, for the broker's own follow-up work to land in it
PREFETCH = 50


class BrokerClock:
    """The broker's CPU seconds (its process tree), less its idle rate."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self.idle_rate = 0.0

    def seconds(self) -> float:
        return proc_cpu.tree_seconds(self._pid, proc_cpu.snapshot())["total"]

    def read_idle(self) -> None:
        began, cpu = time.monotonic(), self.seconds()
        time.sleep(IDLE_S)
        self.idle_rate = (self.seconds() - cpu) / (time.monotonic() - began)

    def step(self, action: Callable[[], None]) -> float:
        """Broker CPU seconds ``action`` cost (with ``SETTLE_S`` after it), idle taken off."""
        began, cpu = time.monotonic(), self.seconds()
        action()
        time.sleep(SETTLE_S)
        return max(0.0, self.seconds() - cpu - self.idle_rate * (time.monotonic() - began))


def life_cycle(
    settings: Settings, clock: BrokerClock, queues: list[str], layout: str
) -> dict[str, float]:
    """Broker CPU seconds of each step for ``queues``."""
    arguments = keyed_queue_arguments("bench-queue-lifecycle")
    spent: dict[str, float] = {}
    received: list[tuple[BlockingChannel, int]] = []

    def on_message(channel: BlockingChannel, method: Any, _props: Any, _body: bytes) -> None:
        received.append((channel, method.delivery_tag))

    with amqp(settings, "bench-queue-lifecycle") as connection:
        control = connection.channel()
        control.confirm_delivery()
        persistent = pika.BasicProperties(delivery_mode=2, content_type="application/json")
        channels: list[BlockingChannel] = []

        def declare() -> None:
            for queue in queues:
                control.queue_declare(queue, durable=True, arguments=arguments)

        def first_message() -> None:
            for queue in queues:
                control.basic_publish("", queue, b'{"n": 1}', persistent, mandatory=True)

        def consume() -> None:
            if layout == "shared_channel":
                shared = connection.channel()
                shared.basic_qos(prefetch_count=PREFETCH)
                for queue in queues:
                    shared.basic_consume(queue, on_message, exclusive=True)
                channels.append(shared)
                return
            requests = [ConsumeRequest(queue, PREFETCH, on_message) for queue in queues]
            for reply in open_consumers(connection, requests):
                if reply.channel is None:
                    raise RuntimeError(f"a consume was refused: {reply.refusal}")
                channels.append(reply.channel)

        def deliver_ack() -> None:
            deadline = time.monotonic() + 60
            while len(received) < len(queues) and time.monotonic() < deadline:
                connection.process_data_events(0.05)
            if len(received) < len(queues):
                raise RuntimeError(f"{len(received)} of {len(queues)} messages delivered")
            for channel, tag in received:
                channel.basic_ack(tag)
            connection.process_data_events(0)

        def close() -> None:
            close_all_keeping_consumers(channels)

        def delete() -> None:
            for queue in queues:
                control.queue_delete(queue, if_unused=True, if_empty=True)

        actions = (declare, first_message, consume, deliver_ack, close, delete)
        for name, action in zip(STEPS, actions, strict=True):
            spent[name] = clock.step(action)
    return spent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queues", type=positive, default=1000)
    parser.add_argument("--rounds", type=positive, default=3, help="of each layout")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    settings: Settings = load_settings()
    pid, found_by = service_pid(settings.amqp_url, 5672, "beam.smp", ("rabbit",))
    if pid is None:
        parser.error(f"the broker's process cannot be read here: {found_by}")
    clock = BrokerClock(pid)
    rounds: list[dict[str, Any]] = []
    for number in range(1, args.rounds + 1):
        for layout in LAYOUTS:
            queues = [f"bench-ql-{uuid.uuid4().hex[:8]}-{n}" for n in range(args.queues)]
            clock.read_idle()
            try:
                spent = life_cycle(settings, clock, queues, layout)
            finally:
                delete_queues(settings, queues)  # what a failed round left
            per_queue = {step: 1000 * seconds / args.queues for step, seconds in spent.items()}
            per_queue["total"] = sum(per_queue.values())
            rounds.append({"round": number, "layout": layout, "ms_per_queue": per_queue})
            log(f"round {number} {layout}: {per_queue['total']:.2f} ms of broker CPU per queue")
    medians = {
        layout: {
            step: median([r["ms_per_queue"][step] for r in rounds if r["layout"] == layout])
            for step in (*STEPS, "total")
        }
        for layout in LAYOUTS
    }
    emit(
        {
            "benchmark": "queue_lifecycle",
            "params": {"queues": args.queues, "rounds": args.rounds},
            "machine": machine_info(),
            "broker_found_by": found_by,
            "ms_per_queue": medians,
            "shared_over_own_channel": ratio(
                medians["shared_channel"]["total"], medians["channel_per_queue"]["total"]
            ),
            "rounds": rounds,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
