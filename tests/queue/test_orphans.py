"""A gpuwait killed with SIGKILL leaves its command running: the command keeps its room.

The entry records the command's process (pid and start time); it stays, shown as orphaned,
while that process lives, and is reaped when it ends. Real processes throughout: the next job
must wait, and neither command may die of out-of-memory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.crash import gpuwait_killed_at
from helpers.fixtures_sim import SIMJOB, SimFileFactory
from helpers.waiting import asleep_waiting, named_entry, wait_for

from gpuwait.linux import proc as linux_proc
from gpuwait.queue import events as event_log

GPUWAIT = [sys.executable, "-m", "gpuwait"]


def state_dir() -> Path:
    return Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"


def kill_orphan(pid: int, start: int) -> None:
    if linux_proc.is_alive(pid, start):
        os.kill(pid, signal.SIGKILL)


def orphaned(launch: subprocess.Popen[str], name: str) -> tuple[int, int]:
    """Kill `launch`, the gpuwait of job `name`, once its command runs; the command's pid and
    start time."""
    running = wait_for(lambda: (e := named_entry(name)) and e.get("child_pid") and e, timeout=20)
    child = int(running["child_pid"])
    child_start = linux_proc.start_time(child)
    assert child_start is not None
    launch.kill()
    launch.wait(timeout=10)
    return child, child_start


def test_a_killed_gpuwait_does_not_hand_its_commands_room_to_the_next_job(
    sim_file: SimFileFactory,
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One 24 GiB card: two 13 GiB jobs never fit together.
    monkeypatch.setenv("GPUWAIT_SIM", str(sim_file(gpus=1, memory="24G")))
    monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "0.2s")
    first_report, second_report = tmp_path / "first.json", tmp_path / "second.json"
    first = procs(
        [
            *GPUWAIT,
            *("--vram", "13G", "--name", "first", "--"),
            *SIMJOB,
            *("--vram", "13G", "--ramp", "2s", "--hold", "1.5s", "--report", str(first_report)),
        ]
    )
    running = wait_for(lambda: (e := named_entry("first")) and e.get("child_pid") and e, timeout=20)
    child = int(running["child_pid"])
    child_start = linux_proc.start_time(child)
    assert child_start is not None
    try:
        time.sleep(0.5)  # the command is ramping up: a few GiB allocated, most still to come
        first.kill()
        first.wait(timeout=10)
        second = procs(
            [
                *GPUWAIT,
                *("--vram", "13G", "--name", "second", "--"),
                *SIMJOB,
                *("--vram", "13G", "--hold", "0.5s", "--report", str(second_report)),
            ]
        )
        # While the orphaned command runs, its entry holds the room and the next job waits:
        # it has planned with the orphan's entry before it and sleeps in its waiting loop.
        wait_for(lambda: named_entry("second") is not None, timeout=20)
        wait_for(lambda: asleep_waiting(second.pid), timeout=20)
        assert linux_proc.is_alive(child, child_start), "the command must outlive its gpuwait"
        orphan = named_entry("first")
        assert orphan is not None and orphan["state"] == "running"
        assert orphan.get("orphaned_at") is not None
        second_entry = named_entry("second")
        assert second_entry is not None and second_entry["state"] == "waiting"
        status = subprocess.run(
            [*GPUWAIT, "status"], capture_output=True, text=True, timeout=30, check=True
        )
        assert "orphaned" in status.stdout and str(child) in status.stdout

        # The command ends; its entry is reaped and the next job starts, neither out of memory.
        assert second.wait(timeout=60) == 0
    finally:
        kill_orphan(child, child_start)
    assert json.loads(first_report.read_text())["oom"] is False
    assert json.loads(second_report.read_text())["oom"] is False
    assert named_entry("first") is None
    kinds = [e["kind"] for e in event_log.read_events(state_dir()) if e.get("job") == running["id"]]
    assert kinds.index("orphaned") < kinds.index("reap")


def test_an_orphan_is_cancelled_by_signalling_its_command(
    sim_file: SimFileFactory,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUWAIT_SIM", str(sim_file(gpus=1, memory="24G")))
    first = procs(
        [*GPUWAIT, "--vram", "4G", "--name", "long", "--", *SIMJOB, "--vram", "4G", "--hold", "60s"]
    )
    child, child_start = orphaned(first, "long")
    try:
        done = subprocess.run(
            [*GPUWAIT, "cancel", "long"], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
        wait_for(lambda: not linux_proc.is_alive(child, child_start), timeout=20)
        wait_for(
            lambda: (
                subprocess.run([*GPUWAIT, "status"], capture_output=True, timeout=30)
                and named_entry("long") is None
            ),
            timeout=20,
        )
    finally:
        kill_orphan(child, child_start)


def test_an_entry_posing_as_an_orphan_of_any_process_is_neither_kept_nor_obeyed(
    sim_file: SimFileFactory, procs: Callable[..., subprocess.Popen[str]]
) -> None:
    """A forged entry naming one of your processes that gpuwait never started (your shell, an
    editor) as its orphaned command must not hold a GPU, and your `cancel` must not signal it."""
    from gpuwait.queue.entries import RUNNING, Job
    from gpuwait.queue.ledger import Ledger

    sim = sim_file(gpus=1, memory="24G")
    bystander = procs(["sleep", "60"])
    bystander_start = linux_proc.start_time(bystander.pid)
    assert bystander_start is not None
    uuid = json.loads(
        subprocess.run(
            [*GPUWAIT, "status", "--json"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    )["gpus"][0]["uuid"]
    with Ledger(state_dir()).transaction() as data:
        data.jobs.append(
            Job(
                id="forged01",
                name="forged",
                pid=2**22 - 3,  # its "gpuwait": a pid no process has
                start_time=1,
                uid=os.getuid(),
                command=["x"],
                cwd="/",
                request={"bytes": 20 * 2**30},
                state=RUNNING,
                gpu_uuids=[uuid],
                reserved_bytes=20 * 2**30,
                child_pid=bystander.pid,
                child_start_time=bystander_start,
                orphaned_at=time.time(),
            )
        )
    cancel = subprocess.run([*GPUWAIT, "cancel", "forged"], capture_output=True, text=True)
    assert bystander.poll() is None, "cancel signalled a process gpuwait never started"
    assert cancel.returncode != 0
    # The next operation reaps it: a 20 GiB job starts at once.
    done = subprocess.run(
        [*GPUWAIT, "--vram", "20G", "--timeout", "10s", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GPUWAIT_SIM": str(sim)},
    )
    assert done.returncode == 0, done.stderr
    assert named_entry("forged") is None
    assert bystander.poll() is None


def test_a_gpuwait_killed_as_its_command_starts_leaves_the_commands_room_held(
    sim_file: SimFileFactory,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Killed after starting its command and before its entry names it: the command runs on
    # (it has not allocated yet), and the next job must not be given its room.
    monkeypatch.setenv("GPUWAIT_SIM", str(sim_file(gpus=1, memory="24G")))
    first = procs(
        [
            *gpuwait_killed_at("gpuwait.queue.lifecycle", "started"),
            *("--vram", "13G", "--name", "first", "--", "sleep", "60"),
        ]
    )
    assert first.wait(timeout=30) == -signal.SIGKILL
    second = subprocess.run(
        [*GPUWAIT, "--vram", "13G", "--timeout", "0.5s", "--", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode == 124, second.stderr
    orphan = named_entry("first")
    assert orphan is not None and orphan.get("orphaned_at") is not None
    command = int(orphan["child_pid"])
    assert linux_proc.command_line(command) == ["sleep", "60"]
    status = subprocess.run(
        [*GPUWAIT, "status"], capture_output=True, text=True, timeout=30, check=True
    )
    assert "orphaned" in status.stdout and str(command) in status.stdout

    # The command ends: its room is free again.
    os.kill(command, signal.SIGKILL)
    wait_for(lambda: not linux_proc.is_alive(command, orphan["child_start_time"]), timeout=20)
    third = subprocess.run(
        [*GPUWAIT, "--vram", "13G", "--timeout", "5s", "--", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert third.returncode == 0, third.stderr
    assert named_entry("first") is None


def test_the_orphan_of_a_command_started_with_a_large_environment_keeps_its_room(
    sim_file: SimFileFactory,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An environment of more than a megabyte (long module paths, a cluster's settings): the
    job's id, which gpuwait adds at its end, is found there all the same, so the orphan of a
    gpuwait killed with SIGKILL is kept while its command runs, not reaped as forged."""
    monkeypatch.setenv("GPUWAIT_SIM", str(sim_file(gpus=1, memory="24G")))
    for i in range(12):
        monkeypatch.setenv(f"BIG_SETTING_{i}", "x" * 100_000)
    first = procs([*GPUWAIT, "-q", "--vram", "13G", "--name", "first", "--", "sleep", "30"])
    child, child_start = orphaned(first, "first")
    try:
        subprocess.run([*GPUWAIT, "status"], capture_output=True, timeout=30, check=True)
        orphan = named_entry("first")
        assert orphan is not None and orphan.get("orphaned_at") is not None, orphan
    finally:
        kill_orphan(child, child_start)


