"""``Backoff``: capped exponential delays with equal jitter, reproducible under a seeded
generator."""

from __future__ import annotations

import math
import random

import pytest

from keyq.broker.backoff import Backoff


def _delays(backoff: Backoff, count: int) -> list[float]:
    return [backoff.next() for _ in range(count)]


@pytest.mark.parametrize(
    ("initial", "maximum", "factor", "steps"),
    [
        pytest.param(0.5, 5.0, 2.0, [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0], id="doubling"),
        pytest.param(1.0, 30.0, 3.0, [1.0, 3.0, 9.0, 27.0, 30.0, 30.0], id="factor-3"),
    ],
)
def test_steps_grow_by_the_factor_up_to_the_maximum_each_delay_within_half_a_step(
    initial: float, maximum: float, factor: float, steps: list[float]
) -> None:
    backoff = Backoff(initial, maximum, factor=factor, rng=random.Random(1))
    for step in steps:
        assert backoff.nominal == step
        delay = backoff.next()
        assert step / 2 <= delay <= step, (step, delay)


def test_delays_grow_on_average() -> None:
    delays = _delays(Backoff(0.1, 1000.0, rng=random.Random(3)), 12)
    # Each step doubles and a delay is within [step/2, step]: every other one is larger.
    assert all(later > earlier for earlier, later in zip(delays, delays[2:], strict=False))


@pytest.mark.parametrize("seed", range(20))
def test_jitter_never_exceeds_the_maximum(seed: int) -> None:
    delays = _delays(Backoff(0.3, 7.0, factor=1.7, rng=random.Random(seed)), 200)
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


def test_a_seed_repeats_its_delays_and_other_seeds_or_none_draw_apart() -> None:
    def seeded(seed: int | None) -> list[float]:
        return _delays(Backoff(0.5, 5.0, rng=None if seed is None else random.Random(seed)), 10)

    assert seeded(42) == seeded(42), "the same seed gives the same delays"
    assert all(a != b for a, b in zip(seeded(1), seeded(2), strict=True)), "seeds spread apart"
    # Two daemons started at the same moment must not retry in lockstep.
    assert seeded(None) != seeded(None), "unseeded instances draw apart"


@pytest.mark.parametrize(
    ("initial", "maximum", "factor"),
    [(0.0, 1.0, 2.0), (-1.0, 1.0, 2.0), (2.0, 1.0, 2.0), (1.0, 2.0, 0.5), (math.nan, 1.0, 2.0)],
)
def test_settings_that_cannot_back_off_are_refused(
    initial: float, maximum: float, factor: float
) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(initial, maximum, factor=factor)
