"""Delays between retries of a service that is away: growing, capped, and jittered.

Without jitter every worker and janitor that lost the broker at the same moment (a restart)
retries at the same moments too, and the returning broker takes all their reconnects at
once, again and again.
"""

from __future__ import annotations

import random


class Backoff:
    """Exponential backoff with "equal jitter": the n-th delay is drawn uniformly from
    ``[d/2, d]``, where ``d = min(maximum, initial * factor**n)``.

    Equal rather than full jitter (``[0, d]``): full jitter spreads retries a little wider,
    but now and then draws a delay near zero, and a daemon would then hammer a service that
    is down in a tight loop; half the nominal delay is a floor that keeps every retry paced,
    while the other half still spreads a crowd of clients over ``d/2``. No delay ever
    exceeds ``maximum``.

    ``rng`` makes the draws reproducible (tests); by default each instance has its own
    generator, seeded from the OS, so processes started together do not draw alike.
    """

    def __init__(
        self,
        initial: float,
        maximum: float,
        *,
        factor: float = 2.0,
        rng: random.Random | None = None,
    ) -> None:
        if not initial > 0:
            raise ValueError(f"a backoff's initial delay must be above 0, not {initial}")
        if not maximum >= initial:
            raise ValueError(f"a backoff's maximum {maximum} is below its initial {initial}")
        if not factor >= 1:
            raise ValueError(f"a backoff's factor must be 1 or more, not {factor}")
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self._rng = rng if rng is not None else random.Random()
        self._nominal = initial

    @property
    def nominal(self) -> float:
        """The upper bound of the next delay: the un-jittered exponential step."""
        return self._nominal

    def next(self) -> float:
        """The delay to wait before the next retry, in seconds; the one after grows."""
        ceiling = self._nominal
        self._nominal = min(self.maximum, self._nominal * self.factor)
        half = ceiling / 2
        return half + self._rng.uniform(0.0, half)

    def reset(self) -> None:
        """Start again from ``initial``: the service answered, so the next outage is new."""
        self._nominal = self.initial
