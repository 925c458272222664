"""Wall-clock jumps: waits and timeouts run on the monotonic clock.

gpuwait runs here with time.time() jumping a year forward and a year back on alternate calls, as
a badly set clock (or NTP stepping it) would make it. A wait measured by the wall clock would end
at once or never; measured by the monotonic clock it ends on time.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.jobs import live_job
from helpers.processes import liveness_lock_held, suspended_gpuwait, time_namespace
from helpers.waiting import (
    asleep_waiting,
    catches_signal,
    ledger_entries,
    sleeping_in,
    wait_for,
)

from gpuwait.cli import main
from gpuwait.core.pausing import PauseRules
from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot
from gpuwait.linux import dirs, proc
from gpuwait.queue import lifecycle
from gpuwait.queue.entries import RUNNING, Job, LedgerData
from gpuwait.queue.fairness import charge, user_usage
from gpuwait.queue.ledger import Ledger
from gpuwait.queue.pausing import ask_for_room, pause_progress
from gpuwait.queue.report import View, report_from
from gpuwait.runner.paused import PauseResponder

YEAR = 365 * 86400

JUMPY = f"""
import sys, time
real = time.time
calls = [0]
def jumpy():
    calls[0] += 1
    return real() + ({YEAR} if calls[0] % 2 else -{YEAR})
