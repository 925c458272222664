"""Telling two members' plans of a shared ledger apart (gpuwait.queue.wait.Disagreement)."""

from __future__ import annotations

import os

from helpers.jobs import live_job

from gpuwait.core.policy import FairShare
from gpuwait.queue.conditions import claims_for
from gpuwait.queue.entries import LedgerData
from gpuwait.queue.wait import DISAGREE_AFTER, Disagreement

RUNNING = frozenset({"r1"})


def test_strict_only_once_the_same_job_has_waited_on_past_the_grace() -> None:
    seen = Disagreement()
    assert not seen.note(frozenset({"bob1"}), RUNNING, 100.0)
    assert seen.suspected  # planned again at every reading until it starts
    # Another of Bob's jobs takes its place in the plan: its own time counts from now.
    assert not seen.note(frozenset({"bob2"}), RUNNING, 100.0 + DISAGREE_AFTER)
    assert seen.note(frozenset({"bob2"}), RUNNING, 100.0 + 2 * DISAGREE_AFTER)


def test_a_new_waiter_on_an_idle_machine_plans_with_its_search() -> None:
    # Nothing runs yet and nobody else's job is planned to start: no disagreement, so the plan
    # searches for the best layout rather than keeping to strict order.
    seen = Disagreement()
    assert not seen.note(frozenset(), frozenset(), 0.0)
    assert not seen.note(frozenset(), frozenset(), DISAGREE_AFTER * 2)


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


def test_a_job_strict_order_starts_that_never_starts_is_passed_over_while_it_waits() -> None:
    # Bob's entry waits first in the queue, but no gpuwait of his will ever start it: every
    # member's plan, strict order's too, left the card to it, and Alice's job behind it
    # waited for as long as the entry was there.
    seen = Disagreement()
    seen.note(frozenset({"bob1"}), RUNNING, 0.0)
    assert seen.note(frozenset({"bob1"}), RUNNING, DISAGREE_AFTER)
    assert seen.planned(FairShare(), {"bob1", "alice1"}) == FairShare().in_strict_order()
    seen.note(frozenset({"bob1"}), RUNNING, DISAGREE_AFTER + 1)
    assert not seen.planned(FairShare(), {"bob1"}).passed_over  # a slow start is no cause
    seen.note(frozenset({"bob1"}), RUNNING, 2 * DISAGREE_AFTER + 1)
    assert seen.planned(FairShare(), {"bob1", "alice1"}).passed_over == {"bob1"}
    # ... as long as it waits: a job that started or left is counted as ever.
    assert not seen.planned(FairShare(), {"alice1"}).passed_over


def test_a_job_passed_over_is_left_out_of_the_plan_only_while_it_waits() -> None:
    bobs = live_job("bob1", uid=os.getuid() + 1, request={"bytes": 20 * 2**30})
    data = LedgerData(jobs=[bobs], me=os.getuid())
    passing = FairShare(passed_over=frozenset({"bob1"}))
    assert [c.job_id for c in claims_for(data, [], FairShare(), 0.0)] == ["bob1"]
    assert claims_for(data, [], passing, 0.0) == []
    data = LedgerData(jobs=[bobs._replace(state="running")], me=os.getuid())
    assert [c.job_id for c in claims_for(data, [], passing, 0.0)] == ["bob1"]
