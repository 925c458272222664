"""Wall-clock jumps: waits and timeouts run on the monotonic clock.

gpuwait runs here with time.time() jumping a year forward and a year back on alternate calls, as
a badly set clock (or NTP stepping it) would make it. A wait measured by the wall clock would end
at once or never; measured by the monotonic clock it ends on time.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.jobs import live_job
from helpers.waiting import asleep_waiting, catches_signal, ledger_entries, wait_for

from gpuwait.cli import main
from gpuwait.queue.entries import RUNNING, Job, LedgerData
from gpuwait.queue.fairness import charge, user_usage
from gpuwait.queue.ledger import Ledger
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
    catcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGUSR1, lambda s, f: None); time.sleep(30)",
        ]
    )
    try:
        wait_for(lambda: catches_signal(catcher.pid, signal.SIGUSR1), timeout=30)
        job = live_job("a", pausable=True, grace_kill=True, grace_seconds=30.0)
        responder = PauseResponder(Ledger(tmp_path / "state"), job)
        responder.requested = True  # a waiter asked it to step aside
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
