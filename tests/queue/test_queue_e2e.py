"""The queue end to end on simulated multi-GPU machines, with real gpuwait processes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_sim import SimFileFactory
from helpers.waiting import (
    asleep_supervising,
    asleep_waiting,
    ledger_entries,
    process_state,
    sleeping_in,
    wait_for,
)

from gpuwait.cli import main
from gpuwait.queue import events as event_log
from gpuwait.queue.bookkeeping import FAILED, OK, Finished
from gpuwait.queue.ledger import Ledger

GiB = 2**30
PRINT_VISIBLE = [sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"]


def state_dir() -> Path:
    return Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"


def job_named(name: str) -> dict[str, Any] | None:
    return next((j for j in ledger_entries() if j.get("name") == name), None)


def events(kind: str | None = None) -> list[dict[str, Any]]:
    return [e for e in event_log.read_events(state_dir()) if kind is None or e["kind"] == kind]


def uuids() -> list[str]:
    from gpuwait.gpu.sim import SimBackend

    return [g.uuid for g in SimBackend(os.environ["GPUWAIT_SIM"]).snapshot().gpus]


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)  # type: ignore[no-any-return]


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters re-read the simulated GPUs often, so GPU changes are seen within the test."""
    monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "0.2s")


def status_json(gpuwait_cmd: list[str]) -> dict[str, Any]:
    done = run([*gpuwait_cmd, "status", "--json"])
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


# --- priorities and holds ---------------------------------------------------------------------


def test_queue_is_served_by_priority_then_submission(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    sim_file(gpus=1)
    holder = procs([*gpuwait_cmd, "--vram", "20G", "--name", "holder", "--", "sleep", "30"])
    wait_for(lambda: job_named("holder") and job_named("holder")["state"] == "running")  # type: ignore[index]
    waiters = {}
    for name, priority in (("low", "1"), ("urgent", "5"), ("normal", "3"), ("urgent2", "5")):
        waiters[name] = procs(
            [
                *gpuwait_cmd,
                "--vram",
                "12G",
                "--priority",
                priority,
                "--name",
                name,
                "--",
                "sleep",
                "0.2",
            ]
        )
        wait_for(lambda name=name: job_named(name))  # type: ignore[misc]
    report = status_json(gpuwait_cmd)
    queue = [j["name"] for j in report["jobs"] if j["state"] == "waiting"]
    assert queue == ["urgent", "urgent2", "normal", "low"]
    assert [j["position"] for j in report["jobs"] if j["state"] == "waiting"] == [1, 2, 3, 4]
    holder.send_signal(signal.SIGTERM)
    for proc in waiters.values():
        assert proc.wait(timeout=30) == 0
    admitted = [e["name"] for e in events("admit") if e["name"] != "holder"]
    assert admitted == ["urgent", "urgent2", "normal", "low"]


def test_gang_gets_all_its_gpus_at_once_in_pci_order(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    sim_file(gpus=3)
    cards = uuids()
    blocker = procs([*gpuwait_cmd, "--vram", "16G", "--devices", "1", "--", "sleep", "30"])
    wait_for(lambda: any(j["state"] == "running" for j in ledger_entries()))
    script = (
        "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['GPUWAIT_GPU_INDICES'])"
    )
    done = run([*gpuwait_cmd, "--gpus", "2", "--vram", "8G", "--", sys.executable, "-c", script])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"{cards[0]},{cards[2]}", "0,2"]
    blocker.terminate()


def test_cancelled_gang_waiter_leaves_no_hold_behind(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    sim_file(gpus=2)
    holders = [
        procs([*gpuwait_cmd, "--vram", "20G", "--devices", str(i), "--", "sleep", "30"])
        for i in (0, 1)
    ]
    wait_for(lambda: [j["state"] for j in ledger_entries()] == ["running", "running"])
    gang = procs([*gpuwait_cmd, "--gpus", "2", "--vram", "12G", "--name", "gang", "--", "true"])
    wait_for(lambda: job_named("gang") and job_named("gang")["held_gpus"])  # type: ignore[index]
    small = procs([*gpuwait_cmd, "--vram", "1G", "--name", "small", "--", "true"])
    wait_for(lambda: job_named("small"))
    report = status_json(gpuwait_cmd)
    gang_id = job_named("gang")["id"]  # type: ignore[index]
    assert [g["held_for"] for g in report["gpus"]] == [gang_id, gang_id]
    waiting = {j["name"]: j["waiting_reason"] for j in report["jobs"] if j["state"] == "waiting"}
    assert "held for job " + gang_id in waiting["small"]

    done = run([*gpuwait_cmd, "cancel", "gang"])
    # It said "cancelled job ID (gang) (it was waiting)", two sets of brackets.
    assert (done.returncode, done.stderr) == (
        0,
        f"gpuwait: cancelled job {gang_id} (gang): it was waiting\n",
    )
    assert gang.wait(timeout=10) == 7
    assert "cancelled" in gang.stderr.read()
    # Nothing holds the GPUs any more: the small job fits beside a holder and runs.
    assert small.wait(timeout=10) == 0
    assert [j["held_gpus"] for j in ledger_entries()] == [[], []]
    assert [e["name"] for e in events("cancel")] == ["gang"]
    for holder in holders:
        holder.terminate()


@pytest.mark.parametrize("wake", ["inotify", "poll"])
def test_a_release_starts_every_waiter_that_now_fits(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    procs: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    wake: str,
) -> None:
    """Woken by the release itself, not by the (here very slow) periodic re-read of the GPUs;
    one waiter's plan starts the other too."""
    monkeypatch.setenv("GPUWAIT_WAKE", wake)
    sim_file(gpus=1)
    holder = procs([*gpuwait_cmd, "--vram", "20G", "--name", "holder", "--", "sleep", "30"])
    wait_for(lambda: job_named("holder") and job_named("holder")["state"] == "running")  # type: ignore[index]
    monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "120s")
    waiters = [
        procs([*gpuwait_cmd, "--vram", "9G", "--name", f"w{n}", "--", "sleep", "0.5"])
        for n in range(2)
    ]
    wait_for(lambda: len(ledger_entries()) == 3)
    # Both have planned (and found no room) and sleep: the release is what must wake them.
    wait_for(
        lambda: all(asleep_waiting(w.pid) for w in waiters),
        timeout=30,
        message=lambda: f"the waiters never slept waiting: {ledger_entries()}",
    )
    released = time.monotonic()
    holder.send_signal(signal.SIGTERM)
    for waiter in waiters:
        assert waiter.wait(timeout=30) == 0
    assert time.monotonic() - released < 20
    admits = [e["name"] for e in events("admit")]
    assert sorted(admits[1:]) == ["w0", "w1"]


def two_waiters_behind_a_holder(
    gpuwait_cmd: list[str], procs: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Any, Any]:
    """On a full GPU (`holder`, 20G, and `anchor` running), `first` (1G, --after anchor) and
    `second` (10G) waiting, both asleep, and nobody reading the GPUs for two minutes:
    (holder, first, second)."""
    holder = procs([*gpuwait_cmd, "--vram", "20G", "--name", "holder", "--", "sleep", "30"])
    procs([*gpuwait_cmd, "--vram", "1M", "--name", "anchor", "--", "sleep", "30"])
    wait_for(lambda: [j["state"] for j in ledger_entries()] == ["running", "running"])
    monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "120s")
    first = procs(
        [*gpuwait_cmd, "--vram", "1G", "--after", "anchor", "--name", "first", "--", "true"]
    )
    wait_for(lambda: job_named("first"))
    second = procs([*gpuwait_cmd, "--vram", "10G", "--name", "second", "--", "true"])
    wait_for(lambda: job_named("second"))
    wait_for(
        lambda: asleep_waiting(first.pid) and asleep_waiting(second.pid),
        timeout=30,
        message=lambda: f"the waiters never slept waiting: {ledger_entries()}",
    )
    return holder, first, second


