"""``keyq`` with the seams that tests killing a dead-letter command half way need:
``keyq_with_seams.py [--pause-after N] [--pause-s S] [--lock-ttl-ms MS] [--chunk-keys K] -- ARGS``.

``--pause-after N``: once N letters are confirmed in redrive queues, print ``paused after N`` to
stderr and sleep ``--pause-s`` (an hour: time to be killed). ``--lock-ttl-ms``: the dead-letter
lock's ttl, so a killed command's lock runs out sooner. ``--chunk-keys``: keys a bulk redrive
publishes before it puts them back, so a kill can land between two chunks.
"""

from __future__ import annotations

import argparse
import sys
import time

import pika

from keyq.broker.confirm_window import ConfirmWindow
from keyq.cli.root import main
from keyq.ops import bulk_redrive, dead_letter_lock


def pause_after(count: int, seconds: float) -> None:
    """Make the ``count``-th letter published by a confirm window the last before a pause."""
    publish = ConfirmWindow.publish
    published = 0

    def publish_then_pause(
        window: ConfirmWindow, queue: str, body: bytes, properties: pika.BasicProperties
    ) -> None:
        nonlocal published
        publish(window, queue, body, properties)
        published += 1
        if published == count:
            window.wait()
            print(f"paused after {published}", file=sys.stderr, flush=True)
            time.sleep(seconds)

    ConfirmWindow.publish = publish_then_pause  # type: ignore[method-assign,assignment]


def run(argv: list[str]) -> None:
    seams, keyq_arguments = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(prog="keyq_with_seams")
    for option in ("--pause-after", "--lock-ttl-ms", "--chunk-keys"):
        parser.add_argument(option, type=int)
    parser.add_argument("--pause-s", type=float, default=3600.0)
    options = parser.parse_args(seams)
    if options.pause_after is not None:
        pause_after(options.pause_after, options.pause_s)
    if options.lock_ttl_ms is not None:
        dead_letter_lock.LOCK_TTL_MS = options.lock_ttl_ms
    if options.chunk_keys is not None:
        bulk_redrive.CHUNK_KEYS = options.chunk_keys
    sys.argv = ["keyq", *keyq_arguments]
    main()


if __name__ == "__main__":
    run(sys.argv[1:])
