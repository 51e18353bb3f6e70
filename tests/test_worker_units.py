"""The worker's pure logic (dedup, delivery buffer, decoding, fold, failure texts, sinks,
settings, pipeline loading), with no services: the fold is called on Arrow record batches."""

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


def delivery(
    queue: str = "q",
    tag: int = 1,
    *,
    epoch: int = 1,
    headers: dict[str, Any] | None = None,
    body: bytes = b"{}",
    received_at: float | None = None,
) -> Delivery:
    made = Delivery(queue, epoch, tag, False, headers or {}, "application/json", f"m-{tag}", body)
    if received_at is not None:
        made.received_at = received_at
    return made


def split_fresh(
    events: list[Identified], marks: dict[str, KeyMarks]
) -> tuple[list[bool], dict[str, KeyMarks]]:
    """Which events a batch applies, when none of them waits for an earlier seq."""
    plan = plan_batch(events, marks, now=0.0, gap_timeout_s=60.0)
    assert plan.deferred == [] and plan.late == []
    applied = set(plan.apply)
    assert plan.apply == sorted(plan.apply)  # in order already: applied as delivered
    return [index in applied for index in range(len(events))], plan.marks


def idents(spec: str) -> list[Identified]:
    """Events written ``key:producer:seq``, ``-`` for a producer or seq missing, a trailing
    ``!`` for one dead-lettered (it moves the mark but does not count as applied)."""
    words = [(word.rstrip("!").split(":"), word.endswith("!")) for word in spec.split()]
    return [
        Identified(key, None if p == "-" else p, None if n == "-" else int(n), counts=not dead)
        for (key, p, n), dead in words
    ]


@pytest.mark.parametrize(
    ("marks", "events", "fresh", "after"),
    [
        # redeliveries at or below the mark are skipped
        ({"k": ({"p": 3}, 3)}, "k:p:1 k:p:2 k:p:3 k:p:4 k:p:5", "---++", {"k": ({"p": 5}, 5)}),
        # re-sends within one batch are skipped
        ({}, "k:p:1 k:p:2 k:p:2 k:p:3 k:p:1 k:p:3 k:p:4", "++-+--+", {"k": ({"p": 4}, 4)}),
        # producers and keys are apart: p2 is at 7, a new p3; p1's mark on "a" is not on "b"
        (
            {"a": ({"p1": 2, "p2": 7}, 9)},
            "a:p1:2 a:p2:2 a:p3:1 b:p1:1 a:p1:3 b:p1:1 a:p2:8",
            "--+++-+",
            {"a": ({"p3": 1, "p1": 3, "p2": 8}, 12), "b": ({"p1": 1}, 1)},
        ),
        # events without a whole identity are always fresh
        ({"k": ({"p": 5}, 5)}, "k:-:- k:-:- k:p:5 k:-:1 k:q:-", "++-++", {"k": ({"p": 5}, 9)}),
        # a dead-lettered event advances the mark but does not count; a redelivery is skipped
        ({}, "k:p:1 k:p:2! k:p:3", "+++", {"k": ({"p": 3}, 2)}),
        ({"k": ({"p": 3}, 2)}, "k:p:2!", "-", {"k": ({"p": 3}, 2)}),
    ],
)
def test_dedup_of_a_batch(
    marks: dict[str, tuple[dict[str, int], int]],
    events: str,
    fresh: str,
    after: dict[str, tuple[dict[str, int], int]],
) -> None:
    given = {key: KeyMarks(seqs=dict(seqs), applied=n) for key, (seqs, n) in marks.items()}
    applied, updated = split_fresh(idents(events), given)
    assert "".join("+" if a else "-" for a in applied) == fresh, "which events are applied"
    assert {key: (m.seqs, m.applied) for key, m in updated.items()} == after, "marks after"
    assert {key: (m.seqs, m.applied) for key, m in given.items()} == marks, "input untouched"