time.time = jumpy
from gpuwait.cli import main
sys.exit(main(sys.argv[1:]))
"""
#: A command that catches the checkpoint signal (and lets it change nothing).
CATCHER = "import signal, time; signal.signal(signal.SIGUSR1, lambda s, f: None); time.sleep(30)"


@pytest.fixture
def full_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """One simulated 24 GiB GPU of which 23 GiB are held outside gpuwait."""
    path = tmp_path / "sim.toml"
    path.write_text('[[gpu]]\nmemory = "24GiB"\nbase_used = "23GiB"\n')
    monkeypatch.setenv("GPUWAIT_SIM", str(path))
    return path


def jumpy_gpuwait(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", JUMPY, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_timeout_is_kept_while_the_wall_clock_jumps(full_gpu: Path) -> None:
    started = time.monotonic()
    proc = jumpy_gpuwait("--vram", "4G", "--timeout", "1.5s", "--", "true")
    _, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - started
    assert proc.returncode == 124, err
    assert "gave up after waiting 1.5s" in err
    assert 1.4 < elapsed < 10


def test_a_timeout_counts_from_the_launch_while_another_process_keeps_the_ledger_lock(
    full_gpu: Path,
) -> None:
    """`--timeout 1s` while another process keeps the ledger's lock for a while: the wait for
    the lock counts, and gpuwait gives up one second after the launch, not one second after it
    finally got into the queue (up to twice the time the user gave it)."""
    lock = Path(dirs.user_state_dir()) / "ledger.lock"
    lock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    launch: subprocess.Popen[str] | None = None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        launch = subprocess.Popen(
            [sys.executable, "-m", "gpuwait", "--vram", "4G", "--timeout", "1s", "--", "true"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # Its clock runs from before it asked for the lock.
        wait_for(lambda: sleeping_in(launch.pid, "flock"), timeout=30)
        blocked = time.monotonic()
        time.sleep(0.6)  # the other process keeps the lock a while longer
        fcntl.flock(fd, fcntl.LOCK_UN)
        _, err = launch.communicate(timeout=30)
        ended = time.monotonic()
    finally:
        os.close(fd)
        if launch is not None:
            launch.kill()
            launch.communicate()
    assert launch.returncode == 124, err
    assert "gave up after waiting" in err, err
    # At most the second it was given from before it asked (and its own exit), not 0.6 s more.
    assert ended - blocked < 1.35, err


def test_a_timeout_counts_the_time_the_machine_was_suspended(
    full_gpu: Path, tmp_path: Path
) -> None:
    """`--timeout 30m` on a laptop closed for the night: the wait ends when the machine wakes,
    as `timeout 30m` does, rather than go on for the rest of its 30 minutes, and start the
    command hours after the time the user gave it."""
    woke = tmp_path / "woke"
    proc = subprocess.Popen(
        [*suspended_gpuwait(woke), "--vram", "4G", "--timeout", "30m", "true"],
        env={**os.environ, "GPUWAIT_NVML_INTERVAL": "0.1s"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: proc.poll() is not None or asleep_waiting(proc.pid),
            timeout=30,
            message=lambda: f"gpuwait never slept waiting: {ledger_entries()}",
        )
        woke.touch()  # the machine was suspended, and has just woken up
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("after the suspend, gpuwait went on waiting for the rest of its 30 minutes")
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 124, err
    assert "gave up after waiting 2h00m" in err


def test_a_release_is_noticed_while_the_wall_clock_jumps(full_gpu: Path) -> None:
    proc = jumpy_gpuwait("--vram", "4G", "--", "echo", "ran")
    # It has planned, with the clock jumping, found no room, and sleeps until it looks again.
    wait_for(
        lambda: proc.poll() is not None or asleep_waiting(proc.pid),
        timeout=30,
        message=lambda: f"gpuwait never slept waiting: {ledger_entries()}",
    )
    assert proc.poll() is None  # still waiting: neither timed out nor admitted by a jump
    full_gpu.write_text('[[gpu]]\nmemory = "24GiB"\n')
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out == "ran\n", err


def test_fair_share_usage_never_counts_negative_time() -> None:
    now = 1_700_000_000.0
    job = Job(
        id="r",
        pid=1,
        start_time=0,
        uid=5,
        command=["x"],
        cwd="/",
        request={"bytes": 2**30},
        state=RUNNING,
        gpu_uuids=["GPU-1"],
        reserved_bytes=2**30,
        started_at=now + 3600,  # started "in the future": the clock went back since
    )
    data = LedgerData(jobs=[job])
    assert user_usage(data, now, 3600.0) == {5: 0.0}
    charge(data, 5, 100.0, now + YEAR, 3600.0)
    charge(data, 5, 100.0, now, 3600.0)  # the clock went back a year
    assert data.usage[5].vram_seconds == pytest.approx(200.0)
    assert user_usage(LedgerData(usage=data.usage), now - YEAR, 3600.0)[5] == pytest.approx(200.0)


def test_in_process_waits_use_the_monotonic_clock(
    full_gpu: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same, within this process: time.time jumps, the timeout still takes its 1 s.
    real = time.time
    calls = [0]

    def jumpy() -> float:
        calls[0] += 1
        return real() + (YEAR if calls[0] % 2 else -YEAR)

    monkeypatch.setattr(time, "time", jumpy)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    started = time.monotonic()
    try:
        code = main(["--vram", "4G", "--timeout", "1s", "-q", "--", "true"])
    finally:
        # gpuwait blocks the signals it takes synchronously; give pytest its own mask back.
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    assert code == 124
    assert 0.9 < time.monotonic() - started < 10
    assert calls[0] > 0  # the wall clock was read, and jumped, during the wait


def test_a_clock_stepped_forward_does_not_cut_a_pausing_jobs_grace_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A --grace-kill job asked to step aside has its whole grace to checkpoint, whatever NTP
    does to the wall clock meanwhile: TERM comes only once the grace has passed."""
    catcher = subprocess.Popen([sys.executable, "-c", CATCHER])
    try:
        wait_for(lambda: catches_signal(catcher.pid, signal.SIGUSR1), timeout=30)
        job = live_job("a", pausable=True, grace_kill=True, grace_seconds=30.0)
        ledger = Ledger(tmp_path / "state")
        responder = PauseResponder(ledger, job)
        # A waiter asked it to step aside, as the responder has just looked up (it looks again
        # only once the ledger changes, or a second later on the monotonic clock).
        responder.requested = True
        responder.token, responder.looked_at = ledger.change_token(), time.monotonic()
        clock = [time.time()]
        monkeypatch.setattr(time, "time", lambda: clock[0])
        responder.check(catcher.pid)  # its checkpoint signal: the grace begins
        assert responder.signalled_at is not None
        clock[0] += 3600  # the clock is stepped an hour forward
        responder.check(catcher.pid)
        assert catcher.poll() is None and not responder.killed, "TERM within its grace"
    finally:
        catcher.kill()
        catcher.wait()


