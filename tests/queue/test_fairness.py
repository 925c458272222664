"""Fair share between users and per-user limits, in the pure policy and the usage arithmetic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_sim import SimFileFactory
from helpers.jobs import live_job
from helpers.waiting import named_entry, wait_for
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwait.cli import main
from gpuwait.core.lookahead import plan_queue, with_wait_budgets
from gpuwait.core.policy import (
    NO_CONDITIONS,
    Claim,
    FairShare,
    Lookahead,
    UserLimits,
    estimate_starts,
    impossible_reason,
    plan,
)
from gpuwait.core.sizes import MemoryRequest, parse_size
from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.linux import dirs
from gpuwait.queue.entries import RUNNING, LedgerData, UserUsage
from gpuwait.queue.fairness import charge, decayed, user_usage

GiB = 2**30
#: The default queue order (lookahead) with a limit of one GPU per user and no fair share.
LIMITED = FairShare(limits=UserLimits(max_gpus=1), order=Lookahead())


def card(index: int, total_gib: int = 24) -> GpuSnapshot:
    return GpuSnapshot(index, f"GPU-{index}", "T", total_gib * GiB, 0)


def waiter(job_id: str, uid: int, order: int, gib: int = 20, **kw: object) -> Claim:
    return Claim(
        job_id, False, kw.pop("priority", 3), order, MemoryRequest(bytes=gib * GiB), uid=uid, **kw
    )  # type: ignore[arg-type]


def running_on_gpu0(job_id: str, uid: int, gib: int = 20, **kw: object) -> Claim:
    return Claim(
        job_id,
        True,
        3,
        0,
        MemoryRequest(bytes=gib * GiB),
        gpu_uuids=("GPU-0",),
        reserved_bytes=gib * GiB,
        uid=uid,
        **kw,  # type: ignore[arg-type]
    )


def test_lighter_user_goes_first_within_a_priority() -> None:
    claims = [waiter("heavy", uid=1, order=1, usage=1e15), waiter("light", uid=2, order=2)]
    assert set(plan([card(0)], claims, 0.9).admitted) == {"light"}


def test_priority_still_comes_before_usage() -> None:
    claims = [
        waiter("heavy-urgent", uid=1, order=2, usage=1e15, priority=5),
        waiter("light", uid=2, order=1),
    ]
    assert set(plan([card(0)], claims, 0.9).admitted) == {"heavy-urgent"}


def test_without_usage_it_is_first_come_first_served() -> None:
    claims = [waiter("first", uid=1, order=1), waiter("second", uid=2, order=2)]
    assert set(plan([card(0)], claims, 0.9).admitted) == {"first"}


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(st.integers(1, 3), st.integers(1, 12), st.integers(1, 2)),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 3),
    st.integers(4, 40),
)
def test_limits_are_never_exceeded(
    jobs: list[tuple[int, int, int]], max_gpus: int, max_vram_gib: int
) -> None:
    gpus = [card(i) for i in range(4)]
    claims = [
        Claim(f"j{i}", False, 3, i, MemoryRequest(bytes=gib * GiB), gpus_wanted=n, uid=uid)
        for i, (uid, gib, n) in enumerate(jobs)
    ]
    limits = UserLimits(max_gpus=max_gpus, max_vram=max_vram_gib * GiB)
    decided = plan(gpus, claims, 0.9, limits=limits)
    for uid in {c.uid for c in claims}:
        mine = [c for c in claims if c.uid == uid and c.job_id in decided.admitted]
        assert sum(len(decided.admitted[c.job_id]) for c in mine) <= max_gpus
        held = sum(decided.reserved[c.job_id] * len(decided.admitted[c.job_id]) for c in mine)
        assert held <= max_vram_gib * GiB
    for reason in decided.waiting.values():
        assert reason.describe().startswith("waiting for")


@given(st.lists(st.floats(0, 1e18), min_size=2, max_size=6))
def test_one_users_jobs_keep_their_order(usages: list[float]) -> None:
    # Whatever the usage figures, jobs of the same user (hence the same usage) stay in order.
    claims = [waiter(f"j{i}", uid=7, order=i, usage=usages[0], gib=8) for i in range(len(usages))]
    admitted = plan([card(0)], claims, 0.9).admitted
    assert list(admitted) == [f"j{i}" for i in range(len(admitted))]


def test_running_jobs_count_against_the_limit() -> None:
    running = Claim(
        "r", True, 3, 0, MemoryRequest(bytes=GiB), gpu_uuids=("GPU-0",), reserved_bytes=GiB, uid=1
    )
    claims = [running, waiter("w", uid=1, order=1, gib=1), waiter("other", uid=2, order=2, gib=1)]
    decided = plan([card(0), card(1)], claims, 0.9, limits=UserLimits(max_gpus=1))
    assert set(decided.admitted) == {"other"}
    assert "per-user limit of 1 GPUs" in decided.waiting["w"].describe()


@pytest.mark.parametrize("known", [None, 100.0])
def test_a_waiter_over_its_users_limit_is_planned_around(known: float | None) -> None:
    # Alice holds one GPU (her limit); her next job comes first (priority 4), Bob's after it.
    # The lookahead order must not keep the idle GPU for Alice's job, which cannot start.
    alice_running = running_on_gpu0("alice-1", uid=1, expected_seconds=known)
    claims = [
        alice_running,
        waiter("alice-2", uid=1, order=1, priority=4, expected_seconds=known),
        waiter("bob", uid=2, order=2, expected_seconds=known),
    ]
    decided = plan_queue([card(0), card(1)], claims, 0.9, -1, NO_CONDITIONS, LIMITED)
    assert decided.admitted == {"bob": ("GPU-1",)}
    assert "per-user limit of 1 GPUs (1 held)" in decided.waiting["alice-2"].describe()


@pytest.mark.parametrize("order", [None, Lookahead()])
def test_a_waiter_over_its_users_limit_holds_no_gpu_for_itself(order: Lookahead | None) -> None:
    # A limit of 24 GiB per user. Alice holds 20 GiB on GPU0; her next job (priority 4, 20 GiB)
    # fits nowhere and is over her limit anyway. Bob holds 10 GiB on GPU1 and asks for 8 more,
    # which fit there: no GPU is held for Alice's job, which could not take it.
    claims = [
        running_on_gpu0("alice-1", uid=1),
        running_on_gpu0("bob-1", uid=2, gib=10)._replace(gpu_uuids=("GPU-1",)),
        waiter("alice-2", uid=1, order=1, priority=4),
        waiter("bob-2", uid=2, order=2, gib=8),
    ]
    fair = FairShare(limits=UserLimits(max_vram=24 * GiB), order=order)
    decided = plan_queue([card(0), card(1)], claims, 0.9, -1, NO_CONDITIONS, fair)
    assert decided.admitted == {"bob-2": ("GPU-1",)}
    assert decided.hold is None
    assert "per-user limit of 24.0 GiB (20.0 GiB held)" in decided.waiting["alice-2"].describe()


def test_what_a_user_starts_in_one_plan_counts_against_their_limit_in_it() -> None:
    # Two idle GPUs, Alice's two urgent jobs first: her first takes one card, her second would
    # go over her limit, so Bob's job gets the other card now.
    claims = [
        waiter("alice-1", uid=1, order=1, priority=4),
        waiter("alice-2", uid=1, order=2, priority=4),
        waiter("bob", uid=2, order=3),
    ]
    decided = plan_queue([card(0), card(1)], claims, 0.9, -1, NO_CONDITIONS, LIMITED)
    assert set(decided.admitted) == {"alice-1", "bob"}
    assert "per-user limit of 1 GPUs (1 held)" in decided.waiting["alice-2"].describe()


def test_a_request_over_the_limit_is_impossible() -> None:
    claim = waiter("big", uid=1, order=1, gib=20)
    assert impossible_reason(claim, [card(0)], 0.9, UserLimits(max_vram=16 * GiB)) is not None
    assert impossible_reason(claim, [card(0)], 0.9, UserLimits(max_vram=32 * GiB)) is None
    exclusive = Claim("x", False, 3, 1, None, uid=1)
    assert impossible_reason(exclusive, [card(0)], 0.9, UserLimits(max_vram=8 * GiB)) is not None


@pytest.mark.parametrize("order", [None, Lookahead()])
def test_a_whole_gpu_within_the_vram_limit_is_found_among_larger_ones(
    order: Lookahead | None,
) -> None:
    # An 80 GiB card first, then a 24 GiB one; a limit of 30 GiB per user. The whole 80 GiB
    # card is over the limit, the 24 GiB one is not: that is where the job starts.
    gpus = [card(0, 80), card(1, 24)]
    exclusive = Claim("x", False, 3, 1, None, uid=1)
    fair = FairShare(limits=UserLimits(max_vram=30 * GiB), order=order)
    assert impossible_reason(exclusive, gpus, 0.9, fair.limits) is None
    assert plan_queue(gpus, [exclusive], 0.9, -1, NO_CONDITIONS, fair).admitted == {"x": ("GPU-1",)}


def test_a_whole_gpu_whose_room_is_over_the_vram_limit_is_impossible() -> None:
    # 48 GiB at safety 0.9: a whole card is 43.2 GiB, over a limit of 42 GiB.
    exclusive = Claim("x", False, 3, 1, None, uid=1)
    said = impossible_reason(exclusive, [card(0, 48)], 0.9, UserLimits(max_vram=42 * GiB))
    assert said is not None and "43.2 GiB" in said
    assert impossible_reason(exclusive, [card(0, 48)], 0.9, UserLimits(max_vram=44 * GiB)) is None


def test_a_whole_gpu_over_the_vram_limit_is_answered_at_once(
    isolated_dirs: Path, sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    site = isolated_dirs / "site-config" / "gpuwait" / "config.toml"
    site.parent.mkdir(parents=True)
    site.write_text('user_max_vram = "30GiB"\n')
    sim_file(gpus=2, memory=["80GiB", "24GiB"])
    # The small card keeps the user within the limit: the job runs there.
    fits = subprocess.run(
        [*gpuwait_cmd, "--exclusive", "--timeout", "10s", "--", "true"],
        capture_output=True,
        text=True,
    )
    assert fits.returncode == 0, fits.stderr
    sim_file(gpus=1, memory="34GiB")
    # A whole card of 34 GiB is 30.6 GiB at safety 0.9: it would never be admitted.
    never = subprocess.run(
        [*gpuwait_cmd, "--exclusive", "--timeout", "10s", "--", "true"],
        capture_output=True,
        text=True,
    )
    assert never.returncode == 3, never.stderr
    assert "exceeds per-user limit of 30.0 GiB" in never.stderr


def test_a_light_users_job_with_no_history_is_not_starved_by_a_heavy_users_sweep() -> None:
    # Alice has used the card heavily and queued a sweep of 200 one-minute jobs; Bob, who has
    # used nothing, queues one job of a command gpuwait has never seen run.
    busy = running_on_gpu0("running", uid=1, expected_seconds=30.0)
    sweep = [
        waiter(f"a{i}", uid=1, order=i + 1, usage=1e15, expected_seconds=60.0) for i in range(200)
    ]
    bob = waiter("bob", uid=2, order=500)
    fair = FairShare(half_life=86400.0, order=Lookahead())
    claims = with_wait_budgets([card(0)], [busy, *sweep, bob], 0.9, fair.order)
    # Served in strict order, fair share would start Bob's job once the running one ends: his
    # wait budget is ten times that, not ten times the whole sweep (200 minutes).
    (due,) = [c.due for c in claims if c.job_id == "bob"]
    assert due == pytest.approx(300.0)
    # Once it is spent, Bob's job is the next to start, before the rest of Alice's sweep.
    later = [c._replace(waited=due) if c.job_id == "bob" else c for c in claims[1:]]
    decided = plan_queue([card(0)], later, 0.9, -1, NO_CONDITIONS, fair)
    assert decided.admitted == {"bob": ("GPU-0",)}


def test_a_card_is_filled_no_further_than_its_most_careful_users_safety() -> None:
    # Bob's job (10 GiB, his safety 0.9) runs on a 24 GiB card; Alice plans with safety 1.0.
    bobs = running_on_gpu0("bob", uid=2, gib=10, safety=0.9)
    alices = waiter("alice", uid=1, order=1, gib=13)
    assert plan([card(0)], [bobs, alices], 1.0).admitted == {}
    # What Bob's safety leaves room for starts; where his job is gone, so is his say.
    assert set(
        plan(
            [card(0)], [bobs, alices._replace(request=MemoryRequest(bytes=11 * GiB))], 1.0
        ).admitted
    ) == {"alice"}
    assert set(plan([card(0)], [bobs._replace(safety=None), alices], 1.0).admitted) == {"alice"}


def test_usage_halves_every_half_life() -> None:
    assert decayed(UserUsage(100.0, 1000.0), 1000.0 + 3600, 3600.0) == pytest.approx(50.0)
    assert decayed(UserUsage(100.0, 1000.0), 1000.0 + 3600, None) == 100.0
    data = LedgerData()
    charge(data, 5, 100.0, 1000.0, 3600.0)
    charge(data, 5, 100.0, 1000.0 + 3600, 3600.0)
    assert user_usage(data, 1000.0 + 3600, 3600.0)[5] == pytest.approx(150.0)


def test_fair_share_settings_come_from_the_site(
    tmp_path: Path, isolated_dirs: Path, monkeypatch: pytest.MonkeyPatch, gpuwait_cmd: list[str]
) -> None:
    site = isolated_dirs / "site-config" / "gpuwait" / "config.toml"
    site.parent.mkdir(parents=True)
    site.write_text('user_max_gpus = 2\nuser_max_vram = "40GiB"\nfair_share_half_life = "2h"\n')
    sim = tmp_path / "sim.toml"
    assert main(["sim", "init", str(sim), "--gpus", "1", "--memory", "24GiB"]) == 0
    monkeypatch.setenv("GPUWAIT_SIM", str(sim))
    from gpuwait.config import load_settings

    fair = load_settings({}).fair_share()
    assert (fair.half_life, fair.limits) == (7200.0, UserLimits(2, 40 * GiB))
    assert subprocess.run([*gpuwait_cmd, "--vram", "1G", "true"]).returncode == 0
    text = subprocess.run(
        [*gpuwait_cmd, "status"], capture_output=True, text=True, env=dict(os.environ)
    ).stdout
    assert "Users (fair share half-life 2h00m; per user at most 2 GPUs, at most 40.0 GiB)" in text
    shown = subprocess.run(
        [*gpuwait_cmd, "config"], capture_output=True, text=True, env=dict(os.environ)
    ).stdout
    assert f"(site config file {site})" in shown


@pytest.mark.parametrize("order", [None, Lookahead()])
def test_a_share_of_cards_of_different_sizes_counts_that_share_of_each(
    order: Lookahead | None,
) -> None:
    # Half of a 24 GiB and of an 80 GiB card is 12 + 40 = 52 GiB, within a 60 GiB limit (not
    # twice 40); once it runs, 8 GiB more of the same user's still fit the limit.
    gpus = [card(0), card(1, total_gib=80)]
    fair = FairShare(limits=UserLimits(max_vram=60 * GiB), order=order)
    half = MemoryRequest(fraction=0.5)
    gang = Claim("gang", False, 3, 1, half, gpus_wanted=2, uid=1)
    assert impossible_reason(gang, gpus, 0.9, fair.limits) is None
    decided = plan_queue(gpus, [gang], 0.9, -1, NO_CONDITIONS, fair)
    assert decided.admitted == {"gang": ("GPU-0", "GPU-1")}
    ran = gang._replace(running=True, gpu_uuids=("GPU-0", "GPU-1"), reserved_bytes=40 * GiB)
    ran = ran._replace(reserved_by_gpu={"GPU-0": 12 * GiB})
    decided = plan_queue(
        gpus, [ran, waiter("more", uid=1, order=2, gib=8)], 0.9, -1, NO_CONDITIONS, fair
    )
    assert decided.admitted == {"more": ("GPU-0",)}


def test_a_running_share_of_cards_of_different_sizes_counts_that_share_of_each() -> None:
    # 12 GiB of a 24 GiB card and 40 GiB of an 80 GiB one, for ten seconds: 52 GiB·10 s.
    gang = live_job(
        "gang",
        state=RUNNING,
        gpus=2,
        gpu_uuids=["GPU-0", "GPU-1"],
        reserved_bytes=40 * GiB,
        reserved_by_gpu={"GPU-0": 12 * GiB},
        started_at=1000.0,
    )
    data = LedgerData(jobs=[gang])
    assert user_usage(data, 1010.0, None)[gang.uid] == pytest.approx(52 * GiB * 10)


@pytest.mark.parametrize("order", [None, Lookahead()])
def test_a_careful_users_job_admitted_in_a_plan_keeps_its_safety_for_the_rest_of_it(
    order: Lookahead | None,
) -> None:
    # Bob (safety 0.5: 12 GiB of the 24 GiB card) and Alice both wait; Alice plans with safety
    # 1.0. Once Bob's job runs, Alice's 7 GiB would fill the card to 13 GiB and waits, and it
    # must wait as well when both start in one plan: Bob's job runs there from then on.
    bobs = waiter("bob", uid=2, order=0, gib=6, safety=0.5)
    alices = waiter("alice", uid=1, order=1, gib=7)
    fair = FairShare(order=order)
    decided = plan_queue([card(0)], [bobs, alices], 1.0, -1, NO_CONDITIONS, fair)
    assert decided.admitted == {"bob": ("GPU-0",)}
    # As the next plan sees it, with Bob's job running.
    running = bobs._replace(running=True, gpu_uuids=("GPU-0",), reserved_bytes=6 * GiB)
    assert plan_queue([card(0)], [running, alices], 1.0, -1, NO_CONDITIONS, fair).admitted == {}


def test_a_waiting_job_follows_the_safety_the_site_lowers_while_it_waits(
    sim_file: SimFileFactory,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A user who set no safety of their own has the site's: lowered in the site file while
    their job waits, it holds that job as it holds the jobs submitted since (as a new limit
    does); their own `--safety` would have stayed theirs."""
    sim_file(gpus=1, memory="24G", base_used="4G")  # 4 GiB held outside gpuwait
    monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "0.2s")  # a site file's change wakes nobody
    gpuwait = [sys.executable, "-m", "gpuwait"]
    first = procs([*gpuwait, "--vram", "12G", "--name", "first", "--", "sleep", "30"])
    wait_for(lambda: (e := named_entry("first")) and e["state"] == "running", timeout=20)
    # 4 + 12 + 9 GiB are more than 0.9 of the card: the second waits.
    second = procs([*gpuwait, "--vram", "9G", "--name", "second", "--", "sleep", "30"])
    wait_for(lambda: named_entry("second") is not None, timeout=20)
    site = Path(os.environ["XDG_CONFIG_DIRS"]) / "gpuwait" / "config.toml"
    site.parent.mkdir(parents=True)
    site.write_text("safety = 0.5\n")  # 12 GiB of the card: 4 + 9 no longer fit
    # A plan reads the site file as it begins and starts a job at its end: one under way as
    # the file was written (on a loaded machine, long enough for the first job to end) starts
    # the second at the safety before. The first ends once a plan begun since has ended.
    stamp = Path(dirs.user_state_dir()) / "plan.stamp"
    written = time.time_ns()
    wait_for(lambda: stamp.stat().st_mtime_ns > written, timeout=20)
    once = stamp.stat().st_mtime_ns
    wait_for(lambda: stamp.stat().st_mtime_ns > once, timeout=20)
    os.killpg(first.pid, signal.SIGTERM)
    first.wait(timeout=20)
    ended = time.time_ns()

    def planned_since() -> dict[str, Any] | None:
        entry = named_entry("second")
        if entry is None or entry["state"] != "waiting":
            return entry or {"state": "gone"}
        return entry if stamp.stat().st_mtime_ns > ended else None

    entry = wait_for(planned_since, timeout=20)
    assert entry["state"] == "waiting", "it started past the safety the site set"
    assert second.poll() is None
    # Lowered below what it asks alone (0.3 of 24 GiB), it would wait for ever: exit 3.
    site.write_text("safety = 0.3\n")
    assert second.wait(timeout=20) == 3
    assert "at safety 0.3, set in the site config file while it waited" in second.stderr.read()