def test_dedup_prunes_the_least_recently_seen_producers() -> None:
    count = MAX_PRODUCERS_PER_KEY + 3
    events = [Identified("k", f"p{i:02d}", 1) for i in range(count)]
    fresh, updated = split_fresh(events, {})
    assert all(fresh)
    seqs = updated["k"].seqs
    assert len(seqs) == MAX_PRODUCERS_PER_KEY
    assert list(seqs) == [f"p{i:02d}" for i in range(3, count)]
    assert updated["k"].applied == count

    # A producer seen again moves to the most-recent end and survives the next pruning.
    marks = updated
    fresh, updated = split_fresh(idents("k:p03:2 k:new:1"), marks)
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


def test_buffer_take_by_count_returns_at_once_and_by_time_waits_from_the_first_arrival() -> None:
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
    # Short of the count, a take waits from the first arrival.
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


def test_buffer_take_wakes_on_a_full_batch_a_wake_or_its_queue_dropped() -> None:
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
    assert time.monotonic() - started < 2.0, "woken by a full batch"

    started = time.monotonic()
    assert buffer.take(10, 1.0, idle_wait_s=0.2) == []
    assert 0.15 <= time.monotonic() - started < 2.0, "an idle wait"
    threading.Timer(0.1, buffer.wake).start()
    started = time.monotonic()
    assert buffer.take(10, 1.0, idle_wait_s=5.0) == []
    assert time.monotonic() - started < 2.0, "woken by wake()"

    # A queue lost (channel closed, lock gone) while the batch loop waits for more events:
    # the wait ends with nothing, it does not trip over the vanished first arrival.
    buffer.add(delivery(tag=1))
    dropper = threading.Timer(0.1, lambda: buffer.drop("q"))
    dropper.start()
    started = time.monotonic()
    assert buffer.take(100, max_wait_s=2.0, idle_wait_s=1.0) == []
    assert time.monotonic() - started < 1.5, "woken by the queue dropped"
    dropper.join()
    assert len(buffer) == 0


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
    assert [d.delivery_tag for d in again if d.queue == "a"] == [1, 2, 5]
    assert [d.delivery_tag for d in again if d.queue == "b"] == [1, 2]


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


def sdk_headers(key: Any = "k", producer: Any = "p", seq: Any = 7, **more: Any) -> dict[str, Any]:
    headers = {HEADER_KEY: key, HEADER_PRODUCER: producer, HEADER_SEQ: seq, **more}
    return {name: value for name, value in headers.items() if value is not ...}


MISSING_KEY = f"missing header {HEADER_KEY}"
NOT_JSON, NOT_UTF8 = "undecodable payload: not JSON (", "undecodable payload: not UTF-8 ("


@pytest.mark.parametrize(
    ("headers", "body", "fallback", "identity", "reason"),
    [
        pytest.param(sdk_headers(key=...), b"{}", None, (None, "p", 7), MISSING_KEY, id="no-key"),
        pytest.param(sdk_headers(key=...), b"{}", "reg", ("reg", "p", 7), None, id="fallback"),
        # a key header that is not text counts as missing
        *[
            pytest.param(sdk_headers(key=bad), b"{}", None, (None, "p", 7), MISSING_KEY, id=name)
            for name, bad in (("key-not-utf8", b"\xff\xfe"), ("key-int", 12), ("key-none", None))
        ],
        # an unreadable payload keeps the identity
        pytest.param(sdk_headers(), b"\xff\xfe{}", None, ("k", "p", 7), NOT_UTF8, id="not-utf8"),
        pytest.param(sdk_headers(), b"not json {", None, ("k", "p", 7), NOT_JSON, id="not-json"),
        pytest.param(sdk_headers(), b"", None, ("k", "p", 7), NOT_JSON, id="empty-body"),
        pytest.param(sdk_headers(), b'{"a": 1', None, ("k", "p", 7), NOT_JSON, id="cut-json"),
        # the identity needs both a text producer and an integer seq
        *[
            pytest.param(sdk_headers(**bad), b"{}", None, ("k", None, None), None, id=name)
            for name, bad in (
                ("no-producer", {"producer": None}),
                ("no-seq", {"seq": None}),
                ("bool-seq", {"seq": True}),
                ("text-seq", {"seq": "7"}),
                ("producer-not-utf8", {"producer": b"\xff"}),
            )
        ],
        pytest.param(sdk_headers(producer=b"p-b"), b"{}", None, ("k", "p-b", 7), None, id="bytes"),
    ],
)
def test_decode(
    headers: dict[str, Any],
    body: bytes,
    fallback: str | None,
    identity: tuple[Any, ...],
    reason: str | None,
) -> None:
    item = decode(delivery(headers=headers, body=body), fallback_key=fallback)
    assert isinstance(item, Event if reason is None else Undecodable), item
    assert (item.key, item.producer, item.seq) == identity
    if isinstance(item, Undecodable):
        assert reason is not None, item.reason
        assert item.reason == reason or (reason[-1] == "(" and item.reason.startswith(reason))


