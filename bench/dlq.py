"""Dead letters at scale: ``keyq dlq list --limit 20`` against 100,000 waiting letters, and one
``keyq dlq redrive --all`` of 1,000 parked keys.

Listing: ``--letters`` dead letters of ``--keys`` keys are published to a stream's classic
dead-letter queue as a worker publishes them, and indexed as its batch indexes them; then
``keyq dlq list --limit 20 --json`` is timed as a process (start-up included) and in process.
Baseline, the same run: what every listing cost before the index, a walk of the whole queue (a
``basic.get`` per letter, all handed back).

Redrive: ``--redrive-keys`` keys are parked, each with ``--per-key`` dead letters, and
``keyq dlq redrive --all`` is timed as a process; then every key is checked (unparked, its
redrive queue at the head of its aside list holding its letters in order, the dead-letter
queue empty). Baseline, the same run: single-key redrives (``redrive --key``, a walk each) of
``--baseline-keys`` keys, scaled to all. Applying the redriven letters needs a worker and
Spark; that each key is then applied 1..N once in order is shown at a smaller scale by
``tests/test_dlq_index.py``. Everything is deleted at the end.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pika

from bench.common import (
    delete_queues,
    emit,
    log,
    machine_info,
    positive,
    ratio,
    registered_queues,
    stream_redis_keys,
)
from keyq.broker.confirm_window import ConfirmWindow
from keyq.broker.connections import open_redis
from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.broker.dead_letter_queue import DeadLetterWalk, letters_of
from keyq.broker.envelope import CONTENT_JSON, HEADER_KEY, HEADER_PRODUCER, HEADER_SEQ
from keyq.broker.key_control import KeyControl, ParkedKey
from keyq.broker.naming import dead_letter_queue_name, key_queue_name
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import ensure_stream_config
from keyq.broker.topology import dead_letter_queue_arguments
from keyq.worker.amqp.dead_letters import DeadLetter, dead_letter_properties
from keyq.worker.amqp.deliveries import Delivery

REPO = Path(__file__).resolve().parent.parent
INDEX_CHUNK = 5_000


def keyq_process(settings: Settings, *args: str) -> tuple[float, dict[str, Any]]:
    """``python -m keyq ARGS --json``: its wall time and its JSON."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "keyq", *args, "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"keyq {' '.join(args)}: {done.stderr.strip()}")
    return seconds, dict(orjson.loads(done.stdout))


def fill(settings: Settings, stream: str, keys: int, per_key: int, reason: str) -> int:
    """``per_key`` dead letters of each of ``keys`` keys, interleaved, published (confirmed in
    a window) and indexed as a worker does; returns how many."""
    client = open_redis(settings)
    index = DeadLetterIndex(client, stream)
    queue = dead_letter_queue_name(stream)
    connection = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    connection.channel().queue_declare(
        queue, durable=True, arguments=dead_letter_queue_arguments("classic")
    )
    publisher = ConfirmWindow(connection)
    pending = []
    count = 0
    for seq in range(1, per_key + 1):
        for n in range(keys):
            key = f"key-{n}"
            delivery = Delivery(
                queue=key_queue_name(stream, key),
                channel_epoch=1,
                delivery_tag=count + 1,
                redelivered=False,
                headers={HEADER_KEY: key, HEADER_PRODUCER: "bench", HEADER_SEQ: seq},
                content_type=CONTENT_JSON,
                message_id=f"bench-{key}-{seq}",
                body=orjson.dumps({"key": key, "seq": seq, "pad": "x" * 100}),
            )
            properties = dead_letter_properties(DeadLetter(delivery, reason, attempts=2))
            publisher.publish(queue, delivery.body, properties)
            pending.extend(letters_of(0, 0, delivery.body, properties))
            count += 1
            if len(pending) >= INDEX_CHUNK:
                publisher.wait()
                index.add(pending)
                pending = []
    publisher.wait()
    index.add(pending)
    publisher.close()
    connection.close()
    client.close()
    return count


def full_walk_seconds(settings: Settings, stream: str) -> tuple[float, int]:
    """The listing before the index: every letter taken by ``basic.get`` (to be handed back).
    The queue is deleted before the walk's channel closes: RabbitMQ 3.10 hands 100,000
    letters back at about 55 a second, which would load the broker for half an hour."""
    connection = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    queue = dead_letter_queue_name(stream)
    started = time.perf_counter()
    with DeadLetterWalk(connection, queue) as walk:
        letters = walk.read()
        first = [letter.letter_id for letter in letters[:20]]
        seconds = time.perf_counter() - started
        connection.channel().queue_delete(queue)
    connection.close()
    assert len(first) == 20
    return seconds, len(letters)


