"""The demo order pipeline: the reducer's rules, the demo traffic, and the pipeline on real
workers, one of them killed with kill -9 mid-run. Every order must end in exactly the state a
plain Python fold of its published events gives: in Redis, in the Parquet output, and as
``keyq state`` prints it."""

from __future__ import annotations

import copy
import pickle
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from statistics import median
from types import SimpleNamespace
from typing import Any

import orjson
import pika
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from keyq import Producer
from keyq.broker.locks import FencedLocks
from keyq.broker.naming import key_queue_name
from keyq.broker.registry import QueueRegistry
from keyq.demo.orders import (
    EVENT_TYPES,
    MAX_INT64,
    OrderState,
    apply_order_event,
    expected_states,
    generate_orders,
    new_order_state,
    pipeline,
)
from keyq.worker.batch.state_store import StateStore
from keyq.worker.spark.fold import FoldFailed, make_folder
from tests.conftest import StreamFixture
from tests.helpers import queue_depth
from tests.workers import held_by, run_keyq, wait_until

ORDER = "order-00001"


def ev(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "order": ORDER, **fields}


def item(kind: str, sku: str, qty: int, price_cents: int) -> dict[str, Any]:
    return ev(kind, sku=sku, qty=qty, price_cents=price_cents)


def add(sku: str, qty: int, price_cents: int) -> dict[str, Any]:
    return item("item_added", sku, qty, price_cents)


def remove(sku: str, qty: int, price_cents: int) -> dict[str, Any]:
    return item("item_removed", sku, qty, price_cents)


def fold(events: list[dict[str, Any]], state: OrderState | None = None) -> OrderState | None:
    for event in events:
        state = apply_order_event(state, event)
    return state


def state_of(
    status: str,
    items: dict[str, int],
    total_cents: int,
    events_applied: int,
    rejected: int = 0,
) -> dict[str, Any]:
    return {
        "status": status,
        "total_cents": total_cents,
        "item_count": sum(items.values()),
        "items": items,
        "events_applied": events_applied,
        "rejected": rejected,
    }


CART = [ev("created"), add("a", 2, 150), add("b", 1, 999)]


# --------------------------------------------------------------------------- transitions


IN_CART = {"a": 2, "b": 1}
LIFECYCLES: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = [
    ("created", [ev("created")], state_of("created", {}, 0, 1)),
    ("a cart", CART, state_of("created", IN_CART, 1299, 3)),
    ("more of a sku", [*CART, add("a", 3, 150)], state_of("created", {"a": 5, "b": 1}, 1749, 4)),
    ("paid", [*CART, ev("paid")], state_of("paid", IN_CART, 1299, 4)),
    ("shipped", [*CART, ev("paid"), ev("shipped")], state_of("shipped", IN_CART, 1299, 5)),
    (
        "removed partly",
        [*CART, remove("a", 1, 150)],
        state_of("created", {"a": 1, "b": 1}, 1149, 4),
    ),
    # a sku at 0 leaves ``items``
    ("removed wholly", [*CART, remove("b", 1, 999)], state_of("created", {"a": 2}, 300, 4)),
    (
        "free items",
        [ev("created"), add("gift", 3, 0), ev("paid")],
        state_of("paid", {"gift": 3}, 0, 3),
    ),
    ("cancelled while created", [*CART, ev("cancelled")], state_of("cancelled", IN_CART, 1299, 4)),
    (
        "cancelled while paid",
        [*CART, ev("paid"), ev("cancelled")],
        state_of("cancelled", IN_CART, 1299, 5),
    ),
]


@pytest.mark.parametrize(
    ("events", "state"), [r[1:] for r in LIFECYCLES], ids=[r[0] for r in LIFECYCLES]
)
def test_valid_transitions(events: list[dict[str, Any]], state: dict[str, Any]) -> None:
    assert fold(events) == state