def test_decode_reads_the_published_time_and_the_payload() -> None:
    headers = sdk_headers(key=b"k", **{HEADER_PUBLISHED_AT: 1_700_000_000_000})
    item = decode(delivery(headers=headers, body=b'{"n": 1}'))
    assert isinstance(item, Event) and (item.key, item.producer, item.seq) == ("k", "p", 7)
    assert item.published_at_ms == 1_700_000_000_000
    assert orjson.loads(item.payload) == {"n": 1}
    item = decode(delivery(headers=sdk_headers(**{HEADER_PUBLISHED_AT: "soon"})))
    assert isinstance(item, Event) and item.published_at_ms is None


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


def rows_of(key: str, seqs: Sequence[int]) -> list[tuple[str, Any, str | None, int | None]]:
    return [(key, {"n": n, "producer": "p"}, "p", n) for n in seqs]


def folded(prior: dict[str, Any], batches: list[pa.RecordBatch]) -> tuple[dict[str, Any], Any]:
    """(state, events applied) of each key, in the order of the fold's output."""
    given = {key: orjson.dumps(state).decode() for key, state in prior.items()}
    table = run_fold(audit_event, given, batches).to_pydict()
    states = [orjson.loads(state) for state in table["state"]]
    return dict(zip(table["key"], states, strict=True)), table["applied"]


def audit_of(applied: int, last: int, *violations: list[Any]) -> dict[str, Any]:
    return {"applied": applied, "last": {"p": last}, "violations": list(violations)}


def test_fold_applies_each_keys_events_in_arrival_order_from_the_prior_state() -> None:
    across = [
        record_batch(rows_of("a", (1, 2))),
        record_batch(rows_of("a", (3,)) + rows_of("b", (1,)), first_arrival=2),
    ]
    states, applied = folded({}, across)
    assert list(states.items()) == [("a", audit_of(3, 3)), ("b", audit_of(1, 1))], "batches"
    assert applied == [3, 1]
    # After a shuffle Spark may hand rows over in any order; arrival numbers restore it.
    shuffled = record_batch(rows_of("a", (3, 1, 2)), arrivals=[30, 10, 20])
    assert folded({}, [shuffled])[0] == {"a": audit_of(3, 3)}, "by arrival"
    violated = record_batch(rows_of("a", (1, 3, 2)))
    assert folded({}, [violated])[0]["a"]["violations"] == [["p", 1, 3], ["p", 3, 2]]
    states, applied = folded(
        {"a": audit_of(5, 5)}, [record_batch(rows_of("a", (6,)) + rows_of("c", (1,)))]
    )
    assert states == {"a": audit_of(6, 6), "c": audit_of(1, 1)}, "from the prior state"
    assert applied == [1, 1]
    assert folded({}, []) == ({}, []), "a fold of nothing is an empty batch"


def test_fold_failure_names_the_key_producer_and_seq_or_the_state_not_json() -> None:
    rows = [("a", {"n": 1, "producer": "p"}, "p", 1), ("bad-key", {"n": 1}, "prod-9", 41)]
    rows.append(("bad-key", {"n": 2, "poison": True}, "prod-9", 42))
    with pytest.raises(FoldFailed) as caught:
        run_fold(audit_event, {}, [record_batch(rows)])
    message = str(caught.value)
    assert "'bad-key'" in message
    assert "producer prod-9" in message
    assert "seq 42" in message
    assert "ValueError: poison event 2" in message

    def to_set(state: Any, event: Any) -> Any:
        return {1, 2}

    with pytest.raises(FoldFailed, match=r"state of key 'x' is not JSON"):
        run_fold(to_set, {}, [record_batch([("x", {}, None, None)])])