def _usage_shown() -> float:
    """The fair-share usage `gpuwait status --json` shows for this user (0 without a row)."""
    users = json.loads(
        subprocess.run(
            [*GPUWAIT, "status", "--json"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    )["users"]
    return sum(float(u["usage_vram_seconds"]) for u in users if u["uid"] == os.getuid())


def test_a_job_killed_with_its_gpuwait_is_charged_to_its_users_fair_share(
    sim_file: SimFileFactory, procs: Callable[..., subprocess.Popen[str]]
) -> None:
    """`kill -9` of the whole process group leaves an entry that the next gpuwait reaps: what
    the job held until then is its user's usage, as if it had ended on its own; killing one's
    jobs is no way to run free of fair share."""
    sim_file(gpus=1, memory="24G")
    launched = time.monotonic()
    job = procs([*GPUWAIT, "--vram", "4G", "--name", "killed", "--", "sleep", "60"])
    entry = wait_for(lambda: (e := named_entry("killed")) and e.get("child_pid") and e, timeout=20)
    seen_running = time.monotonic()
    wait_for(lambda: time.monotonic() - seen_running > 0.5, interval=0.05)
    os.killpg(job.pid, signal.SIGKILL)
    killed = time.monotonic()
    job.wait(timeout=10)
    wait_for(lambda: not linux_proc.is_alive(int(entry["child_pid"]), entry["child_start_time"]))
    usage = _usage_shown()
    assert named_entry("killed") is None, "status reaps the entry of the killed job"
    held = 4 * 2**30
    # At least what it held while seen running; at most until it was found gone.
    assert held * (killed - seen_running) <= usage <= held * (time.monotonic() - launched)
    # ... and charged once: the next look finds the same (less a little decay).
    assert _usage_shown() == pytest.approx(usage, rel=0.01)


def test_a_job_killed_with_its_gpuwait_is_in_the_history_and_teaches_nothing(
    sim_file: SimFileFactory, procs: Callable[..., subprocess.Popen[str]]
) -> None:
    """Its run shows in `gpuwait history` as one whose end nobody saw; what was measured of it
    until then (a peak it may not have reached yet, a run cut short) sizes no later run."""
    sim_file(gpus=1, memory="24G")
    command = [*SIMJOB, "--vram", "3G", "--hold", "60s"]
    job = procs([*GPUWAIT, "--vram", "4G", "--name", "cut", "--key", "trainer", "--", *command])
    entry = wait_for(
        lambda: (e := named_entry("cut")) and e.get("observed") and e, timeout=20, interval=0.05
    )
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=10)
    wait_for(lambda: not linux_proc.is_alive(int(entry["child_pid"]), entry["child_start_time"]))
    subprocess.run([*GPUWAIT, "status"], capture_output=True, timeout=30, check=True)  # reaps it
    shown = subprocess.run(
        [*GPUWAIT, "history", "--json"], capture_output=True, text=True, timeout=30, check=True
    )
    (record,) = json.loads(shown.stdout)
    assert record["job_id"] == entry["id"] and record["name"] == "cut"
    assert record["exit_status"] is None and record["signal"] is None and record["lost"] is True
    assert record["reserved_bytes"] == 4 * 2**30 and record["peak_bytes"] > 0
    listed = subprocess.run(
        [*GPUWAIT, "history"], capture_output=True, text=True, timeout=30, check=True
    )
    assert "? lost" in listed.stdout.splitlines()[1]
    # Listed under the --key it was started with, as a run that ended is.
    by_key = subprocess.run(
        [*GPUWAIT, "history", "--key", "trainer", "--json"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert [r["job_id"] for r in json.loads(by_key.stdout)] == [entry["id"]]
    estimate = subprocess.run(
        [*GPUWAIT, "estimate", "--json", "--", *command],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert json.loads(estimate.stdout)["estimate_bytes"] is None


#: A command that writes over its environment's memory, as setproctitle does for vLLM and Ray
#: (a long title spills over the arguments into the environment), then says so and runs on.
_RETITLED = """
import sys
fields = open("/proc/self/stat", "rb").read().rsplit(b")", 1)[1].split()
start, end = int(fields[47]), int(fields[48])
with open("/proc/self/mem", "r+b", buffering=0) as mem:
    mem.seek(start)
    mem.write(b"ray::Worker" + bytes(end - start - 11))
open(sys.argv[1], "w").close()
import time
time.sleep(60)
"""


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_an_orphan_that_wrote_over_its_environment_keeps_its_room(
    sim_file: SimFileFactory,
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
    shared: bool,
) -> None:
    # Known by the job's liveness lock, which its command inherits: in a shared ledger too.
    monkeypatch.setenv("GPUWAIT_SIM", str(sim_file(gpus=1, memory="24G")))
    if shared:
        lab = tmp_path / "lab"
        lab.mkdir()
        lab.chmod(0o1770)
        monkeypatch.setenv("GPUWAIT_LEDGER_DIR", str(lab))
    ready = tmp_path / "ready"
    launch = procs(
        [
            *GPUWAIT,
            *("--vram", "13G", "--name", "titled", "--"),
            *(sys.executable, "-c", _RETITLED, str(ready)),
        ]
    )
    wait_for(ready.exists, timeout=20)
    child, child_start = orphaned(launch, "titled")
    try:
        assert linux_proc.environ_value(child, b"GPUWAIT_JOB_ID") == ""
        status = subprocess.run(
            [*GPUWAIT, "status"], capture_output=True, text=True, timeout=30, check=True
        )
        assert "orphaned" in status.stdout and str(child) in status.stdout
        # Its room is still held: a job that needs it does not start.
        late = subprocess.run(
            [*GPUWAIT, "--vram", "13G", "--timeout", "0.5s", "--", "true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert late.returncode != 0, "the orphan's room was handed out while it ran"
        entry = named_entry("titled")
        assert entry is not None and entry.get("orphaned_at") is not None
        # It is still the job's to cancel.
        cancel = subprocess.run(
            [*GPUWAIT, "cancel", "titled"], capture_output=True, text=True, timeout=30
        )
        assert cancel.returncode == 0, cancel.stderr
        wait_for(lambda: not linux_proc.is_alive(child, child_start), timeout=20)
    finally:
        kill_orphan(child, child_start)
    # Once it has ended, its entry goes.
    wait_for(
        lambda: (
            subprocess.run([*GPUWAIT, "status"], capture_output=True, timeout=30)
            and named_entry("titled") is None
        ),
        timeout=20,
    )
