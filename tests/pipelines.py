"""Pipelines that worker tests start workers with (``tests.pipelines:<name>``).

The audit fold records per key how many events were applied, the last seq per producer and any
seq out of order or twice: a correct run ends with ``applied == published`` and no violations.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def audit_event(state: Any, event: Any) -> Any:
    state = state or {"applied": 0, "last": {}, "violations": []}
    producer = str(event.get("producer", "?"))
    seq = int(event["n"])
    last = state["last"].get(producer, 0)
    if seq != last + 1:
        state["violations"].append([producer, last, seq])
    state["last"][producer] = seq
    state["applied"] += 1
    if event.get("poison"):
        raise ValueError(f"poison event {seq}")
    return state


def audit(df: Any, ctx: Any) -> Any:
    return ctx.state.fold(df, audit_event)


def audit_slow(df: Any, ctx: Any) -> Any:
    """The audit pipeline, announcing each batch in a file and pausing inside it (before its
    commit), so a test can freeze the worker mid-batch."""
    marker = os.environ.get("KEYQ_TEST_BATCH_MARKER")
    result = ctx.state.fold(df, audit_event)
    if marker:
        Path(marker).write_text(f"{os.getpid()} {ctx.batch_id}\n")
        time.sleep(float(os.environ.get("KEYQ_TEST_BATCH_PAUSE", "1.0")))
    return result


def ledger_event(state: Any, event: Any) -> Any:
    """Every applied event's number per producer, in order applied; a planted poison fails."""
    if event.get("poison"):
        raise ValueError(f"planted poison event {event.get('n')}")
    return _record(state, event)


def _record(state: Any, event: Any) -> Any:
    state = state or {"seen": {}}
    state["seen"].setdefault(str(event["producer"]), []).append(int(event["n"]))
    return state


def ledger(df: Any, ctx: Any) -> Any:
    return ctx.state.fold(df, ledger_event)


def ledger_paced_event(state: Any, event: Any) -> Any:
    """``ledger_event`` after a pause of ``KEYQ_TEST_EVENT_PAUSE`` seconds: a slow key."""
    time.sleep(float(os.environ.get("KEYQ_TEST_EVENT_PAUSE", "0.001")))
    return ledger_event(state, event)


def ledger_paced(df: Any, ctx: Any) -> Any:
    return ctx.state.fold(df, ledger_paced_event)


def paced_audit_event(state: Any, event: Any) -> Any:
    """``audit_event`` after touching ``KEYQ_TEST_BATCH_MARKER`` and pausing
    ``KEYQ_TEST_EVENT_PAUSE`` s: a test sees a Spark job running and can signal the worker."""
    marker = os.environ.get("KEYQ_TEST_BATCH_MARKER")
    if marker:
        Path(marker).touch()
    time.sleep(float(os.environ.get("KEYQ_TEST_EVENT_PAUSE", "0.01")))
    return audit_event(state, event)


def audit_paced(df: Any, ctx: Any) -> Any:
    return ctx.state.fold(df, paced_audit_event)


def ledger_until_fixed_event(state: Any, event: Any) -> Any:
    """``ledger_event`` whose poison fails until ``KEYQ_TEST_FIXED_MARKER`` exists (the fix)."""
    marker = os.environ.get("KEYQ_TEST_FIXED_MARKER")
    if marker and Path(marker).exists():
        return _record(state, event)
    return ledger_event(state, event)


def ledger_until_fixed(df: Any, ctx: Any) -> Any:
    return ctx.state.fold(df, ledger_until_fixed_event)


DEPOSIT_SCHEMA = {
    "type": "record",
    "name": "Deposit",
    "fields": [{"name": "n", "type": "int"}, {"name": "cents", "type": "long"}],
}


def avro_deposit(body: bytes) -> Any:
    """Decode one Avro-encoded deposit (schemaless: the schema is the stream's contract)."""
    import io

    import fastavro

    reader = io.BytesIO(body)
    deposit = fastavro.schemaless_reader(reader, fastavro.parse_schema(DEPOSIT_SCHEMA))
    if reader.tell() != len(body):
        raise ValueError(f"{len(body) - reader.tell()} bytes left over after a Deposit")
    return deposit


def deposit_event(state: Any, deposit: Any) -> Any:
    state = state or {"balance": 0, "seen": []}
    state["balance"] += deposit["cents"]
    state["seen"].append(deposit["n"])
    return state


def avro_deposits(df: Any, ctx: Any) -> Any:
    """Avro events folded into a balance per account; each event's columns are written to
    ``KEYQ_TEST_COLUMNS_FILE``, a JSON line each."""
    columns_file = os.environ.get("KEYQ_TEST_COLUMNS_FILE")
    if columns_file:
        import orjson

        rows = df.select("key", "content_type", "headers", "payload", "body").collect()
        with open(columns_file, "ab") as out:
            for row in rows:
                line = {name: row[name] for name in ("key", "content_type", "payload")}
                line.update(headers=dict(row["headers"] or {}), body=bytes(row["body"]).hex())
                out.write(orjson.dumps(line) + b"\n")
    return ctx.state.fold(df, deposit_event, decoder=avro_deposit)
