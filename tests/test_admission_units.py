"""Admission gives each delivery exactly one disposition, from what was read and nothing
else; the effects then run in one order. Pure units: no broker, no Redis, no Spark (what
the effects do to the services is tested against them elsewhere)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from keyq.broker.envelope import (
    CONTENT_JSON,
    HEADER_DEDUPE_ID,
    HEADER_KEY,
    HEADER_PRODUCER,
    HEADER_SEQ,
)
from keyq.broker.key_control import KeyStatus, ParkedKey
from keyq.broker.locks import Lease
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.stream_policy import StreamPolicy
from keyq.worker.amqp.dead_letters import DeadLetter
from keyq.worker.amqp.deliveries import Delivery
from keyq.worker.batch.admission import Admission, Disposition, Reads, admit
from keyq.worker.batch.decoding import decoder_for
from keyq.worker.batch.dedupe_ids import AppliedIds
from keyq.worker.batch.effects import BatchEffects
from keyq.worker.batch.marks import KeyMarks
from keyq.worker.batch.outcome import BatchProgress
from keyq.worker.batch.rate_limits import KeyRateLimiter
from keyq.worker.batch.spans import BatchSpans
from keyq.worker.batch.stats import StageClock

QUEUE = "keyq.s.b.00000"
ASIDE = "keyq.s.a.0123.tok"
KEYS = StreamKeys("s")
_tags = itertools.count(1)
D = Disposition


def event(
    key: str | None, seq: int, *, queue: str = QUEUE, body: bytes = b"{}", dedupe: str = ""
) -> Delivery:
    headers: dict[str, Any] = {HEADER_PRODUCER: "p", HEADER_SEQ: seq}
    if key is not None:
        headers[HEADER_KEY] = key
    if dedupe:
        headers[HEADER_DEDUPE_ID] = dedupe
    return Delivery(queue, 1, next(_tags), False, headers, CONTENT_JSON, None, body)


def applied_to(seq: int) -> KeyMarks:
    marks = KeyMarks()
    marks.advance("p", seq)
    return marks


def admitted(
    deliveries: Sequence[Delivery],
    *,
    policy: StreamPolicy | None = None,
    statuses: dict[str, KeyStatus] | None = None,
    marks: dict[str, KeyMarks] | None = None,
    dedupe: AppliedIds | None = None,
    limiter: KeyRateLimiter | None = None,
    dead: str | None = None,
) -> Admission:
    reads = Reads(
        policy=policy or StreamPolicy(),
        statuses=statuses or {},
        marks=marks or {},
        dedupe=dedupe or AppliedIds(),
        now_ms=5,
        now_s=1000.0,
    )
    return admit(
        deliveries,
        decoder_for({}),
        reads,
        keys=KEYS,
        is_aside_queue=lambda queue: queue == ASIDE,
        limiter=limiter,
        gap_timeout_s=60.0,
        dead=dead,
    )


def test_each_delivery_gets_exactly_one_disposition_of_the_seven() -> None:
    applied, again, poison = event("a", 2), event("a", 1), event("a", 3, body=b"\xff")
    deferred = event("a", 9)  # 4..8 are missing
    paused = event("b", 1)
    not_head = event("c", 1, queue=ASIDE)  # c's head aside queue is another one
    over_rate = [event("d", seq) for seq in range(1, 7)]
    batch = [applied, again, poison, deferred, paused, not_head, *over_rate]
    limiter = KeyRateLimiter(4.0, clock=lambda: 0.0)  # a second's tokens: four events a key
    admission = admitted(
        batch,
        statuses={
            "b": KeyStatus(paused_since_ms=1),
            "c": KeyStatus(aside=("keyq.s.a.0123.first", ASIDE)),
        },
        marks={"a": applied_to(1)},
        limiter=limiter,
    )
    seven = [D.APPLY, D.DUPLICATE, D.DEAD_LETTER, D.DEFER, D.SET_ASIDE, D.HAND_BACK]
    assert admission.dispositions == [*seven, *[D.APPLY] * 4, D.RATE_LIMITED, D.RATE_LIMITED]
    assert admission.settling == [applied, again, poison, paused, *over_rate[:4]]
    assert [e.delivery for e in admission.events] == [applied, *over_rate[:4]]
    assert admission.aside == {"b": [paused]}
    assert admission.retry_later_in > 0
    assert admission.parking == {}  # under ``skip``, a poison event parks nothing


def test_a_repeated_dedupe_id_is_a_duplicate_and_a_new_one_is_remembered() -> None:
    seen, fresh, repeat = (
        event("a", 1, dedupe="x"),
        event("a", 2, dedupe="y"),
        event("a", 3, dedupe="y"),
    )
    admission = admitted([seen, fresh, repeat], dedupe=AppliedIds(7, 60, {"a": frozenset({"x"})}))
    assert admission.dispositions == [D.DUPLICATE, D.APPLY, D.DUPLICATE]
    [(target, ids)] = admission.deduped.writes.items()
    assert ids == {"y": "p:2"} and ":dedupe:7:" in target
    # The marks still move past all three: a redelivery of any is a duplicate by seq too.
    assert admission.run.plan.marks["a"].mark_of("p") == 3


def test_under_park_a_poison_parks_its_key_and_what_follows_it_is_set_aside() -> None:
    first, poison, after = event("a", 1), event("a", 2, body=b"\xff"), event("a", 3)
    admission = admitted([first, poison, after], policy=StreamPolicy(poison_policy="park"))
    assert admission.dispositions == [D.APPLY, D.DEAD_LETTER, D.SET_ASIDE]
    assert admission.parking["a"].seq == 2


def test_a_dead_run_dead_letters_what_would_apply_and_parks_under_park() -> None:
    one, two = event("a", 1), event("a", 2)
    skip = admitted([one, two], dead="kept failing")
    assert skip.dispositions == [D.DEAD_LETTER, D.DEAD_LETTER] and skip.parking == {}
    park = admitted([one, two], policy=StreamPolicy(poison_policy="park"), dead="kept failing")
    assert park.parking["a"] == ParkedKey(at_ms=5, reason="kept failing", producer="p", seq=1)


def test_an_event_without_a_key_is_dead_lettered() -> None:
    assert admitted([event(None, 1)]).dispositions == [D.DEAD_LETTER]


def test_the_outcome_follows_from_the_last_dispositions() -> None:
    waits, limited, aside_held = event("a", 5), event("d", 1), event("c", 1, queue=ASIDE)
    admission = admitted(
        [waits, limited, aside_held],
        statuses={"c": KeyStatus(paused_since_ms=1, aside=(ASIDE,))},
        limiter=KeyRateLimiter(1.0, clock=lambda: 0.0),
        marks={"d": applied_to(0)},
    )
    progress = BatchProgress()
    progress.admitted(admission)
    outcome = progress.outcome()
    assert outcome.deferred == [waits]
    assert outcome.handed_back == frozenset({ASIDE})
    assert outcome.later == []  # its key's first event in a second goes through
    assert admission.dispositions[1] is D.APPLY


class Recorder:
    """Every part the effects call, noting the calls in one list."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.client: Any = None

    def run(self, *args: Any) -> tuple[dict[str, str], None]:
        self.calls.append("compute")
        return {}, None

    def stage(self, batch_id: str, output: Any) -> None:
        return None

    def park(self, key: str, where: ParkedKey) -> bool:
        self.calls.append(f"park {key}")
        return True

    def set_aside_tail(self, key: str, lease: Lease, new_queue: str) -> list[str]:
        return [new_queue]

    def set_aside(self, queue: str, key: str, deliveries: Sequence[Delivery]) -> None:
        self.calls.append(f"set aside {key}")

    def dead_letter(self, letters: Sequence[DeadLetter]) -> list[Any]:
        self.calls.append("dead letters")
        return []

    def commit(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("commit")

    def ack(self, acks: Any) -> int:
        self.calls.append("ack")
        return len(acks)


def test_the_effects_run_compute_park_set_aside_dead_letters_commit_then_ack() -> None:
    first, poison, after = event("a", 1), event("a", 2, body=b"\xff"), event("b", 1)
    admission = admitted(
        [first, poison, after],
        policy=StreamPolicy(poison_policy="park"),
        statuses={"b": KeyStatus(paused_since_ms=1)},
    )
    parts = Recorder()
    effects = BatchEffects("s", *[parts] * 6, BatchSpans("s"))  # type: ignore[arg-type]
    progress = BatchProgress()
    effects.run(
        "w-1",
        admission=admission,
        leases={QUEUE: Lease(queue=QUEUE, owner="w", token=1)},
        attempt=1,
        progress=progress,
        clock=StageClock(),
    )
    assert parts.calls == ["compute", "park a", "set aside b", "dead letters", "commit", "ack"]
    assert progress.unsettled([first, poison, after]) == []