def listing(settings: Settings, stream: str, letters: int, keys: int) -> dict[str, Any]:
    log(f"listing: {letters} letters of {keys} keys into {dead_letter_queue_name(stream)}")
    started = time.perf_counter()
    filled = fill(settings, stream, keys, letters // keys, "poison: bench")
    log(f"filled {filled} in {time.perf_counter() - started:.1f} s")
    cli_s, listed = keyq_process(settings, "dlq", "list", "--stream", stream, "--limit", "20")
    assert len(listed["letters"]) == 20 and listed["indexed"]["in_step"], listed["indexed"]
    client = open_redis(settings)
    index = DeadLetterIndex(client, stream)
    started = time.perf_counter()
    page = index.page(20)
    index_s = time.perf_counter() - started
    started = time.perf_counter()
    of_key = index.of_key("key-7", 20)
    key_s = time.perf_counter() - started
    client.close()
    assert len(page.rows) == 20 and len(of_key.rows) == 20
    log(f"list --limit 20: {cli_s:.3f} s as a process, {index_s * 1000:.1f} ms in process")
    walk_s, walked = full_walk_seconds(settings, stream)
    log(f"baseline, a full walk: {walk_s:.1f} s for {walked} letters")
    return {
        "letters": filled,
        "keys": keys,
        "list_limit_20_process_s": round(cli_s, 3),
        "list_limit_20_index_ms": round(index_s * 1000, 2),
        "list_key_limit_20_index_ms": round(key_s * 1000, 2),
        "baseline_full_walk_s": round(walk_s, 2),
        "baseline_walked_letters": walked,
        "speedup_process": ratio(walk_s, cli_s),
    }


def redrive(
    settings: Settings, stream: str, keys: int, per_key: int, sample: int
) -> dict[str, Any]:
    log(f"redrive: {keys} parked keys with {per_key} letters each")
    client = open_redis(settings)
    control = KeyControl(client, stream)
    for n in range(keys):
        parked = ParkedKey(at_ms=1, reason="poison: bench", producer="bench", seq=1)
        control.park(f"key-{n}", parked)
    fill(settings, stream, keys, per_key, "poison: bench")
    baseline: list[float] = []
    for n in range(sample):
        seconds, done = keyq_process(
            settings, "dlq", "redrive", "--stream", stream, "--key", f"key-{n}"
        )
        assert done["letters"] == per_key
        baseline.append(seconds)
    per_key_s = sum(baseline) / len(baseline)
    log(f"baseline: redrive --key, {per_key_s:.2f} s a key (of {sample})")
    bulk_s, done = keyq_process(settings, "dlq", "redrive", "--stream", stream, "--all")
    log(f"redrive --all: {done['keys']} keys, {done['letters']} letters in {bulk_s:.1f} s")
    assert done["keys"] == keys - sample and done["letters"] == (keys - sample) * per_key
    checked = verify(settings, stream, client, keys, per_key)
    client.close()
    return {
        "keys": keys - sample,
        "letters": done["letters"],
        "redrive_all_process_s": round(bulk_s, 2),
        "baseline_redrive_key_s_per_key": round(per_key_s, 3),
        "baseline_scaled_to_all_s": round(per_key_s * (keys - sample), 1),
        "speedup": ratio(per_key_s * (keys - sample), bulk_s),
        "verified": checked,
    }


def verify(settings: Settings, stream: str, client: Any, keys: int, per_key: int) -> dict[str, Any]:
    """Every key unparked, its redrive queue first in its aside list with its letters in
    order; the dead-letter queue empty and the index with it."""
    control = KeyControl(client, stream)
    assert not control.parked()
    aside = control.keys_aside()
    connection = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    channel = connection.channel()
    in_order = 0
    for n in range(keys):
        queue = aside[f"key-{n}"][0]
        seqs = []
        for _ in range(per_key):
            method, properties, _body = channel.basic_get(queue, auto_ack=False)
            assert method is not None
            seqs.append(int(properties.headers[HEADER_SEQ]))
        in_order += seqs == list(range(1, per_key + 1))
        channel.basic_nack(0, multiple=True, requeue=True)
    dlq = channel.queue_declare(dead_letter_queue_name(stream), passive=True)
    connection.close()
    letters, _messages = DeadLetterIndex(client, stream).counts()
    assert in_order == keys and int(dlq.method.message_count) == 0 and letters == 0
    return {"keys_in_order": in_order, "dead_letters_left": 0, "indexed_left": letters}


def cleanup(settings: Settings, stream: str) -> None:
    client = open_redis(settings)
    queues = set(registered_queues(client, stream))
    queues |= {str(queue) for queue in client.hkeys(f"keyq:{{{stream}}}:redrives")}
    for held in KeyControl(client, stream).keys_aside().values():
        queues.update(held)
    queues.add(dead_letter_queue_name(stream))
    delete_queues(settings, sorted(queues))
    names = stream_redis_keys(client, stream)
    for start in range(0, len(names), 1000):
        client.delete(*names[start : start + 1000])
    client.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dlq", description=__doc__)
    parser.add_argument("--letters", type=positive, default=100_000)
    parser.add_argument("--keys", type=positive, default=1_000)
    parser.add_argument("--redrive-keys", type=positive, default=1_000)
    parser.add_argument("--per-key", type=positive, default=3)
    parser.add_argument("--baseline-keys", type=positive, default=5)
    parser.add_argument("--only", choices=("list", "redrive"), default=None)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    settings = load_settings()
    result: dict[str, Any] = {"benchmark": "dlq", "machine": machine_info()}
    streams = [f"bench-dlq-{uuid.uuid4().hex[:8]}", f"bench-dlq-{uuid.uuid4().hex[:8]}"]
    client = open_redis(settings)
    for stream in streams:
        ensure_stream_config(client, stream, "key", None, "classic")
    client.close()
    try:
        if args.only != "redrive":
            result["list"] = listing(settings, streams[0], args.letters, args.keys)
            cleanup(settings, streams[0])
        if args.only != "list":
            result["redrive"] = redrive(
                settings,
                streams[1],
                args.redrive_keys + args.baseline_keys,
                args.per_key,
                args.baseline_keys,
            )
    finally:
        for stream in streams:
            cleanup(settings, stream)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
