"""Processes NVML lists without a memory figure (usedGpuMemory N/A, as in many containers and
under vGPU): a job's own memory is not counted twice, once as its reservation and once more as
someone else's; memory whose owner cannot be told still counts as taken.

Real pynvml over the fake libnvidia-ml.so.1 (mem=na: NVML_VALUE_NOT_AVAILABLE).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers.fixtures_nvml import GIB, FakeGpu, FakeNvml
from helpers.waiting import ledger_entries, wait_for

GPUWAIT = [sys.executable, "-m", "gpuwait"]


def _job(env: dict[str, str], stop: Path) -> subprocess.Popen[str]:
    """A 10 GiB job that runs until `stop` exists."""
    waiting = f"while [ ! -e {stop} ]; do sleep 0.05; done"
    return subprocess.Popen(
        [*GPUWAIT, "-q", "--vram", "10G", "--", "sh", "-c", waiting],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _started(count: int) -> list[dict[str, object]]:
    """The ledger's entries once `count` jobs run their commands."""
    return wait_for(
        lambda: (
            running
            if len(running := [e for e in ledger_entries() if e.get("child_pid") in e["pids"]])
            == count
            else None
        ),
        timeout=30,
    )


def _gpuwait(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPUWAIT, *args], env=env, capture_output=True, text=True, timeout=60)


def _end(jobs: list[subprocess.Popen[str] | None], stops: list[Path]) -> None:
    """Let every job end, and reap it."""
    for stop in stops:
        stop.touch()
    for p in jobs:
        if p is not None:
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()


def test_a_jobs_own_memory_without_a_figure_leaves_the_rest_of_the_card_free(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    # One 24 GiB card (21.6 GiB usable at safety 0.9). Job A reserved 10 GiB and uses it; NVML
    # lists A's command with no figure. A's 10 GiB was counted as A's reservation and again as
    # memory of someone else's: 1.6 GiB looked free, and B (8G) waited as long as A ran.
    fake_nvml.set_gpus([FakeGpu(uuid="GPU-aaaa", total=24 * GIB)])
    stop = tmp_path / "stop"
    env = {**fake_nvml.env(), "GPUWAIT_SAMPLE_INTERVAL": "0.1s"}
    a = _job(env, stop)
    try:
        (entry,) = _started(1)
        fake_nvml.update_gpu(0, used=10 * GIB)
        fake_nvml.add_process(0, entry["child_pid"], None)
        b = _gpuwait(env, "--vram", "8G", "--timeout", "20s", "--", "true")
        status = _gpuwait(env, "status", "--json")
    finally:
        _end([a], [stop])
    assert b.returncode == 0, b.stderr
    (gpu,) = json.loads(status.stdout)["gpus"]
    assert (gpu["external_bytes"], gpu["reserved_bytes"]) == (0, 10 * GIB)


def test_memory_nobody_is_listed_for_stays_taken_while_a_job_without_a_figure_ramps_up(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    # One 24 GiB card (21.6 GiB usable at safety 0.9) with 8 GiB in use by something NVML lists
    # no process for (a Windows program under WSL, another container's). Job A reserved 10 GiB
    # and has taken 1 GiB so far; NVML lists A's command with no figure. The 9 GiB no figure
    # accounts for were all taken for A's: the stranger's 8 GiB looked free, and B (8G) was
    # admitted into it, to run out of memory with A once A reached its 10 GiB.
    fake_nvml.set_gpus([FakeGpu(uuid="GPU-aaaa", total=24 * GIB, used=8 * GIB)])
    stop = tmp_path / "stop"
    env = {**fake_nvml.env(), "GPUWAIT_SAMPLE_INTERVAL": "0.1s"}
    a = _job(env, stop)
    try:
        (entry,) = _started(1)
        fake_nvml.update_gpu(0, used=9 * GIB)
        fake_nvml.add_process(0, entry["child_pid"], None)
        ramping = _gpuwait(env, "--vram", "8G", "--timeout", "2s", "--", "true")
        # A reached its reservation: 18 GiB in use, 8 of them still the stranger's.
        fake_nvml.update_gpu(0, used=18 * GIB)
        status = _gpuwait(env, "status", "--json")
    finally:
        _end([a], [stop])
    assert ramping.returncode == 124, ramping.stderr
    (gpu,) = json.loads(status.stdout)["gpus"]
    assert (gpu["external_bytes"], gpu["reserved_bytes"]) == (8 * GIB, 10 * GIB)


def test_a_job_admitted_beside_another_without_a_figure_is_counted_once_when_that_one_ends(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    # Job A (10 GiB) runs, NVML listing it with no figure, when job B (10 GiB) is admitted
    # beside it. A ends; B, also listed with no figure, uses its 10 GiB. The 10 GiB A used
    # when B was admitted were written down as B's stranger's, so B's own 10 GiB counted once
    # more as someone else's: 1.6 GiB looked free, and C (8G) waited as long as B ran.
    fake_nvml.set_gpus([FakeGpu(uuid="GPU-aaaa", total=24 * GIB)])
    env = {**fake_nvml.env(), "GPUWAIT_SAMPLE_INTERVAL": "0.1s"}
    stop_a, stop_b = tmp_path / "stop-a", tmp_path / "stop-b"
    a = _job(env, stop_a)
    b = None
    try:
        (entry_a,) = _started(1)
        fake_nvml.add_process(0, entry_a["child_pid"], None)
        fake_nvml.update_gpu(0, used=10 * GIB)
        b = _job(env, stop_b)
        running = _started(2)
        entry_b = next(e for e in running if e["id"] != entry_a["id"])
        stop_a.touch()
        assert a.wait(timeout=60) == 0
        fake_nvml.clear_processes(0)
        fake_nvml.add_process(0, entry_b["child_pid"], None)
        c = _gpuwait(env, "--vram", "8G", "--timeout", "2s", "--", "true")
    finally:
        _end([a, b], [stop_a, stop_b])
    assert c.returncode == 0, c.stderr
