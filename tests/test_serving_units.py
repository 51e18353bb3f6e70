"""The serving session as a unit: a batch's outcome goes to the held queues in one call, the
waits after a batch, hand-backs and callbacks; the processor and held queues are stand-ins."""

from __future__ import annotations

import queue as queue_module
import threading
import time
from typing import Any, cast

import pytest

from keyq.broker.locks import Lease
from keyq.broker.naming import Mode
from keyq.broker.settings import load_settings
from keyq.broker.streams import StreamConfig
from keyq.worker.amqp.deliveries import Delivery, DeliveryBuffer
from keyq.worker.amqp.link import ConsumerLink
from keyq.worker.amqp.starvation import StarvedQueues
from keyq.worker.auto_mode import OwnEventCost
from keyq.worker.batch.outcome import BatchOutcome
from keyq.worker.batch.processor import BatchProcessor
from keyq.worker.config import WorkerSettings
from keyq.worker.holding.abandoned_gaps import AbandonedGaps
from keyq.worker.holding.aside_drains import AsideDrains
from keyq.worker.holding.claims import ClaimLoop
from keyq.worker.holding.handbacks import HandBacks
from keyq.worker.holding.held_queues import HeldQueues
from keyq.worker.holding.stuck_gaps import StuckGaps
from keyq.worker.serving import BATCH_WAIT_MAX_S, Session, batch_wait
from tests.helpers import plain_delivery


class StandInProcessor:
    def __init__(self, outcome: BatchOutcome) -> None:
        self.outcome = outcome

    def process(self, batch: list[Delivery]) -> BatchOutcome:
        return self.outcome


class StandInHeld:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def apply(self, outcome: BatchOutcome) -> None:
        self.calls.append(("apply", outcome))

    def hand_back(self, requests: dict[str, str], *, busy: Any) -> list[str]:
        self.calls.append(("hand_back", dict(requests)))
        return [queue for queue in requests if not busy(queue)]

    def room_of(self, _queue: str) -> int | None:
        return None  # nothing held: no prefetch to fit


class StandInDrains:
    def draining(self) -> set[str]:
        return set()


def session(
    outcome: BatchOutcome | None = None, held: StandInHeld | None = None, **callbacks: Any
) -> tuple[Session, StandInHeld, DeliveryBuffer, HandBacks, threading.Event]:
    settings = load_settings(WorkerSettings, prefetch=10)
    buffer = DeliveryBuffer()
    held = held or StandInHeld()
    handbacks = HandBacks(buffer)
    stop = threading.Event()
    events: queue_module.SimpleQueue[tuple[str, list[str], str]] = queue_module.SimpleQueue()
    made = Session(
        settings=settings,
        buffer=buffer,
        link=cast(ConsumerLink, None),
        held=cast(HeldQueues, held),
        handbacks=handbacks,
        claims=cast(ClaimLoop, None),
        processor=cast(BatchProcessor, StandInProcessor(outcome or BatchOutcome([], [], []))),
        stuck=cast(StuckGaps, None),
        abandoned=cast(AbandonedGaps, None),
        events=events,
        stop=stop,
        drains=cast(AsideDrains, StandInDrains()),
        starved=cast(StarvedQueues, None),
        **callbacks,
    )
    return made, held, buffer, handbacks, stop


@pytest.mark.parametrize("interrupted", [None, "x"], ids=["settled", "interrupted"])
def test_a_batch_outcome_goes_to_the_held_queues_in_one_call_and_only_an_interrupted_one_waits(
    interrupted: str | None,
) -> None:
    lost = [Lease(queue="q-b", owner="me", token=3)] if interrupted is None else []
    outcome = BatchOutcome(
        unsettled=[plain_delivery("q-a", 1)],
        deferred=[plain_delivery("q-c", 2)] if interrupted is None else [],
        lost=lost,
        interrupted=interrupted,
    )
    made, held, _buffer, _handbacks, stop = session(outcome)
    waits: list[float | None] = []

    def recording_wait(timeout: float | None = None) -> bool:
        waits.append(timeout)
        return stop.wait(0)

    made.stop = cast(threading.Event, type("E", (), {"wait": staticmethod(recording_wait)})())
    made.process([plain_delivery("q-a", 1), plain_delivery("q-c", 2)])
    assert held.calls == [("apply", outcome)]
    if interrupted is None:
        assert waits == [], "a batch that was not interrupted does not wait"
    else:
        assert waits and waits[0] is not None and waits[0] > 0, "an interrupted batch backs off"


