"""``Backoff``: capped exponential delays with equal jitter, reproducible under a seeded
generator."""

from __future__ import annotations

import math
import random

import pytest

from keyq.broker.backoff import Backoff


def _delays(backoff: Backoff, count: int) -> list[float]:
    return [backoff.next() for _ in range(count)]


def test_each_delay_lies_between_half_its_step_and_its_step() -> None:
    backoff = Backoff(0.5, 5.0, rng=random.Random(1))
    for step in [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]:
        assert backoff.nominal == step
        delay = backoff.next()
        assert step / 2 <= delay <= step, (step, delay)


def test_the_steps_grow_by_the_factor_up_to_the_maximum() -> None:
    backoff = Backoff(1.0, 30.0, factor=3.0, rng=random.Random(2))
    steps = []
    for _ in range(6):
        steps.append(backoff.nominal)
        backoff.next()
    assert steps == [1.0, 3.0, 9.0, 27.0, 30.0, 30.0]


def test_delays_grow_on_average() -> None:
    backoff = Backoff(0.1, 1000.0, rng=random.Random(3))
    delays = _delays(backoff, 12)
    # Each step doubles and a delay is within [step/2, step]: every other one is larger.
    assert all(later > earlier for earlier, later in zip(delays, delays[2:], strict=False))


@pytest.mark.parametrize("seed", range(20))
def test_jitter_never_exceeds_the_maximum(seed: int) -> None:
    backoff = Backoff(0.3, 7.0, factor=1.7, rng=random.Random(seed))
    delays = _delays(backoff, 200)
    assert max(delays) <= 7.0
    assert min(delays) >= 0.15
    assert all(math.isfinite(delay) for delay in delays)


def test_the_maximum_is_reached_but_not_passed_when_every_draw_is_the_largest() -> None:
    class Largest(random.Random):
        def random(self) -> float:
            return 1.0 - 2**-53

        def uniform(self, a: float, b: float) -> float:
            return b

    delays = _delays(Backoff(1.0, 10.0, rng=Largest()), 8)
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0, 10.0]


def test_reset_starts_again_from_the_initial_delay() -> None:
    backoff = Backoff(1.0, 30.0, rng=random.Random(4))
    _delays(backoff, 6)
    assert backoff.nominal == 30.0
    backoff.reset()
    assert backoff.nominal == 1.0
    assert 0.5 <= backoff.next() <= 1.0


def test_the_same_seed_gives_the_same_delays() -> None:
    first = _delays(Backoff(0.5, 5.0, rng=random.Random(42)), 10)
    again = _delays(Backoff(0.5, 5.0, rng=random.Random(42)), 10)
    assert first == again


def test_different_seeds_spread_clients_apart() -> None:
    one = _delays(Backoff(0.5, 5.0, rng=random.Random(1)), 10)
    other = _delays(Backoff(0.5, 5.0, rng=random.Random(2)), 10)
    assert one != other
    assert all(a != b for a, b in zip(one, other, strict=True))


def test_unseeded_instances_draw_apart() -> None:
    # Two daemons started at the same moment must not retry in lockstep.
    assert _delays(Backoff(1.0, 30.0), 10) != _delays(Backoff(1.0, 30.0), 10)


@pytest.mark.parametrize(
    ("initial", "maximum", "factor"),
    [(0.0, 1.0, 2.0), (-1.0, 1.0, 2.0), (2.0, 1.0, 2.0), (1.0, 2.0, 0.5), (math.nan, 1.0, 2.0)],
)
def test_settings_that_cannot_back_off_are_refused(
    initial: float, maximum: float, factor: float
) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(initial, maximum, factor=factor)