GiB = 2**30
ONE_GPU = MachineSnapshot("sim", (GpuSnapshot(0, "GPU-0", "Test GPU", 24 * GiB, 0),))
TWO_GPUS = MachineSnapshot(
    "sim",
    (
        GpuSnapshot(0, "GPU-0", "Test GPU", 24 * GiB, 0),
        GpuSnapshot(1, "GPU-1", "Test GPU", 24 * GiB, 0),
    ),
)


def queued(ledger: Ledger, job: Job) -> Job:
    """`job` submitted as a launch submits it."""
    return lifecycle.submit(ledger, job, [], [], ledger.directory, job.command)


def started_now(ledger: Ledger, job_id: str, priority: int, snapshot: MachineSnapshot) -> Job:
    """A --pausable job of 16 GiB that its own owner protects for 10 minutes after a start,
    submitted and admitted now, as a launch would."""
    job = queued(
        ledger,
        live_job(
            job_id,
            priority=priority,
            pausable=True,
            pause_min_runtime=600.0,
            grace_seconds=60.0,
            request={"bytes": 16 * GiB},
            submitted_at=time.time(),
        ),
    )
    entry, attempt = lifecycle.admit(ledger, job, snapshot, 0.9)
    assert isinstance(attempt, lifecycle.Admitted), attempt
    return entry


def step_clock(ledger: Ledger, seconds: float, jobs: tuple[str, ...] | None = None) -> None:
    """As if the wall clock had been stepped `seconds` forward (NTP, `date -s`, a VM resumed)
    since the entries were written: their wall-clock stamps now lie that much in the past.
    Only the wall clock steps; the boot clock of the machine runs on as it did."""
    with ledger.transaction() as data:
        for job in data.jobs:
            if jobs is not None and job.id not in jobs:
                continue
            job.submitted_at -= seconds
            if job.started_at is not None:
                job.started_at -= seconds
            if job.pause_signalled_at is not None:
                job.pause_signalled_at -= seconds
        data.requests[:] = [r._replace(at=r.at - seconds) for r in data.requests]


def urgent_waiter(ledger: Ledger) -> Job:
    return queued(
        ledger,
        live_job("urgent", priority=5, request={"bytes": 16 * GiB}, submitted_at=time.time()),
    )


@pytest.mark.parametrize("step", [3 * 3600.0, -3 * 3600.0], ids=["forward", "back"])
def test_a_clock_step_changes_no_jobs_minimum_run_time_before_it_may_be_paused(
    tmp_path: Path, step: float, booted_an_hour_ago: None
) -> None:
    """A job that started a moment ago is not asked to step aside because the wall clock was
    stepped hours forward (it would lose its work at once); one that has run its 10 minutes is
    asked, however far the clock was stepped back (the urgent job would wait hours)."""
    ledger = Ledger(tmp_path / "state")
    young = started_now(ledger, "young", 1, ONE_GPU)
    if step < 0:
        # It started 11 minutes ago, by either clock.
        with ledger.transaction() as data:
            entry = data.find("young")
            assert entry is not None and entry.started_at is not None
            entry.started_at -= 660
            entry.started_boot = (entry.started_boot or 0.0) - 660
    step_clock(ledger, step)
    urgent = urgent_waiter(ledger)
    # A minute: on a loaded machine more than a second may pass between its start and the ask.
    asked = ask_for_room(ledger, urgent, ONE_GPU, 0.9, PauseRules(min_runtime=60.0))
    assert asked == (() if step > 0 else (young.id,))


