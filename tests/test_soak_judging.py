"""The soak's judge: what it counts as lost, reordered, repeated or stalled (pure logic)."""

from __future__ import annotations

from tests.soak import SoakReport, judge_key, stalled_events


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


def test_unapplied_tails_are_stalled_only_up_to_their_own_queues_unconfirmed_count() -> None:
    verdicts = [
        judge_key("s", "a", [1, 2, 3], [1]),  # 2 unapplied at the end
        judge_key("s", "b", [1, 2, 3], [1, 2]),  # 1 unapplied at the end
        judge_key("s", "c", [1, 2], [1]),  # 1 unapplied at the end, in a queue with all confirmed
    ]
    queues = {"a": "q1", "b": "q1", "c": "q2"}
    # q1 still owes 2 confirms: 2 of its 3 unapplied tail events are stalled, one is lost;
    # q2 owes none, so c's missing event is lost even though the stream as a whole owes some.
    assert stalled_events(verdicts, queues.__getitem__, {"q1": 2}) == 2
    assert stalled_events(verdicts, queues.__getitem__, {"q1": 5, "q2": 1}) == 4
    assert stalled_events(verdicts, queues.__getitem__, {}) == 0
