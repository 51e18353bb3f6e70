"""A batch's pure logic: how a run's deliveries are sorted, what a failure is taken for, how a
failing batch is split, and each ``BatchOutcome``; stand-ins record calls; no Spark."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import pytest
import redis.exceptions

from keyq.broker.envelope import HEADER_KEY, HEADER_PRODUCER, HEADER_SEQ
from keyq.broker.errors import CommitNotReplicated, PipelineError, SparkUnavailable
from keyq.broker.locks import Lease
from keyq.broker.settings import load_settings
from keyq.broker.stream_policy import StreamPolicy
from keyq.worker.amqp.dead_letters import DeadLetter
from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.batch.decoding import Event, Undecodable, decode, decoder_for
from keyq.worker.batch.failures import (
    EventFailed,
    Interrupted,
    describe_failure,
    pipeline_failure,
    spark_unavailable,
)
from keyq.worker.batch.isolation import Isolation, named_event
from keyq.worker.batch.marks import KeyMarks
from keyq.worker.batch.outcome import BatchOutcome
from keyq.worker.batch.plan import arrival_order, identify, plan_run
from keyq.worker.batch.processor import BatchProcessor
from keyq.worker.batch.stats import BatchStats
from keyq.worker.config import WorkerSettings
from keyq.worker.holding.held_index import Held, Holdings
from keyq.worker.spark.fold import event_token

NOT_JSON = b"{not json"


class NoDeclaredKeys:
    """Queues declared for no key: each event names its own."""

    def keys_of(self, queues: Collection[str]) -> dict[str, str | None]:
        return dict.fromkeys(queues)


def delivery(
    tag: int,
    key: str | None = "k",
    producer: str | None = "p",
    seq: int | None = None,
    *,
    queue: str = "q",
    body: bytes = b"{}",
) -> Delivery:
    headers: dict[str, Any] = {}
    if key is not None:
        headers[HEADER_KEY] = key
    if producer is not None and seq is not None:
        headers[HEADER_PRODUCER] = producer
        headers[HEADER_SEQ] = seq
    return Delivery(queue, 1, tag, False, headers, "application/json", f"m-{tag}", body)


def marks_at(seq: int, skipped: tuple[int, int] | None = None) -> KeyMarks:
    """Marks of one key with producer ``p`` applied up to ``seq``."""
    marks = KeyMarks()
    marks.advance("p", seq)
    if skipped is not None:
        marks.skip("p", *skipped)
    return marks


def plan(
    deliveries: Sequence[Delivery],
    marks: Mapping[str, KeyMarks] | None = None,
    *,
    dead: str | None = None,
    now: float = 1000.0,
    gap_timeout_s: float = 60.0,
) -> Any:
    return plan_run(
        deliveries,
        decoder_for({d.queue: None for d in deliveries}),
        marks or {},
        now=now,
        gap_timeout_s=gap_timeout_s,
        dead=dead,
    )


def tags(items: Sequence[Event | Undecodable | Delivery]) -> list[int]:
    return [(i if isinstance(i, Delivery) else i.delivery).delivery_tag for i in items]


def test_a_run_is_sorted_by_what_becomes_of_each_delivery() -> None:
    deliveries = [
        delivery(1, seq=3),  # waits for seq 2
        delivery(2, key=None),  # no key: dead-lettered, nothing to mark
        delivery(3, seq=1),  # applied already: skipped
        delivery(4, key="k2", seq=1),
        delivery(5, key="k2", seq=2, body=NOT_JSON),  # in order, but undecodable
        delivery(6, key="k3", producer=None),  # no identity: applied as it comes
    ]
    run = plan(deliveries, {"k": marks_at(1)})
    assert run.keys == ["k", "k2", "k3"]
    assert tags(run.events) == [4, 6]
    assert tags(run.letters) == [2, 5]
    assert run.letters[0].reason == f"missing header {HEADER_KEY}"
    assert run.letters[1].reason.startswith("undecodable payload: not JSON")
    assert tags(run.deferred) == [1]
    assert tags(run.settling) == [2, 3, 4, 5, 6]
    assert len(run.plan.duplicates) == 1
    assert run.plan.marks["k2"].mark_of("p") == 2  # the dead one moves the mark too
    assert [(g.key, g.first, g.last) for g in run.plan.open_gaps] == [("k", 2, 2)]


def test_a_gap_given_up_then_a_late_event_of_it_dead_lettered_in_delivery_order() -> None:
    deliveries = [
        delivery(1, seq=5),  # waits for 4, which comes next
        delivery(2, seq=3),  # inside the given-up gap 2..3: late
        delivery(3, key=None),
        delivery(4, seq=4),
    ]
    run = plan(deliveries, {"k": marks_at(1, skipped=(2, 3))})
    assert [event.seq for event in run.events] == [4, 5]
    assert tags(run.letters) == [2, 3]  # as delivered, though the late one is found last
    late = run.letters[0]
    assert late.reason == (
        "late: seq 3 of producer p arrived after the worker gave up waiting for it "
        "(its successors were applied)"
    )
    assert (late.key, late.producer, late.seq) == ("k", "p", 3)
    assert run.deferred == []
    assert tags(run.settling) == [1, 2, 3, 4]
    assert run.plan.late == [1]
    # How a gap comes to be given up: waited out, and what waited for it applied.
    waited = delivery(1, seq=3)
    waited.deferred_since = 900.0
    run = plan([waited], {"k": marks_at(1)}, now=1000.0, gap_timeout_s=60.0)
    assert [event.seq for event in run.events] == [3]
    assert [(g.first, g.last) for g in run.plan.skipped_gaps] == [(2, 2)]
    assert run.deferred == []


def test_a_run_with_a_reason_dead_letters_every_event_and_still_moves_the_marks() -> None:
    deliveries = [delivery(1, seq=2), delivery(2, seq=3), delivery(3, seq=1)]
    run = plan(deliveries, {"k": marks_at(1)}, dead="pipeline failed: boom")
    assert run.events == []
    assert tags(run.letters) == [1, 2]
    assert {letter.reason for letter in run.letters} == {"pipeline failed: boom"}
    assert len(run.plan.duplicates) == 1
    assert run.plan.marks["k"].mark_of("p") == 3
    assert run.plan.marks["k"].applied == 0  # dead-lettered: not counted as applied


def test_arrival_order_and_identities_leave_out_what_has_no_key() -> None:
    deliveries = [delivery(1, seq=1), delivery(2, key=None), delivery(3, producer=None)]
    decoded = [decode(d) for d in deliveries]
    events = [item for item in decoded if isinstance(item, Event)]
    letters = [item for item in decoded if isinstance(item, Undecodable)]
    ordered = arrival_order(deliveries, [*letters, *events])
    assert tags(ordered) == [1, 2, 3]
    identities, keyed = identify(ordered)
    assert tags(keyed) == [1, 3]
    assert [(i.key, i.producer, i.seq, i.counts) for i in identities] == [
        ("k", "p", 1, True),
        ("k", None, None, True),
    ]


def test_an_attempt_decodes_each_delivery_once_with_its_queues_declared_key() -> None:
    keyless = delivery(1, key=None, queue="orders.a")  # a key-mode queue: the key is declared
    other = delivery(2, key=None, queue="elsewhere")
    decoded = decoder_for({"orders.a": "a"})
    first = decoded(keyless)
    assert isinstance(first, Event)
    assert first.key == "a"
    assert decoded(keyless) is first  # the gate and the plan read the same item
    assert isinstance(decoded(other), Undecodable)  # no declared key, no header: dead-lettered
    assert decoder_for({"orders.a": "a"})(keyless) is not first  # another attempt decodes anew


def test_a_pipeline_failure_is_told_apart_from_spark_being_gone() -> None:
    boom = RuntimeError(
        f"FoldFailed: fold of key 'k' failed: ValueError: boom{event_token('k', 'p', 7)}"
    )
    named = pipeline_failure(boom)
    assert isinstance(named, EventFailed)
    assert named.event == ("k", "p", 7)
    assert str(named) == "fold of key 'k' failed: ValueError: boom"

    gone = pipeline_failure(
        RuntimeError("py4j.protocol.Py4JNetworkError: Answer from Java side is empty")
    )
    assert type(gone) is SparkUnavailable
    assert str(gone).startswith("Spark is unavailable: ")

    missing = pipeline_failure(RuntimeError("ModuleNotFoundError: No module named 'orders'"))
    assert type(missing) is SparkUnavailable
    assert str(missing).startswith("Spark cannot import the pipeline's code: ")

    # keyq's own errors raised by a pipeline are the pipeline's failure, whatever they are
    ours = pipeline_failure(SparkUnavailable("raised by the pipeline"))
    assert type(ours) is PipelineError
    assert str(ours) == "raised by the pipeline"

    plain = pipeline_failure(ValueError("bad"))
    assert type(plain) is PipelineError
    assert str(plain) == describe_failure(ValueError("bad"))

    class Py4JNetworkError(Exception):
        pass

    # Spark being gone is read from the exception's name too.
    assert spark_unavailable(Py4JNetworkError("lost"))
    assert spark_unavailable(RuntimeError("SparkContext was shut down"))
    assert not spark_unavailable(ValueError("Connection to the database: fine"))


class Recorder:
    """An attempt that fails while the poison delivery is in its run, unless dead-lettering."""

    def __init__(self, poison: Delivery, failure: PipelineError) -> None:
        self.poison = poison
        self.failure = failure
        self.runs: list[tuple[list[int], int, str | None]] = []
        self.applied: list[int] = []  # by runs that succeeded, without a reason to dead-letter

    def __call__(self, deliveries: list[Delivery], attempt: int, dead: str | None = None) -> None:
        self.runs.append((tags(deliveries), attempt, dead))
        if dead is None and self.poison in deliveries:
            raise self.failure
        if dead is None:
            self.applied += tags(deliveries)


def isolation(
    recorder: Recorder, stopping: threading.Event | None = None, backoff_ms: int = 0
) -> Isolation:
    return Isolation(
        attempt=recorder,
        max_attempts=2,
        retry_backoff_ms=backoff_ms,
        stats=BatchStats(),
        stopping=stopping or threading.Event(),
        keys=NoDeclaredKeys(),
    )


def across_queues() -> list[Delivery]:
    return [
        delivery(1, seq=1, queue="a"),
        delivery(2, key="b", seq=1, queue="b"),
        delivery(3, seq=2, queue="a"),
        delivery(4, seq=3, queue="a"),
        delivery(5, key="b", seq=2, queue="b"),
    ]


def test_a_failure_naming_its_event_isolates_it_and_runs_the_other_queues_together() -> None:
    deliveries = across_queues()
    poison = deliveries[2]
    recorder = Recorder(poison, EventFailed("fold failed: boom", ("k", "p", 2)))
    isolation(recorder).process(deliveries)
    assert recorder.runs == [
        ([1, 2, 3, 4, 5], 1, None),
        ([1, 2, 3, 4, 5], 2, None),
        ([1], 1, None),  # before the named event, in its queue
        ([3], 2, None),  # the named event, retried
        ([3], 2, "pipeline failed: fold failed: boom"),  # then dead-lettered
        ([4], 1, None),  # after it
        ([2, 5], 1, None),  # every other queue: one job
    ]
    assert sorted(recorder.applied) == [1, 2, 4, 5]  # each once


def test_a_failure_naming_no_event_is_found_by_halves() -> None:
    deliveries = [delivery(tag, seq=tag) for tag in range(1, 6)]
    recorder = Recorder(deliveries[3], PipelineError("boom"))
    isolation(recorder).process(deliveries)
    dead = [(run, reason) for run, _, reason in recorder.runs if reason is not None]
    assert dead == [([4], "pipeline failed: PipelineError: boom")]
    assert sorted(recorder.applied) == [1, 2, 3, 5]  # each once


def test_shutdown_during_a_backoff_interrupts_the_batch() -> None:
    stopping = threading.Event()
    stopping.set()
    recorder = Recorder(delivery(1, seq=1), PipelineError("boom"))
    with pytest.raises(Interrupted):
        isolation(recorder, stopping, backoff_ms=1000).process([recorder.poison])
    assert len(recorder.runs) == 1


def test_named_event_uses_the_queues_declared_key() -> None:
    group = [delivery(1, key=None, producer="p", seq=4, queue="q-x")]
    assert named_event(("x", "p", 4), group, {"q-x": "x"}) == 0
    assert named_event(("x", "p", 5), group, {"q-x": "x"}) is None


Journal = list[tuple[str, Any]]  # what the stand-ins were asked to do, in order


class StoreStandIn:
    def __init__(
        self, journal: Journal, marks: Mapping[str, KeyMarks], lost: frozenset[str]
    ) -> None:
        self.journal = journal
        self._marks = marks
        self.lost = lost
        self.failure: Exception | None = None
        self.client: Any = None  # no event here carries a dedupe id: Redis is never asked

    def marks(self, keys: Collection[str]) -> dict[str, KeyMarks]:
        if self.failure is not None:
            raise self.failure
        return {key: self._marks[key] for key in keys if key in self._marks}

    def commit(
        self, leases: Sequence[Lease], marks: Any, states: Any, record: Any, **_fenced: Any
    ) -> frozenset[str]:
        self.journal.append(("commit", sorted(lease.queue for lease in leases)))
        return self.lost

    def pending_sink_records(self) -> dict[str, str]:
        return {}


class LinkStandIn:
    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def dead_letter(self, letters: Sequence[DeadLetter]) -> list[Any]:
        self.journal.append(("dead_letter", tags([letter.delivery for letter in letters])))
        return []

    def set_aside(self, queue: str, key: str, deliveries: Sequence[Delivery]) -> None:
        self.journal.append(("set_aside", tags(deliveries)))

    def ack(self, acks: Sequence[tuple[str, int, Sequence[tuple[int, int]]]]) -> int:
        self.journal.append(("ack", [(q, e, list(t)) for q, e, t in acks]))
        return len(acks)


class RegistryStandIn:
    def touch(self, queues: Any) -> None: ...


class NoSpark:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError("no event of these tests reaches Spark")


class NoKeyHeldBack:
    """Key control where every key flows (what holds keys back is tested on Redis)."""

    def statuses(self, keys: Collection[str]) -> dict[str, Any]:
        return {}


LEASES = {queue: Lease(queue=queue, owner="w", token=7) for queue in ("a", "b")}


def processor(
    *,
    marks: Mapping[str, KeyMarks] | None = None,
    lost: frozenset[str] = frozenset(),
    held: Collection[str] = ("a", "b"),
) -> tuple[BatchProcessor, Journal, StoreStandIn]:
    journal: Journal = []
    store = StoreStandIn(journal, marks or {}, lost)
    holdings = Holdings()
    for queue in held:
        holdings.add(Held(queue=queue, lease=LEASES[queue], epoch=1))
    made = BatchProcessor(
        settings=load_settings(WorkerSettings),
        stream="s",
        worker_id="w",
        engine=NoSpark(),  # type: ignore[arg-type]
        pipeline=NoSpark(),  # type: ignore[arg-type]
        store=store,  # type: ignore[arg-type]
        registry=RegistryStandIn(),  # type: ignore[arg-type]
        sink=None,
        acker=LinkStandIn(journal),
        dead_letters=LinkStandIn(journal),
        keys=NoDeclaredKeys(),
        holdings=holdings,
        stopping=threading.Event(),
        control=NoKeyHeldBack(),  # type: ignore[arg-type]
        policy=StreamPolicy,
    )
    return made, journal, store


def test_a_settled_batch_hands_back_only_what_waits() -> None:
    waits = delivery(1, seq=3, queue="a")
    batch = [waits, delivery(2, seq=1, queue="a"), delivery(3, key=None, queue="b")]
    made, journal, _ = processor(marks={"k": marks_at(1)})
    outcome = made.process(batch)
    assert outcome == BatchOutcome(unsettled=[], deferred=[waits], lost=[])
    assert journal == [
        ("dead_letter", [3]),  # before the commit
        ("commit", ["a", "b"]),
        ("ack", [("a", 1, [(2, 0)]), ("b", 1, [(3, 0)])]),  # (tag, part): one event each
    ]
    assert (made.stats.batches, made.stats.skipped, made.stats.dead_lettered) == (1, 1, 1)
    gap, queue = made.open_gaps[("k", "p")]
    assert (gap.first, gap.last, queue) == (2, 2, "a")


def test_a_packs_events_settle_one_by_one_and_a_malformed_pack_is_dead_lettered_whole() -> None:
    """Tag 5 is a pack of three events: two already applied (settled), the third waits for
    seq 3; tag 6 is a pack that could not be read: dead-lettered as it is, then settled."""
    pack = [
        dataclasses.replace(delivery(5, seq=seq, queue="a"), part=part, parts=3)
        for part, seq in enumerate((1, 2, 4))
    ]
    malformed = dataclasses.replace(
        delivery(6, key=None, queue="a", body=b"KQP1\x00"), malformed="it ends too soon"
    )
    made, journal, _ = processor(marks={"k": marks_at(2)})
    outcome = made.process([*pack, malformed])
    assert outcome == BatchOutcome(unsettled=[], deferred=[pack[2]], lost=[])
    assert journal == [
        ("dead_letter", [6]),
        ("commit", ["a"]),
        ("ack", [("a", 1, [(5, 0), (5, 1), (6, 0)])]),  # (5, 2) waits: tag 5 stays unacked
    ]
    letter = decode(malformed)
    assert isinstance(letter, Undecodable)
    assert letter.reason == "malformed pack: it ends too soon"


def test_a_refused_commit_stops_the_lost_queues_and_hands_back_the_rest() -> None:
    batch = [
        delivery(1, body=NOT_JSON, queue="a"),
        delivery(2, key="b", body=NOT_JSON, queue="b"),
        delivery(3, seq=9, queue="b"),  # would wait: handed back with the rest instead
    ]
    made, journal, _ = processor(lost=frozenset({"a"}))
    outcome = made.process(batch)
    assert outcome == BatchOutcome(unsettled=batch[1:], deferred=[], lost=[LEASES["a"]])
    assert [name for name, _ in journal] == ["dead_letter", "commit"]  # never acked
    assert made.stats.commits_refused == 1


def test_a_batch_that_settles_nothing_commits_nothing() -> None:
    waits = delivery(1, seq=3, queue="a")
    made, journal, _ = processor(marks={"k": marks_at(1)})
    assert made.process([waits]) == BatchOutcome(unsettled=[], deferred=[waits], lost=[])
    assert (journal, made.stats.batches) == ([], 0), "a batch that all waits"
    # With queue b no longer held, the batch is handed back whole, uncommitted.
    batch = [delivery(1, queue="a"), delivery(2, key="b", queue="b")]
    made, journal, _ = processor(held=("a",))
    assert made.process(batch) == BatchOutcome(unsettled=batch, deferred=[], lost=[])
    assert journal == []


@pytest.mark.parametrize(
    "failure",
    [
        redis.exceptions.ConnectionError("Redis went away"),
        CommitNotReplicated("a commit reached 0 of the 1 Redis replicas required"),
        OSError("network is unreachable"),
    ],
)
def test_a_service_failing_mid_batch_interrupts_it(
    failure: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    batch = [delivery(1, seq=3, queue="a"), delivery(2, seq=1, queue="a")]
    made, journal, store = processor(marks={"k": marks_at(1)})
    store.failure = failure
    caplog.set_level(logging.WARNING, logger="keyq.worker")
    outcome = made.process(batch)
    assert outcome == BatchOutcome(unsettled=batch, deferred=[], lost=[], interrupted=str(failure))
    assert journal == []
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("keyq.worker", f"batch interrupted, will retry: {failure}")
    ]


def test_unsettled_is_what_the_last_batch_did_not_settle() -> None:
    batch = [delivery(1, seq=3, queue="a"), delivery(2, seq=1, queue="a")]  # no letters
    made, _, _ = processor(marks={"k": marks_at(1)})
    made.process(batch)
    assert made.unsettled(batch) == batch[:1]
    assert made.unsettled(batch, exclude=frozenset({"a"})) == []