def test_a_clock_stepped_forward_does_not_end_a_pause_requests_grace_early(
    tmp_path: Path, booted_an_hour_ago: None
) -> None:
    """An urgent job asked one job to step aside and it was signalled a moment ago; NTP steps
    the clock an hour forward: the job still has its 60 s grace to checkpoint, and the urgent
    job does not take it as ignoring the request and ask a second job to step aside too."""
    ledger = Ledger(tmp_path / "state")
    for job_id in ("first", "second"):
        started_now(ledger, job_id, 1, TWO_GPUS)
    # Both have run their 10 minutes, by either clock.
    with ledger.transaction() as data:
        for entry in data.jobs:
            assert entry.started_at is not None
            entry.started_at -= 660
            entry.started_boot = (entry.started_boot or 0.0) - 660
    urgent = urgent_waiter(ledger)
    rules = PauseRules(min_runtime=1.0)
    (victim,) = ask_for_room(ledger, urgent, TWO_GPUS, 0.9, rules)
    entry = ledger.read().find(victim)
    assert entry is not None
    catcher = subprocess.Popen([sys.executable, "-c", CATCHER])
    try:
        wait_for(lambda: catches_signal(catcher.pid, signal.SIGUSR1), timeout=30)
        PauseResponder(ledger, entry).check(catcher.pid)  # its checkpoint signal
    finally:
        catcher.kill()
        catcher.wait()
    step_clock(ledger, 3600.0)
    assert ask_for_room(ledger, urgent, TWO_GPUS, 0.9, rules) == ()
    # Its wait line says it asked, not that the job ignores it.
    progress = pause_progress(ledger.read(), urgent.id, time.time(), proc.boot_clock())
    assert progress == f"asked job {victim} to checkpoint and step aside"


def started_before_a_suspend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    """A 10-minute job of 16 GiB started, then the laptop closed for two hours: the boot clock
    (and the wall clock) count the two hours; the monotonic clock does not. Its ledger."""
    ledger = Ledger(tmp_path / "state")
    job = queued(ledger, live_job("train", request={"bytes": 16 * GiB}, expected_seconds=600.0))
    job, attempt = lifecycle.admit(ledger, job, ONE_GPU, 0.9)
    assert isinstance(attempt, lifecycle.Admitted), attempt
    lifecycle.started(ledger, job, os.getpid())
    real = proc.boot_clock
    monkeypatch.setattr(proc, "boot_clock", lambda: real() + 7200)
    monkeypatch.setattr(time, "time", lambda t=time.time: t() + 7200)
    return ledger


def test_a_suspend_is_no_run_time_of_a_running_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 10-minute job started, and the laptop was closed for two hours: its command was
    suspended with it, and has its 10 minutes still ahead of it. Status called it overdue,
    and waiters behind it planned on its end in moments."""
    ledger = started_before_a_suspend(tmp_path, monkeypatch)
    report = report_from(ONE_GPU, ledger.read(), time.time(), View(0.9), boot_now=proc.boot_clock())
    (shown,) = report["jobs"]
    assert shown["expected_remaining_seconds"] == pytest.approx(600, abs=30)


def test_a_suspend_is_no_fair_share_usage_of_a_running_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 16 GiB job had run a moment when the laptop was closed for two hours: its user's
    usage counted the two hours as held while it ran (their jobs going after others' who had
    used more), though its run time, charged once it ends, leaves a suspend out."""
    ledger = started_before_a_suspend(tmp_path, monkeypatch)
    (usage,) = user_usage(ledger.read(), time.time(), None, proc.boot_clock()).values()
    assert usage < 16 * GiB * 60  # held a moment, not two hours


