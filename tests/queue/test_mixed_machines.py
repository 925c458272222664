"""Jobs of several GPUs on machines whose cards differ in size."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest
from helpers.fixtures_sim import SimFileFactory
from helpers.history import recorded_runs
from helpers.waiting import ledger_entries, wait_for

GiB = 2**30


def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_a_share_of_each_card_reserves_that_share_of_each_card(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    # Half of a 24 GiB card and half of an 80 GiB card: 12 GiB on the small one, not the big
    # one's 40 GiB, which would leave the small card nothing for anyone.
    sim_file(gpus=2, memory=["24GiB", "80GiB"])
    gang = procs([*gpuwait_cmd, "-v", "--vram", "50%", "--gpus", "2", "--", "sleep", "30"])
    wait_for(lambda: [j["state"] for j in ledger_entries()] == ["running"])
    report = json.loads(run([*gpuwait_cmd, "status", "--json"]).stdout)
    assert [g["reserved_bytes"] for g in report["gpus"]] == [12 * GiB, 40 * GiB]
    assert report["gpus"][0]["free_bytes"] > 9 * GiB
    assert [u["vram_held_bytes"] for u in report["users"]] == [52 * GiB]
    (job,) = report["jobs"]
    on = dict(zip(job["gpu_indices"], job["reserved_by_gpu_bytes"], strict=True))
    assert on == {0: 12 * GiB, 1: 40 * GiB}
    small = run([*gpuwait_cmd, "--vram", "4G", "--devices", "0", "--timeout", "0", "--", "true"])
    assert small.returncode == 0, small.stderr
    gang.terminate()
    said = gang.communicate(timeout=30)[1]
    assert "12.0 GiB on GPU0, 40.0 GiB on GPU1 reserved" in said


def test_a_gang_of_whole_cards_of_different_sizes_reserves_each_card_whole(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any], isolated_dirs: Any
) -> None:
    # Both cards whole, a 24 GiB and an 80 GiB one: each reserves its own room (21.6 and 72
    # GiB), not the big card's 72 GiB on both, so a user limit of 100 GiB lets it run.
    site = isolated_dirs / "site-config" / "gpuwait" / "config.toml"
    site.parent.mkdir(parents=True)
    site.write_text('user_max_vram = "100GiB"\n')
    sim_file(gpus=2, memory=["24GiB", "80GiB"])
    gang = procs(
        [*gpuwait_cmd, "--exclusive", "--gpus", "2", "--timeout", "5s", "--", "sleep", "30"]
    )
    wait_for(
        lambda: [j["state"] for j in ledger_entries()] == ["running"] or gang.poll() is not None
    )
    assert gang.poll() is None, gang.communicate()[1]
    report = json.loads(run([*gpuwait_cmd, "status", "--json"]).stdout)
    assert [g["reserved_bytes"] for g in report["gpus"]] == [int(24 * GiB * 0.9), 72 * GiB]
    gang.terminate()


def test_a_share_of_cards_of_different_sizes_is_charged_that_share_of_each(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    # 12 GiB of the 24 GiB card and 40 GiB of the 80 GiB one: once it ends, fair share has
    # charged its user 52 GiB for each second it ran, not twice the big card's 40 GiB.
    sim_file(gpus=2, memory=["24GiB", "80GiB"])
    gang = procs([*gpuwait_cmd, "--vram", "50%", "--gpus", "2", "--", "sleep", "30"])
    wait_for(lambda: [j["state"] for j in ledger_entries()] == ["running"])
    # Half a second of run at least: the record keeps its run time to the millisecond, and a
    # run stopped within a few of its start is rounded by more than the 2 % asked here.
    time.sleep(0.5)
    gang.terminate()
    gang.wait(timeout=30)
    (user,) = json.loads(run([*gpuwait_cmd, "status", "--json"]).stdout)["users"]
    (record,) = recorded_runs()
    assert user["usage_vram_seconds"] == pytest.approx(52 * GiB * record["run_seconds"], rel=0.02)


def test_a_share_of_cards_of_different_sizes_held_unused_is_named_at_that_share(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    procs: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Half of each card, reserved and not used: idle names 12 GiB held on the 24 GiB card
    # (all its owner would free there), not the big card's 40 GiB.
    sim_file(gpus=2, memory=["24GiB", "80GiB"], utilization=0)
    monkeypatch.setenv("GPUWAIT_IDLE_AFTER", "0.5s")
    procs([*gpuwait_cmd, "--vram", "50%", "--gpus", "2", "--", "sleep", "30"])
    wait_for(lambda: [j["state"] for j in ledger_entries()] == ["running"])

    def named() -> dict[int, int]:
        done = run([*gpuwait_cmd, "idle", "--json"])
        assert done.returncode == 0, done.stderr
        return {h["gpu_index"]: h["reserved_bytes"] for h in json.loads(done.stdout)["idle"]}

    def both() -> dict[int, int] | None:
        seen = named()
        return seen if len(seen) == 2 else None

    assert wait_for(both, timeout=15, interval=0.2) == {0: 12 * GiB, 1: 40 * GiB}
