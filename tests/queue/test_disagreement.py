"""Telling two members' plans of a shared ledger apart (gpuwait.queue.wait.Disagreement)."""

from __future__ import annotations

from gpuwait.queue.wait import DISAGREE_AFTER, Disagreement

RUNNING = frozenset({"r1"})


def test_strict_only_once_the_same_job_has_waited_on_past_the_grace() -> None:
    seen = Disagreement()
    assert not seen.note(frozenset({"bob1"}), RUNNING, 100.0)
    assert seen.suspected  # planned again at every reading until it starts
    # Another of Bob's jobs takes its place in the plan: its own time counts from now.
    assert not seen.note(frozenset({"bob2"}), RUNNING, 100.0 + DISAGREE_AFTER)
    assert seen.note(frozenset({"bob2"}), RUNNING, 100.0 + 2 * DISAGREE_AFTER)


def test_a_job_that_starts_in_time_clears_the_suspicion() -> None:
    seen = Disagreement()
    seen.note(frozenset({"bob1"}), RUNNING, 0.0)
    assert not seen.note(frozenset(), RUNNING | {"bob1"}, 0.5)
    assert not seen.suspected


def test_strict_until_a_job_starts_or_ends() -> None:
    seen = Disagreement()
    seen.note(frozenset({"bob1"}), RUNNING, 0.0)
    assert seen.note(frozenset({"bob1"}), RUNNING, DISAGREE_AFTER)
    # Strict plans may start nobody of other members' at once: still strict meanwhile.
    assert seen.note(frozenset(), RUNNING, DISAGREE_AFTER + 30)
    # A job started: the plans may agree again.
    assert not seen.note(frozenset(), RUNNING | {"bob1"}, DISAGREE_AFTER + 31)