def test_a_suspend_does_not_make_a_job_old_enough_to_be_paused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A --pausable job that its owner protects for 10 minutes after a start had run a moment
    when the laptop was closed for two hours: on waking, an urgent job asked it to step aside
    at once, as if it had run those two hours, and it lost its work since its last checkpoint
    and paid its reload again."""
    ledger = Ledger(tmp_path / "state")
    started_now(ledger, "young", 1, ONE_GPU)
    real = proc.boot_clock
    # The boot clock (and the wall clock) count the two hours; the monotonic clock does not.
    monkeypatch.setattr(proc, "boot_clock", lambda: real() + 7200)
    step_clock(ledger, 7200.0)
    urgent = urgent_waiter(ledger)
    assert ask_for_room(ledger, urgent, ONE_GPU, 0.9, PauseRules(min_runtime=60.0)) == ()


def test_a_boot_stamp_from_another_boot_clock_is_not_believed() -> None:
    """A boot-clock stamp later than the boot clock now was taken on another clock (an entry
    of an earlier boot that nothing told apart, a process in another time namespace): the
    moment is timed by its wall-clock stamp instead, never as a negative duration."""
    from gpuwait.queue.entries import since

    now, boot_now = time.time(), proc.boot_clock()
    assert since(now - 5, boot_now - 2, now, boot_now) == pytest.approx(2)
    assert since(now - 5, boot_now + 3600, now, boot_now) == pytest.approx(5)


def test_a_job_started_in_a_time_namespace_keeps_its_room(
    sim_file: Callable[..., Path], procs: Callable[..., subprocess.Popen[str]]
) -> None:
    # /proc shows a process's start time on the reader's boot clock. A job started in a time
    # namespace whose clock was a day ahead (sharing the host's pids) named a start time no
    # process had on the host: gpuwait there took it for gone and reaped its entry while it ran,
    # and gave its 15 GiB to another job on the 24 GiB card.
    sim_file(gpus=1, memory="24G")
    ahead = time_namespace(86400)
    procs([*ahead, sys.executable, "-m", "gpuwait", "--vram", "15G", "--", "sleep", "60"])
    wait_for(lambda: any(j.get("child_pid") for j in ledger_entries()), timeout=30)
    probe = subprocess.run(
        [sys.executable, "-m", "gpuwait", "--vram", "15G", "--timeout", "0.5s", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 124, probe.stderr
    (entry,) = ledger_entries()
    assert entry["state"] == RUNNING


def test_a_clock_stepped_back_does_not_end_the_wait_for_entries_lost_with_the_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job of this user runs (its liveness lock held) when its ledger is damaged and started
    afresh without its entry; the wall clock is then stepped an hour back. A launch still waits
    the recovery's grace for the entry to come back, and is not admitted into its room."""
    from gpuwait.queue.lifecycle import RECOVERY_GRACE

    state = tmp_path / "state"
    with liveness_lock_held(state, "0a1b2c3d") as lock:
        ledger = Ledger(state)
        # Started afresh a moment after the job took its lock, without its entry.
        wait_for(lambda: time.time() > lock.stat().st_mtime, timeout=5)
        with ledger.transaction() as data:
            data.jobs.clear()
        monkeypatch.setattr(time, "time", lambda t=time.time: t() - 3600)
        job = queued(ledger, live_job("next", request={"bytes": 16 * GiB}))
        _, attempt = lifecycle.admit(ledger, job, ONE_GPU, 0.9)
        assert isinstance(attempt, lifecycle.WaitReason), attempt
        assert "put its entry" in (attempt.blocked or ""), attempt
        # The grace is over once RECOVERY_GRACE has gone by on the boot clock.
        real = proc.boot_clock
        monkeypatch.setattr(proc, "boot_clock", lambda: real() + RECOVERY_GRACE)
        _, attempt = lifecycle.admit(ledger, job, ONE_GPU, 0.9)
        assert isinstance(attempt, lifecycle.Admitted), attempt
