"""`gpuwait idle` and the idle holders in `status`, on simulated GPUs with real processes."""

from __future__ import annotations

import getpass
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_sim import Run, SimFileFactory, hold_card, start_sim_job
from helpers.waiting import wait_for

from gpuwait.linux import proc

GIB = 2**30
#: Short, so the tests wait seconds and not the hour of the default.
AFTER = 2.0


def idle_now(run_gpuwait: Run) -> list[dict[str, Any]]:
    done = run_gpuwait("idle", "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["schema"] == 1
    holders: list[dict[str, Any]] = document["idle"]
    return holders


def gpu_used(run_gpuwait: Run, index: int) -> int:
    done = run_gpuwait("status", "--json")
    return int(json.loads(done.stdout)["gpus"][index]["used_bytes"])


def test_a_forgotten_process_is_named_once_idle_after_passed_and_a_busy_one_never(
    sim_file: SimFileFactory,
    run_gpuwait: Run,
    sim_jobs: list[subprocess.Popen[str]],
    monkeypatch: Any,
) -> None:
    # GPU 0 does no work, GPU 1 is busy; a process holds 3 GiB on each.
    sim_file(gpus=2, utilization=[0, 90])
    monkeypatch.setenv("GPUWAIT_IDLE_AFTER", f"{AFTER}s")
    forgotten = start_sim_job("--vram", "3G", "--hold", "120s", env={"CUDA_VISIBLE_DEVICES": "0"})
    busy = start_sim_job("--vram", "3G", "--hold", "120s", env={"CUDA_VISIBLE_DEVICES": "1"})
    sim_jobs += [forgotten, busy]
    wait_for(lambda: gpu_used(run_gpuwait, 0) == 3 * GIB and gpu_used(run_gpuwait, 1) == 3 * GIB)
    seen = time.monotonic()

    first = run_gpuwait("idle")
    if time.monotonic() - seen < AFTER:
        # Seen quiet only just now: not idle for long enough yet, but watched.
        assert "No idle VRAM holders" in first.stdout
        assert "Watching 1 more on quiet GPUs" in first.stdout

    time.sleep(max(0.0, AFTER + 0.2 - (time.monotonic() - seen)))
    holders = idle_now(run_gpuwait)
    assert [h["pid"] for h in holders] == [forgotten.pid]
    named = holders[0]
    assert named["gpu_index"] == 0
    assert named["used_bytes"] == 3 * GIB
    assert named["user"] == getpass.getuser()
    assert named["command"][-4:] == ["--vram", "3G", "--hold", "120s"]
    assert named["idle_seconds"] >= AFTER
    assert named["job"] is None

    status = run_gpuwait("status")
    assert status.returncode == 0, status.stderr
    section = status.stdout.split("Idle VRAM holders (1)\n", 1)[1].splitlines()
    assert "USER" in section[0] and "IDLE" in section[0]
    assert f" {forgotten.pid} " in section[1] and "3.0G" in section[1]
    assert str(busy.pid) not in status.stdout.split("Idle VRAM holders")[1]
    listing = run_gpuwait("idle")
    assert listing.returncode == 0
    assert f" {forgotten.pid} " in listing.stdout and f" {busy.pid} " not in listing.stdout


def test_work_on_the_gpu_ends_idleness_and_its_count_starts_again(
    sim_file: SimFileFactory,
    run_gpuwait: Run,
    sim_jobs: list[subprocess.Popen[str]],
    monkeypatch: Any,
) -> None:
    sim_file(gpus=1, utilization=0)
    monkeypatch.setenv("GPUWAIT_IDLE_AFTER", "1s")
    holder = start_sim_job("--vram", "2G", "--hold", "120s")
    sim_jobs.append(holder)
    wait_for(lambda: gpu_used(run_gpuwait, 0) == 2 * GIB)
    time.sleep(1.2)
    assert [h["pid"] for h in idle_now(run_gpuwait)] == [holder.pid]

    sim_file(gpus=1, utilization=60)
    assert idle_now(run_gpuwait) == []
    # Quiet again: idle only from this reading on, not from the first.
    sim_file(gpus=1, utilization=0)
    assert idle_now(run_gpuwait) == []


def test_a_gpuwait_job_holding_memory_idle_is_named_with_its_job(
    sim_file: SimFileFactory,
    run_gpuwait: Run,
    gpuwait_cmd: list[str],
    sim_jobs: list[subprocess.Popen[str]],
    monkeypatch: Any,
) -> None:
    sim_file(gpus=1, utilization=0)
    monkeypatch.setenv("GPUWAIT_IDLE_AFTER", "1s")
    job = hold_card(gpuwait_cmd, "4G", "120s")
    sim_jobs.append(job)
    wait_for(lambda: gpu_used(run_gpuwait, 0) == 4 * GIB)
    time.sleep(1.2)
    holders = wait_for(lambda: idle_now(run_gpuwait))
    jobs = json.loads(run_gpuwait("status", "--json").stdout)["jobs"]
    assert [h["job"] for h in holders] == [jobs[0]["id"]]
    assert "JOB" in run_gpuwait("idle").stdout and jobs[0]["id"] in run_gpuwait("idle").stdout
    # TERM reaches the command through gpuwait (a KILL would leave it holding the pipes).
    job.terminate()
    job.communicate(timeout=30)


def test_small_holdings_are_never_idle_and_bad_settings_are_refused(
    sim_file: SimFileFactory,
    run_gpuwait: Run,
    sim_jobs: list[subprocess.Popen[str]],
    monkeypatch: Any,
) -> None:
    sim_file(gpus=1, utilization=0)
    monkeypatch.setenv("GPUWAIT_IDLE_AFTER", "1s")
    small = start_sim_job("--vram", "512M", "--hold", "120s")
    sim_jobs.append(small)
    wait_for(lambda: gpu_used(run_gpuwait, 0) == GIB // 2)
    time.sleep(1.2)
    assert idle_now(run_gpuwait) == []
    assert "No idle VRAM holders" in run_gpuwait("idle").stdout
    # Under a lower threshold, the same process is idle (the time seen so far counts).
    assert [h["pid"] for h in idle_now_with(run_gpuwait, "256M")] == [small.pid]

    refused = run_gpuwait("idle", env={"GPUWAIT_IDLE_MAX_UTIL": "150%"})
    assert refused.returncode == 2
    assert refused.stderr.startswith("gpuwait: error: ") and "IDLE_MAX_UTIL" in refused.stderr
    assert "Traceback" not in refused.stderr


def idle_now_with(run_gpuwait: Run, min_vram: str) -> list[dict[str, Any]]:
    done = run_gpuwait("idle", "--json", env={"GPUWAIT_IDLE_MIN_VRAM": min_vram})
    assert done.returncode == 0, done.stderr
    holders: list[dict[str, Any]] = json.loads(done.stdout)["idle"]
    return holders


def _watched_holder(
    run_gpuwait: Run, sim_jobs: list[subprocess.Popen[str]]
) -> subprocess.Popen[str]:
    """A process holding 2 GiB on quiet GPU 0, seen by a first reading and not idle yet."""
    holder = start_sim_job("--vram", "2G", "--hold", "120s")
    sim_jobs.append(holder)
    wait_for(lambda: gpu_used(run_gpuwait, 0) == 2 * GIB)
    assert idle_now(run_gpuwait) == []
    return holder


def test_the_evidence_file_of_a_killed_writer_goes_once_it_is_old(
    sim_file: SimFileFactory,
    run_gpuwait: Run,
    sim_jobs: list[subprocess.Popen[str]],
) -> None:
    # The evidence is written without a lock (a reading's hint), so another gpuwait may be
    # writing its temporary file right now: only one older than any write can be a dead one's.
    sim_file(gpus=1, utilization=0)
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    state.mkdir(parents=True)
    dead = state / ".idle.json.999999.tmp"
    writing = state / ".idle.json.999998.tmp"
    for left in (dead, writing):
        left.write_text('{"version": 1, "evid')
    hour_ago = time.time() - 3600
    os.utime(dead, (hour_ago, hour_ago))

    # A process seen holding memory on a quiet GPU is new evidence: the file is written.
    _watched_holder(run_gpuwait, sim_jobs)
    assert json.loads((state / "idle.json").read_text())["evidence"]
    assert not dead.exists()
    assert writing.exists()


#: `gpuwait ARGS` with the wall clock two hours ahead: NTP stepped it since the last reading.
STEPPED = """
import sys, time
real = time.time
time.time = lambda: real() + 7200
from gpuwait.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_wall_clock_stepped_forward_makes_nobody_idle(
    sim_file: SimFileFactory,
    run_gpuwait: Run,
    sim_jobs: list[subprocess.Popen[str]],
) -> None:
    # With idle_after an hour (the default), a process just seen on a quiet GPU is watched;
    # a clock stepped two hours ahead is no two hours of idleness.
    sim_file(gpus=1, utilization=0)
    holder = _watched_holder(run_gpuwait, sim_jobs)
    done = subprocess.run(
        [sys.executable, "-c", STEPPED, "idle", "--json"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["idle"] == [], report
    assert [h["pid"] for h in report["watching"]] == [holder.pid]


#: Evidence that no reading of this boot wrote. Left by an earlier boot: a service started again
#: after a reboot may get the pid and start time (ticks since boot) its predecessor had, and
#: the evidence of that one (seen idle from the start of that boot) is no idleness of this one.
#: Damaged: seen quiet since before the boot (or since for ever), or nested too deeply to read.
DAMAGED_EVIDENCE = {
    "left by an earlier boot": lambda key: {"evidence": {key: 0.0}, "boot": "c0ffee00-earlier"},
    "since for ever": lambda key: {"evidence": {key: -math.inf}},
    "since before the boot": lambda key: {"evidence": {key: -1e308}},
    "nested": lambda key: {"evidence": {key: [[[[[[0.0]]]]]]}, "deep": "DEEP"},
}


@pytest.mark.parametrize("damage", list(DAMAGED_EVIDENCE))
def test_evidence_of_an_earlier_boot_or_damaged_makes_nobody_idle(
    sim_file: SimFileFactory,
    run_gpuwait: Run,
    sim_jobs: list[subprocess.Popen[str]],
    damage: str,
) -> None:
    # The evidence starts again, `status` and `idle` show the rest, and a process just seen is
    # not named idle (with idle_action = pause, a job of it would be asked to step aside).
    sim_file(gpus=1, utilization=0)
    began = proc.boot_clock()
    holder = _watched_holder(run_gpuwait, sim_jobs)
    path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "idle.json"
    found = json.loads(path.read_text())
    (key,) = found["evidence"]
    text = json.dumps({**found, **DAMAGED_EVIDENCE[damage](key)}, allow_nan=True)
    path.write_text(text.replace('"DEEP"', "[" * 100_000 + "]" * 100_000))
    assert "Traceback" not in (status := run_gpuwait("status")).stderr
    assert status.returncode == 0, status.stderr
    done = run_gpuwait("idle", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    (seen,) = [h for h in report["idle"] + report["watching"] if h["pid"] == holder.pid]
    assert 0 <= seen["idle_seconds"] <= proc.boot_clock() - began
