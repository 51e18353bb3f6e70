"""A baseline consumer process for ``bench.peers``: what a user would write without keyq.

It consumes one shared queue (competing consumers) or a set of single-active-consumer queues
behind a consistent-hash exchange, "applies" each event to an in-memory per-key state, acks,
and appends one line per applied event to its record file:
``key seq published_s applied_s queue``.
Each line is flushed at once, so a ``kill -9`` loses no record of an applied event.

Usage: ``python -m bench.peer_consumer AMQP_URL RECORD_FILE PREFETCH QUEUE [QUEUE ...]``
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pika


def main(argv: list[str]) -> int:
    url, record_path, prefetch, *queues = argv
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=int(prefetch))
    state: dict[str, int] = {}
    with Path(record_path).open("a", buffering=1) as record:

        def handler(queue: str) -> Any:
            def on_message(ch: Any, method: Any, properties: Any, body: bytes) -> None:
                del properties
                event = orjson.loads(body)
                key = event["k"]
                state[key] = state.get(key, 0) + 1  # the "work": a keyed count
                record.write(f"{key} {event['n']} {event['t']} {time.time()} {queue}\n")
                ch.basic_ack(method.delivery_tag)

            return on_message

        for queue in queues:
            channel.basic_consume(queue, handler(queue))
        print("consuming", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            channel.start_consuming()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