REJECTED: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = [
    ("item before created", [], add("a", 1, 100)),
    ("paid before created", [], ev("paid")),
    ("cancelled before created", [], ev("cancelled")),
    ("created twice", [ev("created")], ev("created")),
    ("shipped before paid", CART, ev("shipped")),
    ("paid with an empty cart", [ev("created")], ev("paid")),
    ("removing more than present", CART, remove("a", 3, 150)),
    ("removing an absent sku", CART, remove("zzz", 1, 150)),
    ("removal that would make the total negative", CART, remove("a", 2, 5000)),
    ("item added after paid", [*CART, ev("paid")], add("c", 1, 10)),
    ("item removed after paid", [*CART, ev("paid")], remove("a", 1, 150)),
    ("paid twice", [*CART, ev("paid")], ev("paid")),
    ("created after paid", [*CART, ev("paid")], ev("created")),
    ("cancelled after shipped", [*CART, ev("paid"), ev("shipped")], ev("cancelled")),
    ("shipped twice", [*CART, ev("paid"), ev("shipped")], ev("shipped")),
    ("item added after shipped", [*CART, ev("paid"), ev("shipped")], add("a", 1, 1)),
    ("paid after cancelled", [*CART, ev("cancelled")], ev("paid")),
    ("shipped after cancelled", [*CART, ev("paid"), ev("cancelled")], ev("shipped")),
    ("item added after cancelled", [*CART, ev("cancelled")], add("a", 1, 1)),
    ("cancelled twice", [*CART, ev("cancelled")], ev("cancelled")),
    ("a total past 64 bits", [ev("created"), add("a", 1, MAX_INT64 - 10)], add("a", 1, 11)),
]


@pytest.mark.parametrize(
    ("prefix", "event"), [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED]
)
def test_invalid_transitions_are_counted_and_change_nothing_else(
    prefix: list[dict[str, Any]], event: dict[str, Any]
) -> None:
    before = fold(prefix) or new_order_state()
    after = apply_order_event(fold(prefix), event)
    expected = {**before, "events_applied": before["events_applied"] + 1}
    expected["rejected"] = before["rejected"] + 1
    assert after == expected


