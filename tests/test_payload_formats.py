"""Events in any format: Avro bodies (published as bytes with their content type) reach the
pipeline with their raw body, content type and headers, are folded into keyed state through
the pipeline's decoder, and a body the decoder rejects is dead-lettered with its reason."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import fastavro
import orjson
import pytest

from keyq import Producer
from keyq.broker.envelope import HEADER_DEAD_REASON
from keyq.broker.naming import dead_letter_queue_name
from keyq.worker.batch.state_store import StateStore
from tests.conftest import StreamFixture
from tests.helpers import drain, queue_depth
from tests.pipelines import DEPOSIT_SCHEMA
from tests.test_worker_poison import text
from tests.workers import wait_until

pytestmark = pytest.mark.slow

AVRO = "application/avro"


def avro(n: int, cents: int) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(DEPOSIT_SCHEMA), {"n": n, "cents": cents})
    return out.getvalue()


def test_avro_events_fold_into_state_and_a_body_the_decoder_rejects_is_dead_lettered(
    stream: StreamFixture, workers: Any, producer: Producer, amqp: Any, tmp_path: Path
) -> None:
    columns = tmp_path / "columns.jsonl"
    worker = workers(
        stream.name,
        pipeline="tests.pipelines:avro_deposits",
        mode="key",
        env={"KEYQ_TEST_COLUMNS_FILE": str(columns), "KEYQ_MAX_ATTEMPTS": "1"},
    ).wait_ready()
    for n in range(1, 11):
        producer.publish(
            "acct-1", avro(n, 100 * n), content_type=AVRO, headers={"traceparent": f"t-{n}"}
        )
    producer.publish("acct-1", b"\x02", content_type=AVRO)  # a truncated Deposit: rejected
    producer.publish("acct-2", {"n": 1, "cents": 5})  # JSON still goes as JSON
    for n in range(11, 13):
        producer.publish("acct-1", avro(n, 100 * n), content_type=AVRO)
    producer.flush(timeout=20)
    store = StateStore(stream.redis, stream.name)
    wait_until(
        lambda: (store.get("acct-1") or {}).get("seen") == list(range(1, 13)),
        90,
        "every good deposit applied in order",
    )
    assert store.get("acct-1") == {"balance": 100 * sum(range(1, 13)), "seen": list(range(1, 13))}
    dlq = dead_letter_queue_name(stream.name)
    wait_until(lambda: queue_depth(amqp, dlq) == 1, 30, "the DLQ")
    [letter] = drain(amqp.channel(), dlq)
    assert letter.body == b"\x02" and letter.content_type == AVRO
    reason = text(letter.headers[HEADER_DEAD_REASON])
    assert "the decoder rejected the payload" in reason, reason
    assert "EOFError" in reason or "Error" in reason, reason

    seen = [orjson.loads(line) for line in columns.read_bytes().splitlines()]
    first = next(
        row for row in seen if row["key"] == "acct-1" and row["body"] == avro(1, 100).hex()
    )
    assert first["content_type"] == AVRO and first["payload"] is None
    assert first["headers"] == {"traceparent": "t-1"}  # keyq's own headers left out
    as_json = next(row for row in seen if row["key"] == "acct-2")
    assert orjson.loads(as_json["payload"]) == {"n": 1, "cents": 5}
    assert as_json["content_type"] == "application/json"
    assert worker.terminate() == 0, worker.log()[-3000:]
