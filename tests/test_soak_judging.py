"""The soak's judge: what it counts as lost, reordered, repeated or stalled (pure logic)."""

from __future__ import annotations

from tests.soak import SoakReport, judge_key


def test_a_key_is_judged_by_what_its_producer_accepted() -> None:
    verdict = judge_key("s", "k", [1, 2, 3, 4, 5], [1, 3, 2, 3, 4])
    assert (verdict.lost, verdict.reordered, verdict.applied_twice) == (1, 1, 1)
    assert verdict.unapplied_tail == 1  # 5, the last, was never applied


def test_unapplied_tails_beyond_the_unconfirmed_count_are_lost() -> None:
    stalled_only = judge_key("s", "k", [1, 2, 3, 4], [1, 2])
    assert (stalled_only.lost, stalled_only.unapplied_tail) == (2, 2)
    gap = judge_key("s", "k", [1, 2, 3, 4], [1, 3, 4])
    assert (gap.lost, gap.unapplied_tail) == (1, 0)  # 2 is lost whatever was unconfirmed


def test_a_run_with_unconfirmed_events_is_safe_at_best_never_clean() -> None:
    report = SoakReport(seed=1, seconds=1.0, schedule=[])
    assert report.clean
    report.unconfirmed = {"key": 3}
    report.stalled = 3
    assert report.safe and not report.clean
    assert report.outcome().startswith("SAFE BUT STALLED")
    report.lost = 1
    assert not report.safe and report.outcome() == "NOT CLEAN"