def test_hand_backs_skip_busy_idle_queues_and_cool_down_what_went() -> None:
    made, held, buffer, handbacks, _stop = session()
    buffer.add(plain_delivery("q-busy", 1))
    made.hand_back({"q-idle": "idle", "q-busy": "idle"})
    assert held.calls == [("hand_back", {"q-idle": "idle", "q-busy": "idle"})]

    assert handbacks.cooling("q-idle", time.monotonic())
    assert not handbacks.cooling("q-busy", time.monotonic())


def test_callbacks_run_on_the_batch_thread_and_a_failing_one_does_not_stop_the_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[tuple[str, list[str]]] = []

    def assigned(queues: list[str]) -> None:
        seen.append(("assigned", queues))
        raise RuntimeError("user code failed")

    made, _held, _buffer, _handbacks, _stop = session(
        on_assigned=assigned, on_revoked=lambda queues: seen.append(("revoked", queues))
    )
    made.events.put(("assigned", ["q-a"], "claimed"))
    made.events.put(("revoked", ["q-a"], "released"))
    made.fire_events()
    assert seen == [("assigned", ["q-a"]), ("revoked", ["q-a"])]
    assert "assigned callback failed" in caplog.text


def test_batches_start_at_once_when_lightly_loaded_and_wait_to_fill_under_load() -> None:
    settings = load_settings(WorkerSettings, batch_max_events=100, batch_max_ms=0)
    assert batch_wait(settings, 10, 1.0) == 0.0
    assert batch_wait(settings, 60, 0.3) == pytest.approx(0.6)
    assert batch_wait(settings, 60, 5.0) == 2.0
    settings = load_settings(WorkerSettings, batch_max_events=5000)
    assert batch_wait(settings, 150, 0.2) == 0.0
    assert batch_wait(settings, 3000, 0.3) == pytest.approx(0.6)
    assert batch_wait(settings, 5000, 5.0) == BATCH_WAIT_MAX_S
    lingering = load_settings(WorkerSettings, batch_max_events=5000, batch_max_ms=250)
    assert batch_wait(lingering, 150, 0.2) == pytest.approx(0.25), "KEYQ_BATCH_MAX_MS lingers"
    assert batch_wait(lingering, 4000, 0.05) == pytest.approx(0.25)


@pytest.mark.parametrize("mode", ["auto", "bucket"])
def test_an_auto_mode_bucket_is_never_widened_its_promoted_keys_own_queues_are(mode: str) -> None:
    config = StreamConfig(stream="widen", mode=Mode(mode), buckets=4)
    made, _held, _buffer, _handbacks, _stop = session(
        own_cost=OwnEventCost(config) if mode == "auto" else None
    )
    bucket = config.queue_for("k")
    own = config.own_queue_for("hot") if mode == "auto" else config.queue_for("other")
    base = made.settings.amqp_prefetch(made.settings.prefetch)
    rooms = {bucket: base, own: base}
    full = [plain_delivery(queue, tag) for queue in (bucket, own) for tag in range(1, base + 1)]
    made.prefetch.observe(full, rooms.get, lambda _queue: 0)
    wanted = made.prefetch.due(rooms.get, lambda _queue: 0, now=100.0)
    widened = made.settings.batch_max_events  # single events: a message each
    assert wanted[own] == widened, wanted
    assert (wanted.get(bucket) == widened) is (mode == "bucket"), wanted