FOLD_FAILED_TEXT = (
    "An exception was thrown from the Python worker.\n"
    "Traceback (most recent call last):\n"
    '  File "fold.py", line 70, in fold\n'
    "keyq.worker.spark.fold.FoldFailed: fold of key 'k' failed on the event from producer p "
    "seq 3: ValueError: poison event 3\n"
    "\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException(X.scala:1)\n"
)
SPARK_ERROR_TEXT = (
    "Job aborted due to stage failure\n"
    "Traceback (most recent call last):\n"
    '  File "/x/pipeline.py", line 3, in f\n'
    "ZeroDivisionError: division by zero\n"
    "\tat org.apache.spark.api.python.PythonRunner.compute(PythonRunner.scala:9)\n"
)


@pytest.mark.parametrize(
    ("failure", "described"),
    [
        pytest.param(  # a fold failure: its first line
            RuntimeError(FOLD_FAILED_TEXT),
            "fold of key 'k' failed on the event from producer p seq 3: ValueError: poison event 3",
            id="fold-failure",
        ),
        pytest.param(  # a Spark error: its Python line
            RuntimeError(SPARK_ERROR_TEXT),
            "pipeline failed: ZeroDivisionError: division by zero",
            id="spark-error",
        ),
        pytest.param(KeyError("nope"), "pipeline failed: KeyError: 'nope'", id="no-colon"),
        pytest.param(RuntimeError(), "pipeline failed: RuntimeError: ", id="empty"),
    ],
)
def test_describe_failure(failure: Exception, described: str) -> None:
    assert describe_failure(failure) == described


def test_describe_failure_is_bounded() -> None:
    described = describe_failure(ValueError("x: " + "y" * 5000))
    assert described.startswith("pipeline failed: x: yyy")
    assert len(described) == 1000
    described = describe_failure(ValueError("z" * 5000))
    assert len(described) == 1000


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


def test_worker_settings_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KEYQ_"):
            monkeypatch.delenv(name)
    ok = load_settings(WorkerSettings, tick_ms=1000, lock_ttl_ms=3000)
    assert (ok.tick_ms, ok.lock_ttl_ms) == (1000, 3000)
    with pytest.raises(
        ConfigurationError, match="KEYQ_TICK_MS must be at most a third of KEYQ_LOCK_TTL_MS"
    ):
        load_settings(WorkerSettings, tick_ms=1001, lock_ttl_ms=3000)
    with pytest.raises(ConfigurationError, match="KEYQ_TICK_MS must be at most a third"):
        load_settings(WorkerSettings, tick_ms=2000)  # default ttl 4000
    # The same checks on settings read from the environment.
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


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.pipelines:audit", None),
        ("tests.pipelines.audit", None),
        ("audit", "must be written module:function"),
        ("tests.pipelines:", "must be written module:function"),
        (":audit", "must be written module:function"),
        ("no_such_module_kq:run", "No module named 'no_such_module_kq'"),
        ("tests.pipelines:missing", "'missing' is not a function"),
        ("tests.pipelines:os", "'os' is not a function"),
    ],
)
def test_load_pipeline(spec: str, message: str | None) -> None:
    if message is None:
        assert load_pipeline(spec) is audit
        return
    with pytest.raises(ConfigurationError) as caught:
        load_pipeline(spec)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "key",
    ["plain", "ключ 'quoted' \"double\"", "new\nline ] [keyq-event 00 x 1]", "x" * 4096],
    ids=["plain", "quotes", "newline-token", "long"],
)
def test_a_fold_failure_names_its_event_for_any_key(key: str) -> None:
    from keyq.worker.spark.fold import event_token, failing_event, without_event_token

    text = f"FoldFailed: fold of key {key!r} failed: ValueError: boom{event_token(key, 'p.1-a', 7)}"
    assert failing_event(text) == (key, "p.1-a", 7)
    assert without_event_token(text) == f"FoldFailed: fold of key {key!r} failed: ValueError: boom"
    assert event_token(key, None, None) == ""
