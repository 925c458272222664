"""bench/chaos.py's judge of an out-of-memory: outside memory counts against gpuwait only where
it was there when gpuwait admitted the job, not when the command happened to start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import chaos

GIB = 2**30
OOM_TEXT = "CUDA out of memory. Process {pid} has 8.00 GiB memory in use."


def judge() -> chaos.Chaos:
    """A driver with nothing run, only its judging state."""
    made = chaos.Chaos.__new__(chaos.Chaos)
    made.seed, made.verbose, made.damaged_at = 0, False, 0.0
    made.owners, made.broken, made.log, made.counts = {}, [], [], {}
    return made


def honest_launch(admitted_at: float, command_at: float) -> chaos.Launch:
    """An honest 18 GiB job whose entry the driver saw running (admitted at `admitted_at`)
    and whose command started at `command_at`."""
    launch = chaos.Launch(
        0, [], subprocess.Popen([sys.executable, "-c", ""]), Path("/dev/null"),
        18 * GIB, 18 * GIB, 1, 0, False, False, admitted_at - 5,
    )  # fmt: skip
    launch.proc.wait()
    chaos.note_entry(launch, {"state": "running", "started_at": admitted_at, "pid": 1})
    launch.command_started = command_at
    return launch


def test_outside_memory_taken_after_the_admission_is_not_blamed_on_gpuwait() -> None:
    """Admitted at 100, the command started at 102.5 (a loaded machine), the driver's own
    grab seen at 101: gpuwait could not have seen it, whenever the command started."""
    driver = judge()
    driver.owners[4242] = chaos.Owner("outside", None, seen=101.0)
    driver.judge_oom(honest_launch(100.0, 102.5), OOM_TEXT.format(pid=4242))
    assert driver.broken == []
    assert driver.counts == {"OOM beside outside memory or a liar (legitimate)": 1}


def test_outside_memory_there_before_the_admission_is_over_admission() -> None:
    driver = judge()
    driver.owners[4242] = chaos.Owner("outside", None, seen=97.0)
    driver.judge_oom(honest_launch(100.0, 100.2), OOM_TEXT.format(pid=4242))
    assert len(driver.broken) == 1
    assert "before gpuwait admitted it" in driver.broken[0]


def test_a_job_seen_waiting_again_has_no_admission_until_seen_running() -> None:
    """A paused job queued again: its first admission says nothing of its next one."""
    launch = honest_launch(100.0, 100.2)
    chaos.note_entry(launch, {"state": "waiting", "pid": 1})
    driver = judge()
    driver.owners[4242] = chaos.Owner("outside", None, seen=97.0)
    driver.judge_oom(launch, OOM_TEXT.format(pid=4242))
    assert driver.broken == []
    assert driver.counts == {"OOM beside outside memory, its admission not seen": 1}
    chaos.note_entry(launch, {"state": "running", "started_at": 110.0, "pid": 1})
    assert launch.admitted == 110.0


def test_outside_memory_there_before_the_launch_is_over_admission_though_no_admission_was_seen() -> (
    None
):
    """Admitted and out of memory between two of the driver's looks: its admission came after
    its launch at least, and the outside memory was there before that."""
    launch = honest_launch(100.0, 100.2)  # launched at 95
    chaos.note_entry(launch, {"state": "waiting", "pid": 1})
    driver = judge()
    driver.owners[4242] = chaos.Owner("outside", None, seen=90.0)
    driver.judge_oom(launch, OOM_TEXT.format(pid=4242))
    assert len(driver.broken) == 1
    assert "before gpuwait admitted it" in driver.broken[0]