def test_a_suspended_first_waiter_does_not_hold_up_the_queue(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    procs: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first waiter plans after a release; when it is stopped (Ctrl-Z), the second does."""
    sim_file(gpus=1)
    holder, first, second = two_waiters_behind_a_holder(gpuwait_cmd, procs, monkeypatch)
    # Both have planned and sleep, the second having seen the queue as it stands: after the
    # release it is the second in line, and must stand in for the first, stopped meanwhile.
    first.send_signal(signal.SIGSTOP)
    try:
        holder.send_signal(signal.SIGTERM)
        assert second.wait(timeout=20) == 0
    finally:
        first.send_signal(signal.SIGCONT)


@pytest.mark.parametrize(
    ("first_waiter", "stamped"),
    [
        ("stopped", "in the release's tick"),
        ("stopped", "after the release"),
        ("killed", "in the release's tick"),
    ],
)
def test_the_second_waiter_stands_in_where_the_last_plan_is_stamped_with_the_release(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    procs: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    first_waiter: str,
    stamped: str,
) -> None:
    """The second waiter stands in for the first after a release where the last plan is
    stamped as late as the release: in the same tick of a coarse file system clock (made
    before it, perhaps), or after it by a plan that read the queue before it. The first waiter,
    stopped (Ctrl-Z) or killed since, does not plan; nothing else writes to the ledger (the
    running jobs' gpuwait samples them every ten minutes) and nobody reads the GPUs for two."""
    sim_file(gpus=1)
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "10m")
    holder, first, second = two_waiters_behind_a_holder(gpuwait_cmd, procs, monkeypatch)
    summary = state_dir() / "wake.json"
    released = json.loads(summary.read_text())["release"]
    # Both stopped while the holder ends: the second takes in the release once continued, with
    # the last plan stamped as the test sets it meanwhile.
    for waiter in (first, second):
        waiter.send_signal(signal.SIGSTOP)
        wait_for(lambda w=waiter: process_state(w.pid) == "T")
    try:
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=30) == -signal.SIGTERM
        assert json.loads(summary.read_text())["release"] == released + 1
        if first_waiter == "killed":
            first.kill()
            first.wait(timeout=30)
        written = summary.stat().st_mtime_ns
        at = written if stamped == "in the release's tick" else written + 1_000_000
        os.utime(state_dir() / "plan.stamp", ns=(at, at))
        second.send_signal(signal.SIGCONT)
        assert second.wait(timeout=20) == 0
    finally:
        for waiter in (first, second):
            with contextlib.suppress(ProcessLookupError):
                waiter.send_signal(signal.SIGCONT)


def test_a_suspended_waiter_is_passed_over_until_continued(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    """A waiter stopped with Ctrl-Z takes no room it cannot use: what frees up while it is
    stopped goes to the next waiter, and continued, it starts in its turn."""
    sim_file(gpus=1)
    holder = procs([*gpuwait_cmd, "--vram", "20G", "--name", "holder", "--", "sleep", "30"])
    wait_for(lambda: [j["state"] for j in ledger_entries()] == ["running"])
    first = procs([*gpuwait_cmd, "--vram", "15G", "--name", "first", "--", "true"])
    wait_for(lambda: job_named("first"))
    second = procs([*gpuwait_cmd, "--vram", "10G", "--name", "second", "--", "true"])
    wait_for(lambda: asleep_waiting(first.pid) and asleep_waiting(second.pid), timeout=30)
    first.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: process_state(first.pid) == "T")
        holder.send_signal(signal.SIGTERM)
        # Bare, the first one's plan would have admitted it, stopped, in the room the second
        # needs: the second would wait for as long as the first stays stopped.
        assert second.wait(timeout=10) == 0
        assert job_named("first")["state"] == "waiting"  # type: ignore[index]
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=10) == 0


#: A waiter whose third reading of the GPUs (its second in the wait, once its line is said)
#: is where the terminal's Ctrl-Z lands: outside its sleep and outside the ledger's lock.
STOPPED_READING = r"""
import os, signal, sys
from gpuwait.cli import main
from gpuwait.gpu.sim import SimBackend
read = SimBackend.snapshot
reads = [0]
def snapshot(self):
    reads[0] += 1
    if reads[0] == 3:
        os.kill(os.getpid(), signal.SIGTSTP)
    return read(self)
SimBackend.snapshot = snapshot
sys.exit(main(["--name", "big", "--vram", "20G", "--timeout", "20s", "--", "true"]))
"""


def test_a_waiter_stopped_with_ctrl_z_as_it_reads_the_gpus_says_again_why_it_waits(
    sim_file: SimFileFactory,
) -> None:
    """Ctrl-Z landing while a waiter reads the GPUs (or plans) was acted by the kernel there:
    the waiter did not know it had been stopped, and once continued said nothing more, its
    line behind the shell's `Stopped` and prompt, until what it waits for changed."""
    sim = sim_file(gpus=1, memory="24GiB", base_used="10GiB")
    # A process group of its own, as a job control shell starts a job: the kernel ignores
    # Ctrl-Z in an orphaned group.
    env = {**os.environ, "GPUWAIT_NVML_INTERVAL": "0.2s"}
    waiter = subprocess.Popen(
        [sys.executable, "-c", STOPPED_READING],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        process_group=0,
    )
    try:
        wait_for(lambda: process_state(waiter.pid) == "T", timeout=30)
        time.sleep(0.2)
        waiter.send_signal(signal.SIGCONT)
        # Said again once continued; then the room comes, and the job runs.
        wait_for(lambda: asleep_waiting(waiter.pid), timeout=30)
        sim.write_text(sim.read_text().replace('base_used = "10GiB"', 'base_used = "0GiB"'))
        _, err = waiter.communicate(timeout=30)
    finally:
        waiter.kill()
        waiter.wait()
    assert waiter.returncode == 0, err
    said = "gpuwait[big]: waiting for 20.0 GiB"
    lines = [line for line in err.splitlines() if line.startswith(said)]
    assert len(lines) == 2, err


