"""Unit tests of the worker's pure logic: dedup, the delivery buffer, decoding, the fold,
failure descriptions, sinks, settings validation and pipeline loading. No services, no Spark
session: the fold is called directly on Arrow record batches."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keyq.broker.envelope import HEADER_KEY, HEADER_PRODUCER, HEADER_PUBLISHED_AT, HEADER_SEQ
from keyq.broker.errors import ConfigurationError
from keyq.broker.settings import load_settings
from keyq.worker.amqp.deliveries import Delivery, DeliveryBuffer
from keyq.worker.batch.decoding import Event, Undecodable, decode
from keyq.worker.batch.failures import describe_failure
from keyq.worker.batch.marks import MAX_PRODUCERS_PER_KEY, KeyMarks
from keyq.worker.batch.sequencing import Identified, plan_batch
from keyq.worker.config import WorkerSettings
from keyq.worker.pipeline_loading import load_pipeline
from keyq.worker.spark.fold import STATE_COLUMNS, FoldFailed, make_folder
from keyq.worker.spark.sinks import STAGING, ParquetSink, open_sink
from tests.pipelines import audit, audit_event

# --------------------------------------------------------------------------- helpers


def delivery(
    queue: str = "q",
    tag: int = 1,
    *,
    epoch: int = 1,
    headers: dict[str, Any] | None = None,
    body: bytes = b"{}",
    received_at: float | None = None,
) -> Delivery:
    extra: dict[str, Any] = {} if received_at is None else {"received_at": received_at}
    return Delivery(
        queue=queue,
        channel_epoch=epoch,
        delivery_tag=tag,
        redelivered=False,
        headers=headers if headers is not None else {},
        content_type="application/json",
        message_id=f"m-{tag}",
        body=body,
        **extra,
    )


def ident(key: str, producer: str | None, seq: int | None, counts: bool = True) -> Identified:
    return Identified(key, producer, seq, counts=counts)


def split_fresh(
    events: list[Identified], marks: dict[str, KeyMarks]
) -> tuple[list[bool], dict[str, KeyMarks]]:
    """Which events a batch applies, when none of them waits for an earlier seq."""
    plan = plan_batch(events, marks, now=0.0, gap_timeout_s=60.0)
    assert plan.deferred == [] and plan.late == []
    applied = set(plan.apply)
    assert plan.apply == sorted(plan.apply)  # in order already: applied as delivered
    return [index in applied for index in range(len(events))], plan.marks


# --------------------------------------------------------------------------- dedup


def test_dedup_skips_redeliveries_at_or_below_the_mark() -> None:
    marks = {"k": KeyMarks(seqs={"p": 3}, applied=3)}
    events = [ident("k", "p", seq) for seq in (1, 2, 3, 4, 5)]
    fresh, updated = split_fresh(events, marks)
    assert fresh == [False, False, False, True, True]
    assert updated["k"].seqs == {"p": 5}
    assert updated["k"].applied == 5
    # The input marks are untouched.
    assert marks["k"].seqs == {"p": 3}
    assert marks["k"].applied == 3


def test_dedup_skips_re_sends_within_one_batch() -> None:
    events = [ident("k", "p", seq) for seq in (1, 2, 2, 3, 1, 3, 4)]
    fresh, updated = split_fresh(events, {})
    assert fresh == [True, True, False, True, False, False, True]
    assert updated["k"].seqs == {"p": 4}
    assert updated["k"].applied == 4


def test_dedup_keeps_producers_and_keys_apart() -> None:
    marks = {"a": KeyMarks(seqs={"p1": 2, "p2": 7}, applied=9)}
    events = [
        ident("a", "p1", 2),  # seen
        ident("a", "p2", 2),  # seen (p2 is at 7)
        ident("a", "p3", 1),  # new producer
        ident("b", "p1", 1),  # other key: p1's mark on "a" does not count
        ident("a", "p1", 3),
        ident("b", "p1", 1),  # re-send on "b"
        ident("a", "p2", 8),
    ]
    fresh, updated = split_fresh(events, marks)
    assert fresh == [False, False, True, True, True, False, True]
    assert updated["a"].seqs == {"p3": 1, "p1": 3, "p2": 8}
    assert updated["a"].applied == 12
    assert updated["b"].seqs == {"p1": 1}
    assert updated["b"].applied == 1


def test_dedup_events_without_identity_are_always_fresh() -> None:
    marks = {"k": KeyMarks(seqs={"p": 5}, applied=5)}
    events = [
        ident("k", None, None),
        ident("k", None, None),
        ident("k", "p", 5),
        ident("k", None, 1),
        ident("k", "q", None),
    ]
    fresh, updated = split_fresh(events, marks)
    assert fresh == [True, True, False, True, True]
    assert updated["k"].seqs == {"p": 5}
    assert updated["k"].applied == 9


def test_dedup_dead_lettered_events_advance_the_mark_but_do_not_count() -> None:
    events = [ident("k", "p", 1), ident("k", "p", 2, counts=False), ident("k", "p", 3)]
    fresh, updated = split_fresh(events, {})
    assert fresh == [True, True, True]
    assert updated["k"].seqs == {"p": 3}
    assert updated["k"].applied == 2
    # A redelivery of the dead-lettered event is skipped, like any applied one.
    again, _ = split_fresh([ident("k", "p", 2, counts=False)], updated)
    assert again == [False]


def test_dedup_prunes_the_least_recently_seen_producers() -> None:
    count = MAX_PRODUCERS_PER_KEY + 3
    events = [ident("k", f"p{i:02d}", 1) for i in range(count)]
    fresh, updated = split_fresh(events, {})
    assert all(fresh)
    seqs = updated["k"].seqs
    assert len(seqs) == MAX_PRODUCERS_PER_KEY
    assert list(seqs) == [f"p{i:02d}" for i in range(3, count)]
    assert updated["k"].applied == count

    # A producer seen again moves to the most-recent end and survives the next pruning.
    marks = updated
    fresh, updated = split_fresh([ident("k", "p03", 2), ident("k", "new", 1)], marks)
    assert fresh == [True, True]
    seqs = updated["k"].seqs
    assert len(seqs) == MAX_PRODUCERS_PER_KEY
    assert "p03" in seqs and seqs["p03"] == 2
    assert "p04" not in seqs  # now the oldest, pruned
    assert list(seqs)[-2:] == ["p03", "new"]


def test_key_marks_json_round_trip() -> None:
    marks = KeyMarks(seqs={"a": 1, "b": 20}, applied=21)
    again = KeyMarks.from_json(marks.to_json())
    assert again == marks
    assert list(again.seqs) == ["a", "b"]
    assert KeyMarks.from_json(None) == KeyMarks()
    assert KeyMarks.from_json(b'{"p": {"x": 3}}') == KeyMarks(seqs={"x": 3}, applied=0)


# --------------------------------------------------------------------------- deliveries


def test_buffer_take_by_count_returns_at_once() -> None:
    buffer = DeliveryBuffer()
    for tag in range(1, 6):
        buffer.add(delivery(tag=tag))
    started = time.monotonic()
    taken = buffer.take(3, max_wait_s=5.0, idle_wait_s=5.0)
    assert time.monotonic() - started < 1.0
    assert [d.delivery_tag for d in taken] == [1, 2, 3]
    assert len(buffer) == 2
    assert buffer.depth("q") == 2
    assert [d.delivery_tag for d in buffer.take(10, 0.0, 0.0)] == [4, 5]
    assert len(buffer) == 0


def test_buffer_take_by_time_waits_from_the_first_arrival() -> None:
    buffer = DeliveryBuffer()
    buffer.add(delivery(tag=1))
    started = time.monotonic()
    taken = buffer.take(100, max_wait_s=0.3, idle_wait_s=5.0)
    waited = time.monotonic() - started
    assert [d.delivery_tag for d in taken] == [1]
    assert 0.2 <= waited < 2.0

    # An old first arrival means no wait at all.
    buffer.add(delivery(tag=2, received_at=time.monotonic() - 10))
    started = time.monotonic()
    assert [d.delivery_tag for d in buffer.take(100, 0.3, 5.0)] == [2]
    assert time.monotonic() - started < 0.2


def test_buffer_take_survives_its_queue_being_dropped_while_it_waits() -> None:
    # A queue lost (channel closed, lock gone) while the batch loop waits for more events:
    # the wait ends with nothing, it does not trip over the vanished first arrival.
    buffer = DeliveryBuffer()
    buffer.add(delivery(tag=1))
    dropper = threading.Timer(0.1, lambda: buffer.drop("q"))
    dropper.start()
    started = time.monotonic()
    assert buffer.take(100, max_wait_s=2.0, idle_wait_s=1.0) == []
    assert time.monotonic() - started < 1.5
    dropper.join()
    assert len(buffer) == 0


def test_buffer_take_fills_while_waiting() -> None:
    buffer = DeliveryBuffer()

    def feed() -> None:
        for tag in range(1, 4):
            time.sleep(0.05)
            buffer.add(delivery(tag=tag))

    feeder = threading.Thread(target=feed)
    feeder.start()
    started = time.monotonic()
    taken = buffer.take(3, max_wait_s=5.0, idle_wait_s=5.0)
    feeder.join()
    assert [d.delivery_tag for d in taken] == [1, 2, 3]
    # Woken when the batch is full (only then, and on the first arrival), not at the deadline.
    assert time.monotonic() - started < 2.0


def test_buffer_idle_and_wake() -> None:
    buffer = DeliveryBuffer()
    started = time.monotonic()
    assert buffer.take(10, 1.0, idle_wait_s=0.2) == []
    assert 0.15 <= time.monotonic() - started < 2.0

    threading.Timer(0.1, buffer.wake).start()
    started = time.monotonic()
    assert buffer.take(10, 1.0, idle_wait_s=5.0) == []
    assert time.monotonic() - started < 2.0


def test_buffer_takes_a_prefix_of_each_queue_and_puts_back_in_order() -> None:
    buffer = DeliveryBuffer()
    for tag in range(1, 5):
        buffer.add(delivery("a", tag))
        buffer.add(delivery("b", tag))
    taken = buffer.take(8, 0.0, 0.0)
    by_queue: dict[str, list[int]] = {}
    for item in taken:
        by_queue.setdefault(item.queue, []).append(item.delivery_tag)
    assert by_queue == {"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]}

    buffer.add(delivery("a", 5))
    buffer.put_back([d for d in taken if d.delivery_tag <= 2])
    assert len(buffer) == 5
    assert buffer.depth("a") == 3
    assert buffer.depth("b") == 2
    again = buffer.take(10, 0.0, 0.0)
    assert [(d.queue, d.delivery_tag) for d in again if d.queue == "a"] == [
        ("a", 1),
        ("a", 2),
        ("a", 5),
    ]
    assert [(d.queue, d.delivery_tag) for d in again if d.queue == "b"] == [("b", 1), ("b", 2)]


def test_buffer_drop_by_epoch() -> None:
    buffer = DeliveryBuffer()
    buffer.add(delivery("a", 1, epoch=1))
    buffer.add(delivery("a", 2, epoch=1))
    buffer.add(delivery("a", 1, epoch=2))
    buffer.add(delivery("b", 1, epoch=3))
    assert buffer.drop("a", 1) == 2
    assert buffer.depth("a") == 1
    assert len(buffer) == 2
    assert buffer.last_arrival("a") is not None
    assert buffer.drop("a", 1) == 0
    assert buffer.drop("a") == 1
    assert buffer.depth("a") == 0
    assert buffer.last_arrival("a") is None
    assert buffer.drop("missing") == 0
    assert len(buffer) == 1
    assert [(d.queue, d.channel_epoch) for d in buffer.take(10, 0.0, 0.0)] == [("b", 3)]


# --------------------------------------------------------------------------- decoding


def sdk_headers(key: Any = "k", producer: Any = "p", seq: Any = 7) -> dict[str, Any]:
    return {HEADER_KEY: key, HEADER_PRODUCER: producer, HEADER_SEQ: seq}


def test_decode_a_good_event() -> None:
    headers = {**sdk_headers(key=b"k"), HEADER_PUBLISHED_AT: 1_700_000_000_000}
    item = decode(delivery(headers=headers, body=b'{"n": 1}'))
    assert isinstance(item, Event)
    assert (item.key, item.producer, item.seq) == ("k", "p", 7)
    assert item.published_at_ms == 1_700_000_000_000
    assert orjson.loads(item.payload) == {"n": 1}


def test_decode_missing_key_uses_the_fallback_or_fails() -> None:
    headers = sdk_headers()
    del headers[HEADER_KEY]
    item = decode(delivery(headers=headers))
    assert isinstance(item, Undecodable)
    assert item.reason == f"missing header {HEADER_KEY}"
    assert item.key is None
    assert (item.producer, item.seq) == ("p", 7)

    fallback = decode(delivery(headers=headers), fallback_key="from-registry")
    assert isinstance(fallback, Event)
    assert fallback.key == "from-registry"

    # A key header that is not text counts as missing.
    for bad in (b"\xff\xfe", 12, None):
        item = decode(delivery(headers=sdk_headers(key=bad)))
        assert isinstance(item, Undecodable)
        assert item.reason == f"missing header {HEADER_KEY}"


def test_decode_not_utf8() -> None:
    item = decode(delivery(headers=sdk_headers(), body=b"\xff\xfe{}"))
    assert isinstance(item, Undecodable)
    assert item.reason.startswith("undecodable payload: not UTF-8 (")
    assert (item.key, item.producer, item.seq) == ("k", "p", 7)


def test_decode_not_json() -> None:
    for body in (b"not json {", b"", b'{"a": 1'):
        item = decode(delivery(headers=sdk_headers(), body=body))
        assert isinstance(item, Undecodable), body
        assert item.reason.startswith("undecodable payload: not JSON ("), item.reason
        assert item.key == "k"


def test_decode_identity_needs_both_producer_and_integer_seq() -> None:
    cases: list[dict[str, Any]] = [
        sdk_headers(producer=None),
        sdk_headers(seq=None),
        sdk_headers(seq=True),  # a bool is not a seq
        sdk_headers(seq="7"),
        sdk_headers(producer=b"\xff"),
    ]
    for headers in cases:
        item = decode(delivery(headers=headers))
        assert isinstance(item, Event), headers
        assert (item.producer, item.seq) == (None, None), headers
    item = decode(delivery(headers=sdk_headers(producer=b"p-bytes")))
    assert isinstance(item, Event)
    assert item.producer == "p-bytes"
    item = decode(delivery(headers={**sdk_headers(), HEADER_PUBLISHED_AT: "soon"}))
    assert isinstance(item, Event)
    assert item.published_at_ms is None


# --------------------------------------------------------------------------- fold


def record_batch(
    rows: Sequence[tuple[str, Any, str | None, int | None]],
    first_arrival: int = 0,
    arrivals: Sequence[int] | None = None,
) -> pa.RecordBatch:
    """Rows as Spark hands them to the fold; arrival numbers count up unless given."""
    numbers = (
        list(arrivals)
        if arrivals is not None
        else list(range(first_arrival, first_arrival + len(rows)))
    )
    return pa.RecordBatch.from_arrays(
        [
            pa.array([r[0] for r in rows], pa.string()),
            pa.array([orjson.dumps(r[1]).decode() for r in rows], pa.string()),
            pa.array([r[2] for r in rows], pa.string()),
            pa.array([r[3] for r in rows], pa.int64()),
            pa.array(numbers, pa.int64()),
        ],
        names=["key", "payload", "producer", "seq", "_arrival"],
    )


def run_fold(reducer: Any, prior: dict[str, str], batches: list[pa.RecordBatch]) -> pa.Table:
    out = list(make_folder(reducer, prior)(iter(batches)))
    assert len(out) == 1
    assert out[0].schema.names == list(STATE_COLUMNS)
    return pa.Table.from_batches(out)


def test_fold_applies_each_keys_events_in_order_across_record_batches() -> None:
    first = record_batch(
        [("a", {"n": 1, "producer": "p"}, "p", 1), ("a", {"n": 2, "producer": "p"}, "p", 2)]
    )
    second = record_batch(
        [("a", {"n": 3, "producer": "p"}, "p", 3), ("b", {"n": 1, "producer": "p"}, "p", 1)],
        first_arrival=2,
    )
    table = run_fold(audit_event, {}, [first, second]).to_pydict()
    assert table["key"] == ["a", "b"]
    assert table["applied"] == [3, 1]
    a = orjson.loads(table["state"][0])
    assert a == {"applied": 3, "last": {"p": 3}, "violations": []}
    assert orjson.loads(table["state"][1]) == {"applied": 1, "last": {"p": 1}, "violations": []}


def test_fold_orders_each_keys_events_by_arrival_not_by_position() -> None:
    # After a shuffle Spark may hand rows over in any order; arrival numbers restore it.
    rows = [("a", {"n": n, "producer": "p"}, "p", n) for n in (3, 1, 2)]
    table = run_fold(audit_event, {}, [record_batch(rows, arrivals=[30, 10, 20])]).to_pydict()
    assert orjson.loads(table["state"][0]) == {"applied": 3, "last": {"p": 3}, "violations": []}


def test_fold_records_order_violations() -> None:
    rows = [("a", {"n": n, "producer": "p"}, "p", n) for n in (1, 3, 2)]
    table = run_fold(audit_event, {}, [record_batch(rows)]).to_pydict()
    state = orjson.loads(table["state"][0])
    assert state["violations"] == [["p", 1, 3], ["p", 3, 2]]


def test_fold_starts_from_the_prior_state() -> None:
    prior = {"a": orjson.dumps({"applied": 5, "last": {"p": 5}, "violations": []}).decode()}
    rows = [("a", {"n": 6, "producer": "p"}, "p", 6), ("c", {"n": 1, "producer": "p"}, "p", 1)]
    table = run_fold(audit_event, prior, [record_batch(rows)]).to_pydict()
    states = dict(zip(table["key"], table["state"], strict=True))
    assert orjson.loads(states["a"]) == {"applied": 6, "last": {"p": 6}, "violations": []}
    assert orjson.loads(states["c"])["applied"] == 1
    assert dict(zip(table["key"], table["applied"], strict=True)) == {"a": 1, "c": 1}


def test_fold_of_nothing_is_an_empty_batch() -> None:
    table = run_fold(audit_event, {}, [])
    assert table.num_rows == 0


def test_fold_failure_names_the_key_producer_and_seq() -> None:
    rows = [("a", {"n": 1, "producer": "p"}, "p", 1), ("bad-key", {"n": 1}, "prod-9", 41)]
    rows.append(("bad-key", {"n": 2, "poison": True}, "prod-9", 42))
    with pytest.raises(FoldFailed) as caught:
        run_fold(audit_event, {}, [record_batch(rows)])
    message = str(caught.value)
    assert "'bad-key'" in message
    assert "producer prod-9" in message
    assert "seq 42" in message
    assert "ValueError: poison event 2" in message


def test_fold_refuses_a_state_that_is_not_json() -> None:
    def to_set(state: Any, event: Any) -> Any:
        return {1, 2}

    with pytest.raises(FoldFailed, match=r"state of key 'x' is not JSON"):
        run_fold(to_set, {}, [record_batch([("x", {}, None, None)])])


# --------------------------------------------------------------------------- describe_failure


def test_describe_failure_of_a_fold_failure_is_its_first_line() -> None:
    text = (
        "An exception was thrown from the Python worker.\n"
        "Traceback (most recent call last):\n"
        '  File "fold.py", line 70, in fold\n'
        "keyq.worker.spark.fold.FoldFailed: fold of key 'k' failed on the event from producer p "
        "seq 3: "
        "ValueError: poison event 3\n"
        "\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException(X.scala:1)\n"
    )
    assert describe_failure(RuntimeError(text)) == (
        "fold of key 'k' failed on the event from producer p seq 3: ValueError: poison event 3"
    )


def test_describe_failure_of_a_spark_error_is_its_python_line() -> None:
    text = (
        "Job aborted due to stage failure\n"
        "Traceback (most recent call last):\n"
        '  File "/x/pipeline.py", line 3, in f\n'
        "ZeroDivisionError: division by zero\n"
        "\tat org.apache.spark.api.python.PythonRunner.compute(PythonRunner.scala:9)\n"
    )
    assert describe_failure(RuntimeError(text)) == (
        "pipeline failed: ZeroDivisionError: division by zero"
    )


def test_describe_failure_without_a_colon_names_the_exception() -> None:
    assert describe_failure(KeyError("nope")) == "pipeline failed: KeyError: 'nope'"
    assert describe_failure(RuntimeError()) == "pipeline failed: RuntimeError: "


def test_describe_failure_is_bounded() -> None:
    described = describe_failure(ValueError("x: " + "y" * 5000))
    assert described.startswith("pipeline failed: x: yyy")
    assert len(described) == 1000
    described = describe_failure(ValueError("z" * 5000))
    assert len(described) == 1000


# --------------------------------------------------------------------------- sinks


def test_open_sink_specs(tmp_path: Path) -> None:
    for spec in (None, "", "none", " NONE "):
        assert open_sink(spec) is None
    sink = open_sink(f"parquet:{tmp_path / 'a'}")
    assert isinstance(sink, ParquetSink)
    assert sink.directory == tmp_path / "a"
    assert (tmp_path / "a" / STAGING).is_dir()
    assert sink.describe() == f"parquet:{tmp_path / 'a'}"
    bare = open_sink(str(tmp_path / "b"))
    assert isinstance(bare, ParquetSink)
    assert bare.directory == tmp_path / "b"
    for bad in ("s3:bucket/path", "parquet:", "csv:/tmp/x"):
        with pytest.raises(ConfigurationError, match="parquet:/path/to/folder"):
            open_sink(bad)


def test_parquet_sink_cannot_create_its_folder(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigurationError, match="cannot create sink folder"):
        ParquetSink(blocker / "sub")


def test_parquet_sink_stage_publish_discard(tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path)
    table = pa.table({"key": ["a", "b"], "n": [1, 2]})
    staged = sink.stage(table, "w-1")
    staged_path = tmp_path / STAGING / staged
    assert staged_path.is_file()
    assert not sink.final_path("w-1").exists()
    assert not list((tmp_path / STAGING).glob("*.partial"))
    assert list(tmp_path.glob("part-*.parquet")) == []

    sink.publish("w-1", staged)
    final = sink.final_path("w-1")
    assert final == tmp_path / "part-w-1.parquet"
    assert not staged_path.exists()
    assert pq.read_table(final).to_pydict() == {"key": ["a", "b"], "n": [1, 2]}
    sink.publish("w-1", staged)  # idempotent: a second publish changes nothing
    assert pq.read_table(final).num_rows == 2

    other = sink.stage(table, "w-2")
    sink.discard(other)
    assert not (tmp_path / STAGING / other).exists()
    sink.discard(other)  # discarding twice is fine
    sink.publish("w-2", other)  # nothing staged: nothing published
    assert not sink.final_path("w-2").exists()


def test_parquet_sink_sweeps_only_old_unreferenced_files(tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path)
    table = pa.table({"n": [1]})
    old_orphan = sink.stage(table, "old-orphan")
    old_pending = sink.stage(table, "old-pending")
    young = sink.stage(table, "young")
    long_ago = time.time() - 7200
    for name in (old_orphan, old_pending):
        os.utime(tmp_path / STAGING / name, (long_ago, long_ago))
    assert sink.sweep_orphans({old_pending}) == 1
    left = sorted(p.name for p in (tmp_path / STAGING).iterdir())
    assert left == sorted([old_pending, young])
    assert sink.sweep_orphans(set(), older_than_s=0.0) == 2
    assert list((tmp_path / STAGING).iterdir()) == []


# --------------------------------------------------------------------------- settings


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KEYQ_"):
            monkeypatch.delenv(name)


@pytest.mark.usefixtures("clean_env")
def test_worker_settings_tick_must_be_a_third_of_the_lock_ttl() -> None:
    ok = load_settings(WorkerSettings, tick_ms=1000, lock_ttl_ms=3000)
    assert (ok.tick_ms, ok.lock_ttl_ms) == (1000, 3000)
    with pytest.raises(
        ConfigurationError, match="KEYQ_TICK_MS must be at most a third of KEYQ_LOCK_TTL_MS"
    ):
        load_settings(WorkerSettings, tick_ms=1001, lock_ttl_ms=3000)
    with pytest.raises(ConfigurationError, match="KEYQ_TICK_MS must be at most a third"):
        load_settings(WorkerSettings, tick_ms=2000)  # default ttl 4000


@pytest.mark.usefixtures("clean_env")
def test_worker_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEYQ_TICK_MS", "900")
    monkeypatch.setenv("KEYQ_LOCK_TTL_MS", "2000")
    with pytest.raises(ConfigurationError, match="KEYQ_TICK_MS"):
        load_settings(WorkerSettings)
    monkeypatch.setenv("KEYQ_MAX_ATTEMPTS", "0")
    monkeypatch.setenv("KEYQ_TICK_MS", "200")
    with pytest.raises(ConfigurationError, match="KEYQ_MAX_ATTEMPTS"):
        load_settings(WorkerSettings)
    monkeypatch.setenv("KEYQ_MAX_ATTEMPTS", "2")
    assert load_settings(WorkerSettings).max_attempts == 2


# --------------------------------------------------------------------------- pipelines


def test_load_pipeline_forms() -> None:
    assert load_pipeline("tests.pipelines:audit") is audit
    assert load_pipeline("tests.pipelines.audit") is audit


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("audit", "must be written module:function"),
        ("tests.pipelines:", "must be written module:function"),
        (":audit", "must be written module:function"),
        ("no_such_module_kq:run", "No module named 'no_such_module_kq'"),
        ("tests.pipelines:missing", "'missing' is not a function"),
        ("tests.pipelines:os", "'os' is not a function"),
    ],
)
def test_load_pipeline_errors(spec: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        load_pipeline(spec)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "key", ["plain", "ключ 'quoted' \"double\"", "new\nline ] [keyq-event 00 x 1]", "x" * 4096]
)
def test_a_fold_failure_names_its_event_for_any_key(key: str) -> None:
    from keyq.worker.spark.fold import event_token, failing_event, without_event_token

    text = f"FoldFailed: fold of key {key!r} failed: ValueError: boom{event_token(key, 'p.1-a', 7)}"
    assert failing_event(text) == (key, "p.1-a", 7)
    assert without_event_token(text) == f"FoldFailed: fold of key {key!r} failed: ValueError: boom"
    assert event_token(key, None, None) == ""


def test_a_lightly_loaded_worker_starts_batches_at_once_and_a_loaded_one_waits_to_fill() -> None:
    from keyq.worker.serving import BATCH_WAIT_MAX_S, batch_wait

    settings = load_settings(WorkerSettings, batch_max_events=5000)
    assert batch_wait(settings, 150, 0.2) == 0.0
    assert batch_wait(settings, 3000, 0.3) == pytest.approx(0.6)
    assert batch_wait(settings, 5000, 5.0) == BATCH_WAIT_MAX_S
    lingering = load_settings(WorkerSettings, batch_max_events=5000, batch_max_ms=250)
    assert batch_wait(lingering, 150, 0.2) == pytest.approx(0.25)
    assert batch_wait(lingering, 4000, 0.05) == pytest.approx(0.25)