@pytest.mark.parametrize(
    ("event", "words"),
    [
        ({"order": ORDER}, "no 'type'"),
        ({"type": None, "order": ORDER}, "no 'type'"),
        ({"type": "refunded", "order": ORDER}, "unknown order event type 'refunded'"),
        ({"type": "CREATED", "order": ORDER}, "unknown order event type"),
        ({"type": 3, "order": ORDER}, "unknown order event type 3"),
        ({"type": ["created"], "order": ORDER}, "unknown order event type"),
    ],
)
def test_unknown_or_missing_type_raises(event: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(")) as raised:
        apply_order_event(None, event)
    if "unknown" in words:
        assert "expected one of created, item_added" in str(raised.value)
    with pytest.raises(ValueError):  # whatever the state
        apply_order_event(fold([*CART, ev("paid")]), event)


@pytest.mark.parametrize(
    ("event", "words"),
    [
        ({"type": "created"}, "'order' must be a non-empty string"),
        ({"type": "paid", "order": ""}, "'order' must be a non-empty string"),
        (add("a", 0, 100), "'qty' must be an integer >= 1"),
        (add("a", -2, 100), "'qty' must be an integer >= 1"),
        (ev("item_added", sku="a", qty=1.5, price_cents=100), "'qty' must be an integer"),
        (ev("item_added", sku="a", qty=True, price_cents=100), "'qty' must be an integer"),
        (ev("item_added", sku="a", qty="2", price_cents=100), "'qty' must be an integer"),
        (ev("item_added", sku="a", qty=1, price_cents=9.99), "'price_cents' must be an integer"),
        (remove("a", 1, -1), "'price_cents' must be an integer >= 0"),
        (ev("item_added", sku="a", qty=1), "'price_cents' must be an integer"),
        (ev("item_added", qty=1, price_cents=1), "'sku' must be a non-empty string"),
        (remove("", 1, 1), "'sku' must be a non-empty string"),
        *[
            (not_an_object, "must be a JSON object")
            for not_an_object in (["created"], "x", 7, None)
        ],
    ],
)
def test_malformed_events_raise(event: dict[str, Any], words: str) -> None:
    # Malformed events are poison whatever the status: even where the transition would be
    # rejected anyway, so the dead-letter queue shows every broken producer.
    for state in (None, fold(CART), fold([*CART, ev("paid"), ev("shipped")])):
        with pytest.raises(ValueError, match=words):
            apply_order_event(state, event)


def test_the_reducer_never_modifies_its_input() -> None:
    state = fold(CART)
    assert state is not None
    frozen = copy.deepcopy(state)
    for event in (add("a", 1, 1), remove("a", 2, 150), ev("paid")):
        apply_order_event(state, event)
        assert state == frozen
    rejected = apply_order_event(state, ev("shipped"))
    assert state == frozen and rejected["items"] is not state["items"]


def test_the_pipeline_folds_with_the_order_reducer_shipped_by_reference() -> None:
    from keyq.worker.pipeline_loading import load_pipeline

    # Spark ships the reducer by module and name, so its workers import keyq.orders.
    assert pickle.loads(pickle.dumps(apply_order_event)) is apply_order_event
    assert load_pipeline("keyq.demo.orders:pipeline") is pipeline
    calls: list[tuple[Any, Any]] = []
    state = SimpleNamespace(fold=lambda df, reducer: calls.append((df, reducer)) or "folded")
    assert pipeline("df", SimpleNamespace(state=state)) == "folded"  # type: ignore[arg-type]
    assert calls == [("df", apply_order_event)]


# --------------------------------------------------------------------------- properties

SKUS = st.sampled_from(["a", "b", "c"])
ITEM_EVENTS = st.builds(
    item,
    st.sampled_from(["item_added", "item_removed"]),
    SKUS,
    st.integers(1, 5),
    st.sampled_from([0, 1, 250, 999]),
)
STATUS_EVENTS = st.builds(ev, st.sampled_from(["created", "paid", "cancelled", "shipped"]))
EVENT_LISTS = st.lists(
    st.one_of(ITEM_EVENTS, ITEM_EVENTS, ITEM_EVENTS, STATUS_EVENTS, STATUS_EVENTS), max_size=40
)


def only_ints_and_strings(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and only_ints_and_strings(v) for k, v in value.items())
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


@given(EVENT_LISTS)
def test_invariants_hold_after_any_events(events: list[dict[str, Any]]) -> None:
    state = fold(events)
    if state is None:
        assert events == []
        return
    assert state["events_applied"] == len(events)
    assert 0 <= state["rejected"] <= len(events)
    assert state["status"] in ("new", "created", "paid", "cancelled", "shipped")
    assert state["item_count"] == sum(state["items"].values())
    assert all(qty > 0 for qty in state["items"].values())
    assert state["total_cents"] >= 0
    assert only_ints_and_strings(state)  # money in integer cents, no floats anywhere
    assert orjson.loads(orjson.dumps(state)) == state
    assert fold(events) == state  # deterministic
    if state["status"] == "new":
        assert state["items"] == {} and state["rejected"] == len(events)
    if state["status"] in ("paid", "shipped"):
        assert state["item_count"] > 0


@given(EVENT_LISTS, st.integers(0, 40))
def test_batch_boundaries_do_not_change_the_result(events: list[dict[str, Any]], cut: int) -> None:
    """The worker stores a state as JSON between batches and goes on from it."""
    first = fold(events[:cut])
    stored = None if first is None else orjson.loads(orjson.dumps(first))
    assert fold(events[cut:], stored) == fold(events)


# --------------------------------------------------------------------------- demo traffic


def test_generate_orders_is_deterministic_for_a_seed() -> None:
    first = generate_orders(40, 600, seed=11)
    assert first == generate_orders(40, 600, seed=11)
    assert first != generate_orders(40, 600, seed=12)
    assert len(first) == 600


@pytest.mark.parametrize(("orders", "events"), [(0, 0), (0, 10), (10, 9), (-1, 5)])
def test_generate_orders_refuses_impossible_sizes(orders: int, events: int) -> None:
    with pytest.raises(ValueError, match="orders"):
        generate_orders(orders, events, seed=1)


def test_the_demo_traffic_looks_like_real_orders() -> None:
    pairs = generate_orders(150, 3000, seed=2024)
    assert len(pairs) == 3000
    counts = Counter(order for order, _ in pairs)
    assert sorted(counts) == [f"order-{n:05d}" for n in range(1, 151)]
    assert max(counts.values()) >= 20 * median(counts.values())  # skewed: a few hot orders
    assert sum(sorted(counts.values())[-15:]) >= 3000 // 2  # the top 10% carry half
    first_seen: dict[str, dict[str, Any]] = {}
    for order, event in pairs:
        assert event["order"] == order
        assert event["type"] in EVENT_TYPES
        assert only_ints_and_strings(event)
        first_seen.setdefault(order, event)
    assert all(event["type"] == "created" for event in first_seen.values())
    # Interleaved: no order is published in one block.
    switches = sum(1 for a, b in pairwise(pairs) if a[0] != b[0])
    assert switches > 1500
    states = expected_states(pairs)
    assert all(states[o]["events_applied"] == n for o, n in counts.items())
    statuses = Counter(state["status"] for state in states.values())
    assert {"created", "paid", "shipped", "cancelled"} <= set(statuses)
    rejected = sum(state["rejected"] for state in states.values())
    assert 0.01 * len(pairs) <= rejected <= 0.06 * len(pairs)


@hypothesis_settings(max_examples=30, deadline=None)
@given(st.integers(1, 30), st.integers(0, 200), st.integers(0, 2**32))
def test_every_generated_stream_is_a_sensible_lifecycle(orders: int, extra: int, seed: int) -> None:
    pairs = generate_orders(orders, orders + extra, seed)
    assert len(pairs) == orders + extra
    states = expected_states(pairs)  # no event is poison
    assert sum(state["events_applied"] for state in states.values()) == len(pairs)
    for state in states.values():
        assert state["status"] != "new"
    seen: set[str] = set()
    for order, event in pairs:
        assert (event["type"] == "created") or order in seen
        seen.add(order)


def test_expected_states_is_the_fold_of_each_order_in_publish_order() -> None:
    other = "order-00002"
    a1, a2, a3 = ev("created"), add("x", 2, 5), ev("paid")
    b1, b2 = {"type": "created", "order": other}, {"type": "shipped", "order": other}
    pairs = [(ORDER, a1), (other, b1), (ORDER, a2), (other, b2), (ORDER, a3)]
    assert expected_states(pairs) == {
        ORDER: apply_order_event(apply_order_event(apply_order_event(None, a1), a2), a3),
        other: apply_order_event(apply_order_event(None, b1), b2),
    }
    assert expected_states(pairs)[ORDER] == state_of("paid", {"x": 2}, 10, 3)
    assert expected_states(pairs)[other] == state_of("created", {}, 0, 2, rejected=1)


def test_expected_states_skips_poison_as_the_worker_dead_letters_it() -> None:
    pairs = [
        ("order-00001", ev("created")),
        ("order-00001", {"type": "refunded", "order": ORDER}),
        ("order-00001", add("a", 1, 100)),
        ("order-00002", {"order": "order-00002"}),
    ]
    assert expected_states(pairs) == {"order-00001": state_of("created", {"a": 1}, 100, 2)}


# --------------------------------------------------------------------------- the worker's fold


def batch(rows: list[tuple[str, dict[str, Any]]]) -> pa.RecordBatch:
    """Rows as ``KeyedState.fold`` hands them to the fold: ``key, payload, producer, seq``
    and an ``_arrival`` number (here also grouped by key, in arrival order)."""
    ordered = sorted(enumerate(rows), key=lambda row: (row[1][0], row[0]))
    return pa.RecordBatch.from_pydict(
        {
            "key": [key for _, (key, _) in ordered],
            "payload": [orjson.dumps(event).decode() for _, (_, event) in ordered],
            "producer": ["p"] * len(rows),
            "seq": [n for n, _ in ordered],
            "_arrival": [n for n, _ in ordered],
        }
    )


def run_fold(rows: list[tuple[str, dict[str, Any]]], prior: dict[str, str]) -> dict[str, Any]:
    (out,) = make_folder(apply_order_event, prior)(iter([batch(rows)]))
    table = out.to_pydict()
    return {k: (orjson.loads(s), n) for k, s, n in zip(*table.values(), strict=True)}


def test_the_workers_fold_over_two_batches_equals_expected_states() -> None:
    pairs = generate_orders(12, 300, seed=5)
    first = run_fold(pairs[:170], {})
    committed = {key: orjson.dumps(state).decode() for key, (state, _) in first.items()}
    second = run_fold(pairs[170:], committed)
    final = {key: state for key, (state, _) in first.items()} | {
        key: state for key, (state, _) in second.items()
    }
    assert final == expected_states(pairs)
    for key, (state, applied) in second.items():
        before = first[key][0]["events_applied"] if key in first else 0
        assert state["events_applied"] == before + applied


def test_a_poison_event_fails_the_fold_with_a_reason() -> None:
    rows = [("order-00001", ev("created")), ("order-00001", {"type": "refund", "order": ORDER})]
    with pytest.raises(FoldFailed, match="ValueError: unknown order event type 'refund'"):
        run_fold(rows, {})


# --------------------------------------------------------------------------- real workers


def publish_slowly(stream: str, pairs: list[tuple[str, dict[str, Any]]]) -> str:
    """Publishes the pairs in chunks of 50, pausing between them, so the run lasts a while;
    closes its producer (gone, as workers see it) and returns its id."""
    with Producer(stream, mode="key") as producer:
        for index, (order, event) in enumerate(pairs, 1):
            producer.publish(order, event)
            if index % 50 == 0:
                producer.flush()
                time.sleep(0.15)
        return producer.producer_id


def applied_counts(store: StateStore, orders: list[str]) -> dict[str, int]:
    raws = store.states(orders)
    return {order: orjson.loads(raws[order])["events_applied"] for order in raws}


def wait_all_applied(
    stream: StreamFixture, expected: Mapping[str, OrderState], timeout: float
) -> None:
    store = StateStore(stream.redis, stream.name)
    orders = sorted(expected)

    def done() -> bool:
        counts = applied_counts(store, orders)
        return all(counts.get(o) == expected[o]["events_applied"] for o in orders)

    try:
        wait_until(done, timeout, "every order's events to be applied", every=0.5)
    except AssertionError:
        counts = applied_counts(store, orders)
        short = [o for o in orders if counts.get(o) != expected[o]["events_applied"]]
        raise AssertionError(
            f"{len(short)} orders short: {where_they_are(stream, short[:8], counts, expected)}"
        ) from None


def where_they_are(
    stream: StreamFixture,
    orders: list[str],
    counts: Mapping[str, int],
    expected: Mapping[str, OrderState],
) -> dict[str, str]:
    """For a failure message: per order, events applied, the exactly-once marks (highest
    seq seen per producer), messages still in its queue, who holds its lock and how many
    times it was taken, and when the registry last saw the queue active."""
    queues = {order: key_queue_name(stream.name, order) for order in orders}
    holders = FencedLocks(stream.redis, stream.name).holders(list(queues.values()))
    activity = QueueRegistry(stream.redis, stream.name).queues()
    store = StateStore(stream.redis, stream.name)
    connection = pika.BlockingConnection(pika.URLParameters(stream.settings.amqp_url))
    try:
        depths = {order: queue_depth(connection, queue) for order, queue in queues.items()}
    finally:
        connection.close()
    described = {}
    for order, queue in queues.items():
        lease = holders.get(queue)
        seen = activity.get(queue)
        marks = store.get_marks(order)
        described[order] = (
            f"applied {counts.get(order)}/{expected[order]['events_applied']}, "
            f"marks {marks.seqs} ({marks.applied} applied), "
            f"{depths[order]} ready in the queue, held by {lease.owner if lease else None}, "
            f"lock token {lease.token if lease else None}, "
            f"active {None if seen is None else round(time.time() - seen / 1000, 1)}s ago"
        )
    return described


def parquet_problems(folder: Path, expected: Mapping[str, OrderState]) -> list[str]:
    """What is wrong with the sink's output: a key twice in one batch file, a batch of a key
    seen twice or missing (each row's state is the previous row's plus ``applied`` events),
    or a latest row that is not the expected final state."""
    problems: list[str] = []
    by_key: dict[str, list[tuple[dict[str, Any], int, str]]] = {}
    for path in sorted(folder.glob("part-*.parquet")):  # the visible batch files only
        name, rows = path.name, pq.read_table(path).to_pylist()
        keys = Counter(row["key"] for row in rows)
        problems += [f"{name}: key {k} in {n} rows" for k, n in keys.items() if n > 1]
        for row in rows:
            by_key.setdefault(row["key"], []).append(
                (orjson.loads(row["state"]), row["applied"], name)
            )
    for order, want in expected.items():
        chain = sorted(by_key.get(order, []), key=lambda entry: entry[0]["events_applied"])
        if not chain:
            problems.append(f"{order}: no rows")
            continue
        previous = 0
        for state, applied, name in chain:
            if state["events_applied"] != previous + applied:
                problems.append(
                    f"{order}: {name} goes from {previous} to {state['events_applied']} "
                    f"events with {applied} applied (a batch duplicated or missing)"
                )
            previous = state["events_applied"]
        if chain[-1][0] != want:
            problems.append(f"{order}: latest row {chain[-1][0]} != expected {want}")
    problems += [f"{key}: rows of an order never published" for key in set(by_key) - set(expected)]
    return problems


@pytest.mark.slow
def test_orders_survive_a_killed_worker_and_keyq_state_prints_them(
    stream: StreamFixture, workers: Any, tmp_path: Path
) -> None:
    pairs = generate_orders(150, 3000, seed=20240611)
    expected = expected_states(pairs)
    out = tmp_path / "out"
    options = {"pipeline": "keyq.demo.orders:pipeline", "mode": "key", "sink": f"parquet:{out}"}
    store = StateStore(stream.redis, stream.name)
    orders = sorted(expected)

    first = workers(stream.name, **options)
    second = workers(stream.name, **options)
    first.wait_ready()
    second.wait_ready()
    pool = ThreadPoolExecutor(1)
    publishing = pool.submit(publish_slowly, stream.name, pairs)

    def progress() -> int:
        return sum(applied_counts(store, orders).values())

    wait_until(lambda: progress() >= len(pairs) // 5, 60, "a fifth of the events to be applied")
    owners = held_by(stream.redis, stream.name)
    victim = max((first, second), key=lambda w: len(owners.get(w.worker_id, [])))
    assert not publishing.done(), "processing lagged so far that the kill was not mid-run"
    victim.kill()  # kill -9 mid-run
    replacement = workers(stream.name, **options)

    producer_id = publishing.result(timeout=90)  # or raises what publishing raised
    pool.shutdown()
    wait_all_applied(stream, expected, timeout=90)
    wrong = {o: (store.get(o), want) for o, want in expected.items() if store.get(o) != want}
    assert wrong == {}, "(got, want) per order"

    # A batch committed by the victim but not yet renamed into place is finished by the next
    # worker to start, so the output is complete once the replacement is up.
    replacement.wait_ready()
    try:
        wait_until(lambda: not parquet_problems(out, expected), 20, "the Parquet output")
    except AssertionError:
        problems = parquet_problems(out, expected)
        raise AssertionError(
            f"{len(problems)} problems in the Parquet output: {problems[:10]}"
        ) from None
    survivor = second if victim is first else first
    assert survivor.process.poll() is None and replacement.process.poll() is None

    # ``keyq state`` prints what the workers committed: a state, its marks, or a clear miss.
    counts = Counter(order for order, _ in pairs)
    hottest = max(counts, key=lambda order: counts[order])
    shown = run_keyq(stream.settings, "state", "--stream", stream.name, "--key", hottest)
    assert shown.returncode == 0, shown.stderr
    assert orjson.loads(shown.stdout) == expected[hottest]
    other = min(counts, key=lambda order: counts[order])
    marked = run_keyq(stream.settings, "state", "--stream", stream.name, "--key", other, "--marks")
    assert marked.returncode == 0, marked.stderr
    assert orjson.loads(marked.stdout) == {
        "key": other,
        "state": expected[other],
        "marks": {"producers": {producer_id: counts[other]}, "applied": counts[other]},
    }
    missing = run_keyq(stream.settings, "state", "--stream", stream.name, "--key", "order-99999")
    assert (missing.returncode, missing.stdout) == (1, "")
    assert f"no state for key 'order-99999' in stream '{stream.name}'" in missing.stderr
