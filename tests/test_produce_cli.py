"""``keyq produce``: synthetic keyed load lands whole, on the keys asked for, and every option
can also come from the environment (its bad options: tests/test_cli_errors.py)."""

from __future__ import annotations

from typing import Any

import orjson

from keyq.broker.registry import QueueRegistry
from tests.helpers import drain
from tests.workers import run_keyq


def test_produce_publishes_every_event_to_the_keys(stream: Any, amqp: Any) -> None:
    options = ["--keys", "20", "--events", "500", "--payload-bytes", "100", "--mode", "key"]
    done = run_keyq(stream.settings, "produce", "--stream", stream.name, *options)
    assert done.returncode == 0, done.stderr
    report = orjson.loads(done.stdout)
    assert report["events"] == 500
    queues = QueueRegistry(stream.redis, stream.name).queues()
    assert 1 <= len(queues) <= 20
    assert len(queues) == report["keys_used"]
    channel = amqp.channel()
    assert sum(len(drain(channel, queue, ack=False)) for queue in queues) == 500  # events


def test_options_come_from_the_environment_too(stream: Any) -> None:
    done = run_keyq(
        stream.settings,
        "produce",
        env={
            "KEYQ_PRODUCE_STREAM": stream.name,
            "KEYQ_PRODUCE_EVENTS": "30",
            "KEYQ_PRODUCE_KEYS": "3",
            "KEYQ_PRODUCE_MODE": "bucket",
            "KEYQ_PRODUCE_BUCKETS": "4",
        },
    )
    assert done.returncode == 0, done.stderr
    assert orjson.loads(done.stdout)["events"] == 30