def test_a_waiter_stopped_with_ctrl_z_as_it_waits_for_the_ledger_lock_stops_at_once(
    sim_file: SimFileFactory,
) -> None:
    """A Ctrl-Z that lands while a waiter waits for the ledger's lock, which another process
    may hold for up to lock_timeout (a minute), stops it there at once, not once the lock is
    had, the terminal's Ctrl-Z doing nothing all that while; continued, it goes on."""
    sim = sim_file(gpus=1, memory="24GiB", base_used="10GiB")
    env = {**os.environ, "GPUWAIT_NVML_INTERVAL": "0.2s"}
    argv = [sys.executable, "-m", "gpuwait", "--name", "big", "--vram", "20G", "--", "true"]
    waiter = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env, process_group=0)
    fd = -1
    try:
        wait_for(lambda: job_named("big") and asleep_waiting(waiter.pid), timeout=30)
        fd = os.open(state_dir() / "ledger.lock", os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        # The room comes: the waiter goes to take it, and waits for the lock held here.
        sim.write_text(sim.read_text().replace('base_used = "10GiB"', 'base_used = "0GiB"'))
        wait_for(lambda: sleeping_in(waiter.pid, "flock"), timeout=30)
        os.killpg(waiter.pid, signal.SIGTSTP)  # Ctrl-Z
        wait_for(lambda: process_state(waiter.pid) == "T", timeout=2)
        os.close(fd)
        fd = -1
        os.killpg(waiter.pid, signal.SIGCONT)
        _, err = waiter.communicate(timeout=30)
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(waiter.pid, signal.SIGKILL)
        waiter.wait()
    assert waiter.returncode == 0, err


# --- GPU health --------------------------------------------------------------------------------


def test_lost_gpu_is_routed_around_and_used_again_when_it_returns(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    procs: Callable[..., Any],
    fast: None,
    tmp_path: Path,
) -> None:
    sim_file(gpus=2)
    cards = uuids()
    job = [*gpuwait_cmd, "sim", "job", "--hold"]
    on_0 = procs(
        [
            *gpuwait_cmd,
            "--vram",
            "10G",
            "--devices",
            "0",
            "--name",
            "on0",
            "--",
            *job,
            "30s",
            "--vram",
            "10G",
        ]
    )
    wait_for(lambda: job_named("on0") and job_named("on0")["observed"])  # type: ignore[index]
    sim_file(gpus=2, lost=[True, False])
    report = status_json(gpuwait_cmd)
    gpu0 = report["gpus"][0]
    on0_id = job_named("on0")["id"]  # type: ignore[index]
    assert (gpu0["index"], gpu0["health"], gpu0["running_jobs"]) == (0, "lost", [on0_id])
    assert gpu0["free_bytes"] is None
    assert next(j for j in report["jobs"] if j["id"] == on0_id)["lost_gpus"] == [cards[0]]
    text = run([*gpuwait_cmd, "status"]).stdout
    assert "LOST" in text and on0_id in text
    # Moments ago is "just now", not "0ms ago".
    assert "ms ago" not in text

    # Best-fit would pick GPU0 (less room left); while it is lost the job goes to GPU1.
    report_file = tmp_path / "moved.json"
    moved = run(
        [
            *gpuwait_cmd,
            "--vram",
            "8G",
            "--",
            *job,
            "0.1s",
            "--vram",
            "8G",
            "--report",
            str(report_file),
        ]
    )
    assert moved.returncode == 0, moved.stderr
    assert json.loads(report_file.read_text())["gpu_index"] == 1

    # GPU1 full, GPU0 lost: a waiter waits, and takes GPU0 when it answers again.
    procs([*gpuwait_cmd, "--vram", "20G", "--devices", "1", "--name", "full1", "--", "sleep", "30"])
    wait_for(lambda: job_named("full1") and job_named("full1")["state"] == "running")  # type: ignore[index]
    later = procs([*gpuwait_cmd, "--vram", "8G", "--name", "later", "--", *PRINT_VISIBLE])
    wait_for(lambda: job_named("later"))
    # It planned with GPU0 lost and GPU1 full, and went to sleep waiting (or, wrongly, ran).
    wait_for(
        lambda: later.poll() is not None or asleep_waiting(later.pid),
        timeout=30,
        message=lambda: f"the waiter never slept waiting: {ledger_entries()}",
    )
    assert later.poll() is None
    sim_file(gpus=2, lost=[False, False])
    assert later.wait(timeout=15) == 0
    assert later.stdout.read().strip() == cards[0]
    kinds = [(e["kind"], e["index"]) for e in events() if e["kind"].startswith("gpu_")]
    assert kinds == [("gpu_lost", 0), ("gpu_back", 0)]
    on_0.terminate()


def test_gpu_loss_is_logged_while_jobs_run_and_nobody_waits(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    sim_file(gpus=2)
    job = procs([*gpuwait_cmd, "--vram", "1G", "--devices", "0", "--", "sleep", "30"])
    wait_for(lambda: any(j["state"] == "running" for j in ledger_entries()))
    # Past its first sample: the GPUs answering then are those whose loss a later one notices.
    wait_for(
        lambda: asleep_supervising(job.pid),
        timeout=30,
        message=lambda: f"the job never sampled its command: {ledger_entries()}",
    )
    sim_file(gpus=2, lost=[False, True])
    wait_for(lambda: events("gpu_lost"), timeout=15)
    assert [e["index"] for e in events("gpu_lost")] == [1]


def test_switching_simulation_files_loses_no_gpu(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """A user who tries one simulation file, then another, then the first again has lost no
    GPU: `status` lists the GPUs of the file in use, none LOST, and the log says nothing."""
    first = sim_file(gpus=2, file=tmp_path / "first.toml")
    second = sim_file(gpus=3, file=tmp_path / "second.toml")
    for path, count in ((first, 2), (second, 3), (first, 2), (second, 3)):
        env = {**os.environ, "GPUWAIT_SIM": str(path)}
        done = run([*gpuwait_cmd, "--vram", "1G", "--", "true"], env=env)
        assert done.returncode == 0, done.stderr
        report = json.loads(run([*gpuwait_cmd, "status", "--json"], env=env).stdout)
        assert [(g["index"], g["health"]) for g in report["gpus"]] == [
            (i, "ok") for i in range(count)
        ], f"with {path.name}"
        assert "LOST" not in run([*gpuwait_cmd, "status"], env=env).stdout
    assert not [e for e in events() if e["kind"].startswith("gpu_")]


def test_hot_added_gpu_is_used(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any], fast: None
) -> None:
    sim_file(gpus=1)
    procs([*gpuwait_cmd, "--vram", "20G", "--name", "full", "--", "sleep", "30"])
    wait_for(lambda: job_named("full") and job_named("full")["state"] == "running")  # type: ignore[index]
    waiter = procs([*gpuwait_cmd, "--vram", "8G", "--", *PRINT_VISIBLE])
    wait_for(lambda: len(ledger_entries()) == 2)
    sim_file(gpus=2)
    assert waiter.wait(timeout=15) == 0
    assert waiter.stdout.read().strip() == uuids()[1]
    assert [e["index"] for e in events("gpu_added")] == [1]


# --- dependencies, exclusive, batches ------------------------------------------------------------


def test_after_waits_for_the_end_and_after_ok_for_success(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    sim_file(gpus=1)
    first = procs(
        [*gpuwait_cmd, "--vram", "1G", "--name", "prep", "--", "sh", "-c", "sleep 1; exit 3"]
    )
    wait_for(lambda: job_named("prep"))
    after = procs(
        [*gpuwait_cmd, "--vram", "1G", "--after", "prep", "--name", "dep", "--", "echo", "went"]
    )
    after_ok = procs([*gpuwait_cmd, "--vram", "1G", "--after-ok", "prep", "--", "echo", "went"])
    wait_for(lambda: len(ledger_entries()) == 3)
    report = status_json(gpuwait_cmd)
    reasons = [j["waiting_reason"] for j in report["jobs"] if j["state"] == "waiting"]
    assert all("waiting for job " in r and "(prep) to finish" in r for r in reasons)
    assert first.wait(timeout=20) == 3
    assert after.wait(timeout=20) == 0 and after.stdout.read() == "went\n"
    assert after_ok.wait(timeout=20) == 6
    assert "failed with exit status 3" in after_ok.stderr.read()
    order = [(e["kind"], e.get("name")) for e in events()]
    assert order.index(("finish", "prep")) < order.index(("admit", "dep"))
    # A dependency that already succeeded is met at once (from the ledger's record).
    assert run([*gpuwait_cmd, "--vram", "1G", "--name", "ok1", "--", "true"]).returncode == 0
    done = run([*gpuwait_cmd, "--vram", "1G", "--after-ok", "ok1", "--", "echo", "fine"])
    assert (done.returncode, done.stdout) == (0, "fine\n")


def test_exclusive_keeps_everyone_else_off_its_gpu(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    sim_file(gpus=1)
    procs([*gpuwait_cmd, "--exclusive", "--name", "whole", "--", "sleep", "30"])
    wait_for(lambda: job_named("whole") and job_named("whole")["state"] == "running")  # type: ignore[index]
    done = run([*gpuwait_cmd, "--vram", "1G", "--timeout", "1s", "--", "true"])
    assert done.returncode == 124 and "a whole" not in done.stderr


def test_batch_progress_in_status(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    sim_file(gpus=1)
    for code in (0, 0, 1):
        done = run(
            [*gpuwait_cmd, "--vram", "1G", "--batch", "sweep", "--", "sh", "-c", f"exit {code}"]
        )
        assert done.returncode == code
    procs([*gpuwait_cmd, "--vram", "20G", "--batch", "sweep", "--", "sleep", "30"])
    wait_for(lambda: any(j["state"] == "running" for j in ledger_entries()))
    procs([*gpuwait_cmd, "--vram", "20G", "--batch", "sweep", "--", "true"])
    wait_for(lambda: len(ledger_entries()) == 2)
    (batch,) = status_json(gpuwait_cmd)["batches"]
    # When its last job ended: the third of the runs above.
    assert time.time() - 60 < batch.pop("ended_at") <= time.time()
    assert batch == {
        "name": "sweep",
        "done": 2,
        "running": 1,
        "waiting": 1,
        "failed": 1,
        "cancelled": 0,
        "total": 5,
    }
    assert (
        "sweep                2/5 done, 1 running, 1 waiting, 1 failed"
        in run([*gpuwait_cmd, "status"]).stdout
    )


def test_a_cancelled_batch_counts_its_running_jobs_as_cancelled_not_failed(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    """`gpuwait cancel --batch` of a sweep with jobs running: their commands end by the TERM
    it sends, and status counted them as failed, as though the user's code had crashed."""
    sim_file(gpus=1)
    running = [
        procs([*gpuwait_cmd, "--vram", "3G", "--batch", "sweep", "--", "sleep", "30"])
        for _ in range(2)
    ]
    wait_for(lambda: sum(j["state"] == "running" for j in ledger_entries()) == 2)
    waiting = procs([*gpuwait_cmd, "--vram", "20G", "--batch", "sweep", "--", "true"])
    wait_for(lambda: len(ledger_entries()) == 3)
    assert run([*gpuwait_cmd, "cancel", "--batch", "sweep"]).returncode == 0
    assert [p.wait(timeout=20) for p in running] == [-signal.SIGTERM] * 2
    assert waiting.wait(timeout=20) == 7
    (batch,) = status_json(gpuwait_cmd)["batches"]
    assert (batch["done"], batch["failed"], batch["cancelled"]) == (0, 0, 3)
    assert "0/3 done, 0 running, 0 waiting, 0 failed, 3 cancelled" in (
        run([*gpuwait_cmd, "status"]).stdout
    )
    finishes = events("finish")
    assert [(e["outcome"], e["signal"]) for e in finishes] == [("cancelled", 15)] * 2
    # The docs: a job --after-ok a batch that was cancelled never starts (exit 6).
    after = run([*gpuwait_cmd, "--vram", "1G", "--after-ok", "sweep", "--", "echo", "went"])
    assert after.returncode == 6 and "was cancelled" in after.stderr, after.stderr


# --- capability requests and the ignore list -----------------------------------------------------


def test_capability_requests_choose_the_gpu(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], fast: None
) -> None:
    sim_file(
        gpus=2,
        memory=["24GiB", "80GiB"],
        name=["Sim RTX 3090", "Sim A100-SXM4-80GB"],
        compute_capability=["8.6", "8.0"],
        utilization=[90, 10],
    )
    cards = uuids()
    for option, expected in (
        (["--gpu-name", "a100"], cards[1]),
        (["--gpu-name", "*3090"], cards[0]),
        (["--min-total-vram", "40G"], cards[1]),
        (["--min-compute-capability", "8.6"], cards[0]),
        (["--max-util", "50"], cards[1]),
        (["--max-util", "95%", "--pick", "most-free"], cards[1]),
    ):
        done = run([*gpuwait_cmd, "--vram", "1G", *option, "--", *PRINT_VISIBLE])
        assert (done.returncode, done.stdout.strip()) == (0, expected), (option, done.stderr)
    for option, message in (
        (["--gpu-name", "H100"], "no GPU has a name matching 'H100'"),
        (["--min-compute-capability", "9.0"], "compute capability 9.0 or more"),
        (["--gpus", "2", "--gpu-name", "A100"], "2 GPUs wanted but only 1 match"),
    ):
        done = run([*gpuwait_cmd, "--vram", "1G", *option, "--", "true"])
        assert done.returncode == 3 and message in done.stderr, (option, done.stderr)


def test_a_max_util_job_takes_its_first_readings_quickly_whatever_nvml_interval(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Three readings, 0.2 s apart, tell that the card is quiet: the job starts then, rather
    # than once its own plan is due again (about an nvml_interval apart: 5 s here, 1 s by default).
    sim_file(gpus=1, utilization=10)
    monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "5s")
    began = time.monotonic()
    done = run([*gpuwait_cmd, "--vram", "1G", "--max-util", "50", "--", "true"])
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - began < 4.0, done.stderr


def test_a_waiter_logging_to_a_file_says_so_once_every_gpu_is_found_too_busy(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    procs: Callable[..., Any],
    tmp_path: Path,
) -> None:
    # Its stderr in a file (cron, nohup, `2> run.log`), a --max-util job on a card kept 90 %
    # busy wrote "measuring utilization for the 30% cap (a few readings)" and nothing more,
    # however long it waited, while `gpuwait status` said why it waited: a line is written
    # where the situation changes, and the note was no part of it.
    sim_file(gpus=1, utilization=90)
    log = tmp_path / "run.log"
    with log.open("w") as stderr:
        procs(
            [*gpuwait_cmd, "--vram", "1G", "--max-util", "30", "--", "true"],
            stderr=stderr,
            stdout=subprocess.DEVNULL,
        )
    wait_for(
        lambda: "every candidate is busier than 30% utilization" in log.read_text(),
        timeout=30,
        message=lambda: f"the log never said why: {log.read_text()!r}",
    )


def test_processes_on_the_ignore_list_are_not_load(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    procs: Callable[..., Any],
    tmp_path: Path,
    isolated_dirs: Path,
) -> None:
    sim_file(gpus=1)
    # A simulated CUDA process whose command name is "Xorg", holding 2 GiB (over 5 % of the card).
    xorg = tmp_path / "Xorg"
    xorg.symlink_to(os.path.realpath(sys.executable))
    code = "import sys; from gpuwait.gpu.simjob import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    procs([str(xorg), "-c", code, "--vram", "2G", "--hold", "30s"], env=env)
    wait_for(lambda: status_json(gpuwait_cmd)["gpus"][0]["used_bytes"] == 2 * GiB)
    report = status_json(gpuwait_cmd)["gpus"][0]
    assert (report["external_bytes"], report["ignored_bytes"]) == (2 * GiB, 2 * GiB)
    done = run([*gpuwait_cmd, "--exclusive", "--", "true"])
    assert done.returncode == 0, done.stderr
    config = isolated_dirs / "config" / "gpuwait" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("ignore_processes = []\n")
    done = run([*gpuwait_cmd, "--exclusive", "--timeout", "1s", "--", "true"])
    assert done.returncode == 124 and "a whole GPU" in done.stderr


# --- cancel, log, status ---------------------------------------------------------------------


def test_a_command_with_many_or_long_arguments_keeps_its_entry(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    """`xargs gpuwait ... python process.py` hands a job thousands of file names: its entry was
    written with the whole command, which every later read refused (more than 1024 arguments,
    or one of more than 4096 characters) and dropped. The running job vanished from the queue
    (its room free for anyone), and each change warned of a damaged ledger. Its entry now keeps
    the command cut to those bounds."""
    sim_file(gpus=1)
    status = " ".join(shlex.quote(a) for a in [*gpuwait_cmd, "status", "--json"])
    done = run(
        [*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", status, "sh", *["f"] * 1100, "x" * 5000]
    )
    assert done.returncode == 0, done.stderr
    assert "dropped" not in done.stderr and "damaged" not in done.stderr, done.stderr
    (job,) = json.loads(done.stdout)["jobs"]
    assert job["state"] == "running"
    assert job["command"][:3] == ["sh", "-c", status]


def test_cancel_running_job_terminates_it(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    sim_file(gpus=1)
    running = procs([*gpuwait_cmd, "--vram", "1G", "--name", "r", "--", "sleep", "30"])
    wait_for(lambda: job_named("r") and job_named("r")["child_pid"])  # type: ignore[index]
    r_id = job_named("r")["id"]  # type: ignore[index]
    done = run([*gpuwait_cmd, "cancel", "r"])
    assert (done.returncode, done.stderr) == (
        0,
        f"gpuwait: sent TERM to job {r_id} (r): it was running\n",
    )
    assert running.wait(timeout=10) == -signal.SIGTERM
    finish = events("finish")[-1]
    assert (finish["name"], finish["outcome"], finish["signal"]) == ("r", "cancelled", 15)
    missing = run([*gpuwait_cmd, "cancel", "r", "nosuch"])
    assert missing.returncode == 2 and "no waiting or running job matches nosuch" in missing.stderr


def test_a_cancelled_waiter_leaves_without_waiting_for_the_ledger_lock(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    """`gpuwait cancel --batch` of a sweep's hundred waiters returned in seconds, but the
    waiters left one by one, each reading the GPUs and planning the whole queue under the
    lock only to learn it was cancelled: the last went a minute and a half later. A waiter
    learns of its cancellation from a read of the ledger without the lock, so here it leaves
    while another process holds the lock."""
    sim_file(gpus=1)
    procs([*gpuwait_cmd, "--vram", "20G", "--name", "holder", "--", "sleep", "30"])
    wait_for(lambda: job_named("holder") and job_named("holder")["state"] == "running")  # type: ignore[index]
    waiter = procs([*gpuwait_cmd, "--vram", "12G", "--name", "w", "--", "true"])
    wait_for(lambda: job_named("w") and asleep_waiting(waiter.pid))
    os.kill(waiter.pid, signal.SIGSTOP)
    try:
        assert run([*gpuwait_cmd, "cancel", "w"]).returncode == 0
        fd = os.open(state_dir() / "ledger.lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.kill(waiter.pid, signal.SIGCONT)
            assert waiter.wait(timeout=1.5) == 7
        finally:
            os.close(fd)
    finally:
        if waiter.poll() is None:
            os.kill(waiter.pid, signal.SIGCONT)


def test_cancel_of_a_job_suspended_with_ctrl_z_ends_it(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    """A job left stopped in some terminal (Ctrl-Z) would get TERM only once continued, and
    keep its GPU memory until then: `cancel` continues it, so the TERM ends it, as bash's
    `kill %1` does a stopped job."""
    sim_file(gpus=1)
    with _job_of_a_shell([*gpuwait_cmd, "--vram", "1G", "--name", "r", "--", "sleep", "30"]) as job:
        wait_for(lambda: job_named("r") and job_named("r")["child_pid"])  # type: ignore[index]
        command = job_named("r")["child_pid"]  # type: ignore[index]
        os.killpg(job.pid, signal.SIGTSTP)  # Ctrl-Z
        wait_for(lambda: process_state(job.pid) == "T" and process_state(command) == "T")
        assert run([*gpuwait_cmd, "cancel", "r"]).returncode == 0
        assert job.wait(timeout=10) == -signal.SIGTERM
    assert ledger_entries() == []


@contextlib.contextmanager
def _job_of_a_shell(argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    """`argv` started as a job control shell's job: its own process group, whose parent is in
    another group of the session (the kernel ignores Ctrl-Z in an orphaned group); the group
    killed at the end."""
    job = subprocess.Popen(argv, process_group=0, stderr=subprocess.DEVNULL)
    try:
        yield job
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)


def test_a_job_stopped_with_ctrl_z_is_not_stopped_again_when_gpuwait_alone_is_continued(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """Ctrl-Z stops gpuwait and its command together (a command that tidies up first and then
    stops itself, as ssh and editors do, a moment after gpuwait); the command's stop is that
    same one, not one of its own: gpuwait continued before it (`cancel`, which continues each
    process of the job in turn; `kill -CONT PID`) goes on with its command, rather than stopping
    the job again and staying stopped, the TERM it was sent untaken."""
    sim_file(gpus=1)
    ready = tmp_path / "ready"
    command = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTSTP, lambda *_: (time.sleep(0.1), os.kill(os.getpid(), 19)))\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(30)\n"
    )
    argv = [*gpuwait_cmd, "--vram", "1G", "--name", "r", "--", sys.executable, "-c", command]
    with _job_of_a_shell(argv) as job:
        wait_for(ready.exists, timeout=20)
        child = wait_for(lambda: (e := job_named("r")) and e["child_pid"])
        os.killpg(job.pid, signal.SIGTSTP)  # Ctrl-Z
        wait_for(lambda: process_state(job.pid) == "T" and process_state(child) == "T")
        os.kill(job.pid, signal.SIGCONT)
        wait_for(
            lambda: sleeping_in(job.pid, "sigtimedwait"),
            timeout=5,
            message=lambda: f"gpuwait is in state {process_state(job.pid)}",
        )
        # Continued by its pid, gpuwait goes on with its command, as the command bare would.
        wait_for(lambda: process_state(child) != "T", timeout=5)
        assert run([*gpuwait_cmd, "cancel", "r"]).returncode == 0
        assert job.wait(timeout=10) == -signal.SIGTERM


def test_log_shows_and_follows_events(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    sim_file(gpus=1)
    assert run([*gpuwait_cmd, "--vram", "1G", "--name", "one", "--", "true"]).returncode == 0
    text = run([*gpuwait_cmd, "log"]).stdout.splitlines()
    assert [line.split()[2] for line in text] == ["submit", "admit", "start", "finish"]
    assert "one" in text[-1] and "ok, exit 0" in text[-1]
    follower = procs([*gpuwait_cmd, "log", "-f", "-n", "0", "--json"])
    # Following: it took the end of the log as its start, and sleeps between two looks at it.
    wait_for(
        lambda: follower.poll() is not None or sleeping_in(follower.pid, "nanosleep"),
        timeout=30,
        message="gpuwait log -f never started following",
    )
    assert follower.poll() is None
    assert run([*gpuwait_cmd, "--vram", "1G", "--name", "two", "--", "true"]).returncode == 0
    seen = []
    while not seen or seen[-1]["kind"] != "finish":
        seen.append(json.loads(follower.stdout.readline()))
    assert [e["kind"] for e in seen] == ["submit", "admit", "start", "finish"]
    assert {e["name"] for e in seen} == {"two"}
    follower.send_signal(signal.SIGINT)
    assert follower.wait(timeout=10) == 0


@pytest.mark.parametrize(("count", "lines", "shown"), [(13, 20, 13), (13, 10, 10), (3, 3, 3)])
def test_log_shows_the_last_n_events_or_all_if_fewer(
    capsys: pytest.CaptureFixture[str], count: int, lines: int, shown: int
) -> None:
    for n in range(count):
        event_log.emit(state_dir(), "submit", job=f"{n:08x}", priority=3, command=["true"])
    assert main(["log", "-n", str(lines)]) == 0
    jobs = [line.split()[3] for line in capsys.readouterr().out.splitlines()]
    assert jobs == [f"{n:08x}" for n in range(count - shown, count)]


def _log_shown(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[list[str], float]:
    """The jobs `gpuwait log ARGS` shows, and how long it took."""
    started = time.perf_counter()
    assert main(["log", *args]) == 0
    took = time.perf_counter() - started
    return [line.split()[3] for line in capsys.readouterr().out.splitlines()], took


def test_a_line_nested_too_deeply_to_read_is_skipped_as_any_other_damaged_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # An editor's or a disk's damage, nested thousands deep: `gpuwait log` ended in a traceback.
    directory = state_dir()
    event_log.emit(directory, "submit", job="0000000a", priority=3, command=["true"])
    with event_log.events_path(directory).open("a") as log:
        log.write("[" * 100_000 + "]" * 100_000 + "\n")
    event_log.emit(directory, "submit", job="0000000b", priority=3, command=["true"])
    assert _log_shown(capsys)[0] == ["0000000a", "0000000b"]
    assert _log_shown(capsys, "--job", "0000000b")[0] == ["0000000b"]


def test_the_last_events_of_a_long_log_show_as_fast_as_those_of_a_short_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A busy machine fills the log and its three rotated files (16 MiB, some 60,000 events).
    directory = state_dir()
    for n in range(30):
        event_log.emit(directory, "submit", job=f"{n:08x}", priority=3, command=["true"])
    lines = event_log.events_path(directory).read_bytes().splitlines(keepends=True)
    recent, took_short = _log_shown(capsys, "-n", "20")
    assert recent == [f"{n:08x}" for n in range(10, 30)]
    older = b"".join(lines[:10])
    path = event_log.events_path(directory)
    for number in range(event_log.KEEP, 0, -1):
        rotated = path.with_name(f"{path.name}.{number}")
        rotated.write_bytes(older * (event_log.MAX_BYTES // len(older)))
        rotated.chmod(0o600)
    # The newest file has just been rotated: the last events span two files.
    path.write_bytes(b"".join(lines[20:]))
    shown, took_long = _log_shown(capsys, "-n", "20")
    assert shown == [f"{n:08x}" for n in range(10)] + [f"{n:08x}" for n in range(20, 30)]
    assert took_long < 5 * took_short + 0.1, (took_long, took_short)
    # --job still finds a job's events in the oldest file.
    assert _log_shown(capsys, "-n", "1", "--job", f"{0:08x}")[0] == [f"{0:08x}"]


def test_event_log_rotates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(event_log, "MAX_BYTES", 2000)
    for n in range(200):
        event_log.emit(tmp_path, "submit", job=f"{n:08x}")
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("events.jsonl"))
    assert names == ["events.jsonl", "events.jsonl.1", "events.jsonl.2", "events.jsonl.3"]
    kept = [e["job"] for e in event_log.read_events(tmp_path)]
    assert kept == sorted(kept) and kept[-1] == f"{199:08x}" and len(kept) < 200


def test_a_launch_goes_on_while_another_process_keeps_the_event_logs_lock(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # The log past its size is rotated under events.lock; kept by another process (stopped
    # as it rotated), every launch waited for it at its first event, for ever.
    log = event_log.events_path(state_dir())
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        f.truncate(event_log.MAX_BYTES + 1)
    fd = os.open(log.with_name("events.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        done = subprocess.run(
            [*gpuwait_cmd, "-q", "--vram", "1G", "--", "true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        os.close(fd)
    assert done.returncode == 0, done.stderr
    assert [e["kind"] for e in event_log.read_events(state_dir())][-1] == "finish"


# The status JSON, schema 2, as docs/queue-and-status.md documents it: key -> type(s).
OPT_INT = (int, type(None))
OPT_FLOAT = (int, float, type(None))
OPT_STR = (str, type(None))
STATUS_KEYS = {
    "schema": int,
    "generated_at": float,
    "backend": OPT_STR,
    "backend_error": OPT_STR,
    "backend_hint": OPT_STR,
    "safety": float,
    "ledger_created_at": float,
    "warnings": list,
    "gpus": list,
    "jobs": list,
    "batches": list,
    "users": list,
    "fair_share": dict,
    "ledger_shared": bool,
    "idle": list,
    "idle_watching": list,
    "visible_from": OPT_STR,
    "slurm_gave_no_gpu": OPT_STR,
}
GPU_KEYS = {
    "index": int,
    "uuid": str,
    "name": str,
    "total_bytes": int,
    "health": str,
    "health_since": OPT_FLOAT,
    "health_detail": OPT_STR,
    "used_bytes": OPT_INT,
    "external_bytes": OPT_INT,
    "driver_bytes": OPT_INT,
    "ignored_bytes": OPT_INT,
    "reserved_bytes": OPT_INT,
    "free_bytes": OPT_INT,
    "utilization_pct": OPT_INT,
    "compute_capability": OPT_STR,
    "per_process": (bool, type(None)),
    "compute_mode": OPT_STR,
    "running_jobs": list,
    "held_for": OPT_STR,
    "counters": dict,
    "visible_here": (bool, type(None)),
}
COUNTER_KEYS = {
    "dispatched": int,
    "completed": int,
    "failed": int,
    "oom": int,
    "throughput_per_hour": OPT_FLOAT,
}
JOB_KEYS = {
    "id": str,
    "name": OPT_STR,
    "batch": OPT_STR,
    "state": str,
    "position": OPT_INT,
    "pid": int,
    "uid": int,
    "command": list,
    "cwd": str,
    "priority": int,
    "queued_priority": int,
    "pauses": int,
    "request": dict,
    "exclusive": bool,
    "gpus": int,
    "gpu_uuids": list,
    "gpu_indices": list,
    "lost_gpus": list,
    "reserved_bytes": int,
    "reserved_by_gpu_bytes": list,
    "observed_bytes": int,
    "submitted_at": float,
    "started_at": OPT_FLOAT,
    "elapsed_seconds": OPT_FLOAT,
    "expected_remaining_seconds": OPT_FLOAT,
    "expected_seconds": OPT_FLOAT,
    "waiting_reason": OPT_STR,
    "blocked": OPT_STR,
    "eta_seconds": OPT_FLOAT,
    "held_gpus": list,
    "after": list,
    "after_ok": list,
    "requirements": dict,
    "child_pid": OPT_INT,
    "orphaned": bool,
    "other_pid_namespace": bool,
    "pause_asked_by": (dict, type(None)),
    "overuse": (dict, type(None)),
    "held_by": list,
    "once": OPT_STR,
    "prefer": list,
    "frozen": (dict, type(None)),
}
BATCH_KEYS = {
    "name": str,
    "done": int,
    "running": int,
    "waiting": int,
    "failed": int,
    "cancelled": int,
    "total": int,
    "ended_at": OPT_FLOAT,
}


def check_keys(entry: dict[str, Any], spec: dict[str, Any], where: str) -> None:
    assert set(entry) == set(spec), (where, set(entry) ^ set(spec))
    for key, kinds in spec.items():
        assert isinstance(entry[key], kinds), (where, key, entry[key])


def test_status_json_schema(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    sim_file(gpus=2)
    report = status_json(gpuwait_cmd)
    check_keys(report, STATUS_KEYS, "empty")
    assert report["schema"] == 2 and report["jobs"] == [] and len(report["gpus"]) == 2
    assert run([*gpuwait_cmd, "--vram", "1G", "--batch", "b", "--", "true"]).returncode == 0
    procs([*gpuwait_cmd, "--vram", "20G", "--devices", "0", "--batch", "b", "--", "sleep", "30"])
    wait_for(lambda: any(j["state"] == "running" for j in ledger_entries()))
    procs([*gpuwait_cmd, "--vram", "20G", "--devices", "0", "--name", "w", "--", "true"])
    wait_for(lambda: len(ledger_entries()) == 2)
    sim_file(gpus=2, lost=[False, True])
    report = status_json(gpuwait_cmd)
    check_keys(report, STATUS_KEYS, "report")
    for gpu in report["gpus"]:
        check_keys(gpu, GPU_KEYS, f"gpu {gpu['index']}")
        check_keys(gpu["counters"], COUNTER_KEYS, "counters")
    assert [g["health"] for g in report["gpus"]] == ["ok", "lost"]
    assert report["gpus"][0]["counters"]["completed"] == 1
    for job in report["jobs"]:
        check_keys(job, JOB_KEYS, job["id"])
    assert [j["state"] for j in report["jobs"]] == ["running", "waiting"]
    for batch in report["batches"]:
        check_keys(batch, BATCH_KEYS, batch["name"])


def test_status_text_fits_80_columns(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    sim_file(gpus=2, name="A Simulated GPU With A Very Long Marketing Name")
    long_command = ["sh", "-c", "exec sleep 30", "x" * 200]
    procs([*gpuwait_cmd, "--vram", "20G", "--name", "a-rather-long-job-name", "--", *long_command])
    procs([*gpuwait_cmd, "--vram", "20G", "--name", "b", "--", *long_command])
    wait_for(lambda: len([j for j in ledger_entries() if j["state"] == "running"]) == 2)
    procs(
        [
            *gpuwait_cmd,
            "--vram",
            "20G",
            "--gpus",
            "2",
            "--batch",
            "sweep-with-a-long-name",
            "--",
            *long_command,
        ]
    )
    wait_for(lambda: len(ledger_entries()) == 3)
    text = run([*gpuwait_cmd, "status"], env={**os.environ, "COLUMNS": "80"}).stdout
    assert "Running (2)" in text and "Queue (1)" in text and "Batches (1)" in text
    assert max(len(line) for line in text.splitlines()) <= 80, text
    # Rows are cut only where a column is long (names, commands), not in the middle of figures.
    assert text.rstrip().endswith("1 waiting, 0 failed"), text


def test_status_shows_batch_names_whole_where_the_line_has_room(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    sim_file(gpus=1)
    # Two batches that differ only after the 20th character must stay apart at 80 columns.
    for month in ("11", "12"):
        batch = f"transcriptions-2026-{month}"
        assert run([*gpuwait_cmd, "--vram", "1G", "--batch", batch, "--", "true"]).returncode == 0
    text = run([*gpuwait_cmd, "status"], env={**os.environ, "COLUMNS": "80"}).stdout
    assert " transcriptions-2026-11 1/1 done" in text and " transcriptions-2026-12 1/1 done" in text
    assert max(len(line) for line in text.splitlines()) <= 80, text


def test_status_after_months_of_nightly_batches_shows_the_latest_not_a_hundred_lines(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A cron job run each night with `--batch nightly-$(date +%F)`: the ledger remembers the
    last hundred batches, and `status` showed every one of them, a line each, idle queue or
    not. It shows the batches with jobs in the queue and those that ended last."""
    sim_file(gpus=1)
    day = 86400.0
    first = time.time() - 120 * day
    with Ledger(state_dir()).transaction() as data:
        for n in range(120):
            at = first + n * day
            batch = time.strftime("nightly-%Y-%m-%d", time.localtime(at))
            outcome = FAILED if n == 118 else OK
            data.book.note_finished(Finished(f"{n:08x}", outcome, at, batch=batch))
    newest = [
        time.strftime("nightly-%Y-%m-%d", time.localtime(first + n * day)) for n in (118, 119)
    ]
    assert run([*gpuwait_cmd, "--vram", "1G", "--batch", "sweep", "--", "true"]).returncode == 0
    assert main(["status"]) == 0
    text = capsys.readouterr().out
    shown = text[text.index("Batches (") :].splitlines()
    assert len(shown) <= 8, text
    assert shown[0] == "Batches (100)"
    assert any(line.startswith(f" {newest[0]}") and "1 failed" in line for line in shown), text
    assert any(line.startswith(f" {newest[1]}") for line in shown), text
    assert any(line.startswith(" sweep") for line in shown), text
    assert "gpuwait status --json" in shown[-1], text
    assert len(status_json(gpuwait_cmd)["batches"]) == 100


def test_status_watch_prints_reports_until_interrupted(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Callable[..., Any]
) -> None:
    sim_file(gpus=1)
    watcher = procs([*gpuwait_cmd, "status", "--json", "--watch", "0.2s"])
    first, second = (json.loads(watcher.stdout.readline()) for _ in range(2))
    assert first["schema"] == second["schema"] == 2
    assert second["generated_at"] > first["generated_at"]
    watcher.send_signal(signal.SIGINT)
    assert watcher.wait(timeout=10) == 0


BAD_INPUT = [
    (["--exclusive", "--vram", "1G", "true"], 2, "leave out --vram"),
    (["--vram", "1G", "--name", "has space", "true"], 2, "--name 'has space'"),
    (["--vram", "1G", "--after", "nosuch", "true"], 2, "--after: no job, name or batch 'nosuch'"),
    (["--vram", "1G", "--after-ok", "nosuch", "true"], 2, "--after-ok: no job, name or batch"),
    (["--vram", "1G", "--max-util", "0", "true"], 2, "--max-util"),
    (["--vram", "1G", "--max-util", "lots", "true"], 2, "--max-util"),
    (["--vram", "1G", "--min-compute-capability", "eight", "true"], 2, "MAJOR.MINOR"),
    (["--vram", "1G", "--min-total-vram", "big", "true"], 2, "not a size"),
    (["--vram", "1G", "--pick", "fastest", "true"], 2, "adaptive-throughput"),
    (["cancel"], 2, "name the jobs to cancel"),
    (["log", "-n", "-1"], 2, "--lines"),
    (["status", "--watch", "soon"], 2, "not a duration"),
]


@pytest.mark.parametrize(("argv", "status", "message"), BAD_INPUT)
def test_bad_queue_input_is_answered_at_once(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], argv: list[str], status: int, message: str
) -> None:
    sim_file(gpus=1)
    done = run([*gpuwait_cmd, *argv])
    assert done.returncode == status, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert ledger_entries() == []


def test_memory_a_job_allocates_in_a_child_is_not_counted_twice(
    sim: Path,
    gpuwait_cmd: list[str],
    procs: Callable[..., subprocess.Popen[Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpuwait.gpu.sim import SimBackend

    # A job's tree is published as it is sampled: every 0.1 s in its first second, then every
    # sample_interval. A child that starts after that first second (a launcher that loads
    # first) is not published before the test ends, so only what the planner finds itself
    # keeps the child's memory from counting twice: as the job's and as an outsider's.
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "120s")
    job = " ".join([*gpuwait_cmd, "sim", "job", "--vram", "10G", "--hold", "60s"])
    procs(
        [
            *gpuwait_cmd,
            "--vram",
            "10G",
            "--devices",
            "0",
            "--",
            "sh",
            "-c",
            f"sleep 1.5; {job} & wait",
        ]
    )
    wait_for(lambda: SimBackend(str(sim)).snapshot().gpus[0].used_bytes >= 10 << 30, timeout=20)
    # 10 GiB reserved and in use of 21.6 usable: another 10 GiB fits beside it.
    second = subprocess.run(
        [*gpuwait_cmd, "--vram", "10G", "--devices", "0", "--timeout", "5s", "--", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode == 0, second.stderr