def test_jobs_follow_the_safety_the_site_raises_while_they_wait_and_run(
    sim_file: SimFileFactory,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Raised in the site file, the site's safety holds the jobs of a user who set none of
    their own as it holds those submitted since: neither the waiting job nor the one running
    beside it keeps the stricter safety it was submitted with."""
    sim_file(gpus=1, memory="24G", base_used="4G")  # 4 GiB held outside gpuwait
    monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "0.2s")  # a site file's change wakes nobody
    site = Path(os.environ["XDG_CONFIG_DIRS"]) / "gpuwait" / "config.toml"
    site.parent.mkdir(parents=True)
    site.write_text("safety = 0.5\n")  # 12 GiB of the card
    gpuwait = [sys.executable, "-m", "gpuwait"]
    procs([*gpuwait, "--vram", "6G", "--name", "first", "--", "sleep", "30"])
    wait_for(lambda: (e := named_entry("first")) and e["state"] == "running", timeout=20)
    # 4 + 6 + 6 GiB are more than 12: the second waits.
    second = procs([*gpuwait, "--vram", "6G", "--name", "second", "--", "sleep", "30"])
    wait_for(lambda: named_entry("second") is not None, timeout=20)
    assert second.poll() is None and named_entry("second")["state"] == "waiting"
    site.write_text("safety = 0.9\n")  # 21.6 GiB: 16 fit
    entry = wait_for(
        lambda: (e := named_entry("second")) and e["state"] == "running" and e, timeout=20
    )
    assert entry["state"] == "running", "it waited under the safety the site had raised"
    assert named_entry("first")["state"] == "running"


def test_only_a_safety_the_user_did_not_set_follows_the_site(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpuwait.config import load_settings

    assert load_settings({}).fair_share().safety_from_site
    monkeypatch.setenv("GPUWAIT_SAFETY", "0.8")
    assert not load_settings({}).fair_share().safety_from_site
    assert not load_settings({"safety": 0.7}).fair_share().safety_from_site


def test_a_job_that_grew_past_its_reservation_counts_at_what_it_holds_against_the_limit() -> None:
    # A --vram 2G job that uses 20 GiB holds 20 GiB of its user's 30 GiB: a 12 GiB job of
    # theirs would take them to 32 GiB, and waits; counted at its 2 GiB, it started.
    grew = running_on_gpu0("grew", uid=1, gib=2, observed={"GPU-0": 20 * GiB})
    claims = [grew, waiter("next", uid=1, order=1, gib=12)]
    decided = plan([card(0, 80)], claims, 0.9, limits=UserLimits(max_vram=30 * GiB))
    assert decided.admitted == {}
    assert "your per-user limit of 30.0 GiB (20.0 GiB held)" in decided.waiting["next"].describe()


def test_a_job_a_little_over_its_reservation_counts_at_its_reservation_against_the_limit() -> None:
    # A 10 GiB job using 10.3 GiB (a CUDA context, the caching allocator) is within the
    # overuse margin: a second 10 GiB job of its user fits a 20 GiB limit beside it.
    honest = running_on_gpu0("honest", uid=1, gib=10, observed={"GPU-0": 10 * GiB + 300 * 2**20})
    claims = [honest, waiter("next", uid=1, order=1, gib=10)]
    limits = UserLimits(max_vram=20 * GiB)
    assert set(plan([card(0, 80)], claims, 0.9, limits=limits).admitted) == {"next"}
    # The start the queue's listing gives it is now too, not once the first job ends.
    assert estimate_starts([card(0, 80)], claims, 0.9, limits=limits) == {"next": 0.0}


@pytest.mark.parametrize(
    ("reserves", "uses", "limit", "starts"),
    [("2G", "20G", "30GiB", False), ("10G", "10.3G", "20GiB", True)],
    ids=["grew", "within-margin"],
)
def test_a_users_limit_counts_what_their_jobs_really_hold(
    sim_file: SimFileFactory,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
    gpuwait_cmd: list[str],
    reserves: str,
    uses: str,
    limit: str,
    starts: bool,
) -> None:
    """user_max_vram = 30 GiB: a --vram 2G job that grew to 20 GiB let a 12 GiB job of the same
    user start beside it (32 GiB held); it now waits, and its wait line says 20 GiB are held.
    A 10 GiB job using 10.3 GiB, within the overuse margin, still leaves room for another
    10 GiB under a 20 GiB limit."""
    sim_file(gpus=1, memory="80G")
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "0.1s")
    site = Path(os.environ["XDG_CONFIG_DIRS"]) / "gpuwait" / "config.toml"
    site.parent.mkdir(parents=True)
    site.write_text(f'user_max_vram = "{limit}"\n')
    job = [*gpuwait_cmd, "sim", "job", "--vram", uses, "--hold", "60s"]
    procs([*gpuwait_cmd, "--vram", reserves, "--name", "first", "--", *job])
    used = parse_size(uses)
    wait_for(
        lambda: (e := named_entry("first")) and max(e.get("grown", {}).values(), default=0) >= used,
        timeout=30,
    )
    probe = subprocess.run(
        [*gpuwait_cmd, "--vram", "12G" if not starts else "10G", "--timeout", "2s", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if starts:
        assert probe.returncode == 0, probe.stderr
    else:
        assert probe.returncode == 124, probe.stderr
        assert "your per-user limit of 30.0 GiB (20.0 GiB held)" in probe.stderr
    # status's Users section says what counts against the limit, and the reservation where
    # that is less.
    held, reserved = (10 * GiB, 10 * GiB) if starts else (20 * GiB, 2 * GiB)
    report = json.loads(
        subprocess.run([*gpuwait_cmd, "status", "--json"], capture_output=True, text=True).stdout
    )
    (user,) = report["users"]
    assert (user["vram_counted_bytes"], user["vram_held_bytes"]) == (held, reserved)
    text = subprocess.run([*gpuwait_cmd, "status"], capture_output=True, text=True).stdout
    if starts:
        assert "10.0 GiB held " in text and "reserved" not in text.split("Users")[1]
    else:
        assert "20.0 GiB held (2.0 GiB reserved)" in text
