"""Property tests of the choice of jobs asked to step aside."""

from __future__ import annotations

import pytest
from helpers.jobs import live_job
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwait.core.pausing import PauseRules, RunningJob, choose_victims, eligible, still_pending
from gpuwait.queue.entries import RUNNING, LedgerData
from gpuwait.queue.pausing import pause_progress

GiB = 2**30
RULES = PauseRules(min_runtime=600, max_pauses=2)


def job(
    job_id: str, priority: int = 1, gib: int = 10, run: float = 3600, **kw: object
) -> RunningJob:
    return RunningJob(job_id, priority, ("GPU-0",), gib * GiB, kw.pop("pausable", True), run, **kw)  # type: ignore[arg-type]


def test_lowest_priority_and_least_lost_work_go_first() -> None:
    running = [job("old", run=7200), job("young", run=900), job("p2", priority=2, run=601)]
    choice = choose_victims({"GPU-0": 10 * GiB}, {"GPU-0": 2 * GiB}, 5, running, RULES)
    assert choice is not None and choice.victims == ("young",)


def test_nobody_is_paused_when_the_waiter_fits() -> None:
    assert choose_victims({"GPU-0": GiB}, {"GPU-0": 2 * GiB}, 5, [job("a")], RULES) is None


def test_rules_protect_jobs() -> None:
    for protected in (
        job("optout", pausable=False),
        job("young", run=30),
        job("tired", pauses=2),
        job("asked", asked=True),
        job("peer", priority=5),
        job("slow-reload", reload_seconds=900),
    ):
        assert (
            choose_victims(
                {"GPU-0": 5 * GiB}, {"GPU-0": 0}, 5, [protected], RULES, expected_wait=300
            )
            is None
        )


def test_slow_reload_is_paused_when_the_wait_would_be_longer() -> None:
    slow = job("slow-reload", reload_seconds=900)
    assert eligible(slow, 5, RULES, expected_wait=3600)
    assert eligible(slow, 5, RULES, expected_wait=None)
    assert not eligible(slow, 5, RULES, expected_wait=60)


def test_two_small_victims_when_one_is_not_enough() -> None:
    running = [job("a", gib=4, run=1000), job("b", gib=4, run=2000), job("c", gib=4, run=3000)]
    choice = choose_victims({"GPU-0": 10 * GiB}, {"GPU-0": 2 * GiB}, 5, running, RULES)
    assert choice is not None and choice.victims == ("a", "b") and choice.freed_bytes == 8 * GiB


running_jobs = st.lists(
    st.builds(
        RunningJob,
        job_id=st.text("abcdef", min_size=1, max_size=4),
        priority=st.integers(1, 5),
        gpu_uuids=st.sampled_from([("GPU-0",), ("GPU-1",), ("GPU-0", "GPU-1")]),
        holds_bytes=st.integers(0, 40 * GiB),
        pausable=st.booleans(),
        run_seconds=st.floats(0, 10_000),
        pauses=st.integers(0, 4),
        reload_seconds=st.none() | st.floats(0, 1000),
        asked=st.booleans(),
    ),
    max_size=10,
    unique_by=lambda j: j.job_id,
)


@settings(max_examples=400, deadline=None)
@given(
    running=running_jobs,
    need=st.integers(1, 80 * GiB),
    rooms=st.tuples(st.integers(-5 * GiB, 40 * GiB), st.integers(-5 * GiB, 40 * GiB)),
    priority=st.integers(1, 5),
    wait=st.none() | st.floats(0, 2000),
)
def test_choices_free_enough_and_ask_only_eligible_jobs(
    running: list[RunningJob], need: int, rooms: tuple[int, int], priority: int, wait: float | None
) -> None:
    room = {"GPU-0": rooms[0], "GPU-1": rooms[1]}
    choice = choose_victims({"GPU-0": need, "GPU-1": need}, room, priority, running, RULES, wait)
    if choice is None:
        return
    by_id = {j.job_id: j for j in running}
    victims = [by_id[v] for v in choice.victims]
    assert victims, "a choice always names someone"
    assert all(eligible(v, priority, RULES, wait) for v in victims)
    assert all(v.gpu_uuids == (choice.gpu_uuid,) for v in victims)
    assert room[choice.gpu_uuid] + choice.freed_bytes >= need
    # No one is asked in vain: without the last victim, the waiter would not fit.
    assert room[choice.gpu_uuid] + choice.freed_bytes - victims[-1].holds_bytes < need


def _asked(**fields: object) -> LedgerData:
    victim = live_job(
        "v1",
        state=RUNNING,
        pausable=True,
        pause_requested_at=1000.0,
        pause_requested_by="w1",
        grace_seconds=60.0,
        **fields,
    )
    return LedgerData(jobs=[victim])


@pytest.mark.parametrize(
    ("fields", "now", "said"),
    [
        ({}, 1001.0, "asked job v1 to checkpoint and step aside"),
        ({}, 1010.0, "it does not catch USR1 yet"),
        ({"pause_signalled_at": 1001.0}, 1030.0, "asked job v1 to checkpoint and step aside"),
        ({"pause_signalled_at": 1001.0}, 1070.0, "is left alone"),
        ({"pause_signalled_at": 1001.0, "grace_kill": True}, 1070.0, "it gets TERM"),
    ],
)
def test_the_waiter_is_told_what_became_of_its_request(
    fields: dict[str, object], now: float, said: str
) -> None:
    text = pause_progress(_asked(**fields), "w1", now)
    assert text is not None and said in text
    # Just asked: its gpuwait has had no time to signal yet, which says nothing about the job.
    assert ("does not catch" in text) == (said == "it does not catch USR1 yet")
    assert pause_progress(_asked(**fields), "someone else", now) is None


@pytest.mark.parametrize(
    ("signalled", "grace_kill", "now", "pending"),
    [
        (None, False, 1010.0, True),  # never caught the signal: its grace runs from the request
        (None, False, 1030.0, False),
        (1005.0, False, 1020.0, True),
        (1005.0, False, 1030.0, False),  # left alone: its asker may ask others
        (1005.0, True, 1300.0, True),  # TERM after the grace: it ends, and is waited for
    ],
)
def test_a_request_to_step_aside_is_pending_until_the_jobs_grace_has_passed(
    signalled: float | None, grace_kill: bool, now: float, pending: bool
) -> None:
    assert still_pending(1000.0, signalled, 20.0, grace_kill, now) is pending
    assert still_pending(None, signalled, 20.0, grace_kill, now) is False


YEAR = 365 * 86400.0


@pytest.mark.parametrize(
    ("grace", "grace_kill", "now", "pending"),
    [
        (YEAR, False, 1500.0, True),
        (YEAR, False, 1700.0, False),  # a grace of a year: the asker moves on after its own 10m
        (YEAR, True, 1700.0, False),  # nor is a TERM a year off waited for
        (20.0, True, 1500.0, True),  # TERMed at its grace of 20 s: it ends, and is waited for
        (20.0, True, 1700.0, False),  # ... unless it ignores the TERM past the asker's 10m
        (900.0, False, 1500.0, True),
    ],
)
def test_an_asker_waits_for_one_job_no_longer_than_its_own_grace_max(
    grace: float, grace_kill: bool, now: float, pending: bool
) -> None:
    # A colleague's --pausable job that gave itself --grace 365d and never steps aside kept an
    # urgent waiter from asking any other job for a year.
    assert still_pending(1000.0, 1050.0, grace, grace_kill, now, grace_max=600.0) is pending
