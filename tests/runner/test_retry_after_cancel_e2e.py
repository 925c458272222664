"""A --retry-oom job cancelled as its run ran out of memory is not run again."""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_sim import SimFileFactory
from helpers.processes import pending_signals
from helpers.waiting import ledger_entries, wait_for

from gpuwait.queue import events


def _gone(pid: int) -> bool:
    """Process `pid` has exited (a zombie not yet waited for counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        # Gone before the file was opened, or reaped between its open and its read.
        return True


def _waits_for_lock(pid: int, inode: int) -> bool:
    """Process `pid` waits for a lock of the file whose inode is `inode` (/proc/locks' lines
    of blocked waiters, marked `->`)."""
    return any(
        line.split()[1] == "->" and f" {pid} " in line and f":{inode} " in line
        for line in Path("/proc/locks").read_text().splitlines()
    )


#: What a stop is given: the job's entry and its gpuwait's pid.
Stop = Callable[[dict[str, Any], int], None]


def _ended_then(
    launch_cmd: list[str], go: Path, stop: Stop, kept: bool = False, queued_held: bool = False
) -> tuple[int, str]:
    """Run `launch_cmd`, gpuwait and a command that waits for `go` to exist, and `stop` it
    (given its entry and its gpuwait's pid) once the command has ended, while gpuwait waits for
    the history lock, held here, to record the run: its exit status and its stderr. `kept`: the
    lock stays held until gpuwait has ended, and the history gained a line since its index was
    written. `queued_held`: the ledger's lock is taken before the history lock is let go, and
    held until gpuwait waits for it (as it queues the run again) or has ended."""
    launch = subprocess.Popen(launch_cmd, stderr=subprocess.PIPE, text=True)
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    history = ledger = None
    try:
        (entry,) = wait_for(lambda: [e for e in ledger_entries() if e.get("child_pid")])
        history = os.open(state / "history.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(history, fcntl.LOCK_EX)
        if kept:
            # Another process's record: the retry's estimate would bring the index up to date.
            with (state / "history.jsonl").open("a") as records:
                records.write("{}\n")
        go.touch()
        wait_for(lambda: _gone(entry["child_pid"]))
        # Stopped before it waits for the lock, gpuwait would end with the command, deciding
        # nothing: a loaded machine may leave it unscheduled that long.
        inode = os.fstat(history).st_ino
        wait_for(
            lambda: _waits_for_lock(launch.pid, inode),
            timeout=60,
            message="gpuwait never waited for the history lock",
        )
        stop(entry, launch.pid)
        if kept:
            wait_for(lambda: launch.poll() is not None, timeout=60, message="gpuwait never ended")
        if queued_held:
            ledger = os.open(state / "ledger.lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(ledger, fcntl.LOCK_EX)
        os.close(history)
        history = None
        if ledger is not None:
            inode = os.fstat(ledger).st_ino
            wait_for(
                lambda: launch.poll() is not None or _waits_for_lock(launch.pid, inode),
                timeout=60,
            )
            os.close(ledger)
            ledger = None
        _, err = launch.communicate(timeout=60)
    finally:
        for fd in (history, ledger):
            if fd is not None:
                os.close(fd)
        if launch.poll() is None:
            launch.kill()
            launch.communicate()
    return launch.returncode, err


def _ran_out_then(
    gpuwait_cmd: list[str],
    tmp_path: Path,
    stop: Stop,
    kept: bool = False,
    retried: str = "",
    queued_held: bool = False,
    options: Sequence[str] = (),
) -> tuple[int, str, str, Path]:
    """Run a --retry-oom 1 job whose command runs out of GPU memory, and `stop` it while
    gpuwait, held on the history lock where it records the run, has not yet decided to retry
    (`_ended_then`, with `kept` and `queued_held`): its exit status, its stderr, how many times
    the command started (one line a start) and the state folder. `retried`: what the command
    does once started again, where it would run out again; `options`: gpuwait's, besides."""
    go, starts = tmp_path / "go", tmp_path / "starts"
    again = f"[ $(wc -l < {shlex.quote(str(starts))}) -gt 1 ] && {retried}; " if retried else ""
    job = (
        f"echo started >> {shlex.quote(str(starts))}; {again}"
        f"while [ ! -e {shlex.quote(str(go))} ]; do sleep 0.02; done; "
        f"exec {shlex.join(gpuwait_cmd)} sim job --vram 30G --hold 0"
    )
    launch_cmd = [*gpuwait_cmd, *options, "--vram", "4G", "--retry-oom", "1", "--", "sh", "-c", job]
    returncode, err = _ended_then(launch_cmd, go, stop, kept=kept, queued_held=queued_held)
    return returncode, err, starts.read_text(), Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"


def _cancelled_held_a_moment(gpuwait_cmd: list[str]) -> Stop:
    """A stop that cancels the job, the history lock held 0.2 s more from the cancel's TERM on,
    however long `gpuwait cancel` itself takes to end on a loaded machine: gpuwait holds the
    TERM blocked, pending, while it waits for the lock."""

    def cancel(entry: dict[str, Any], pid: int) -> None:
        canceller = subprocess.Popen(
            [*gpuwait_cmd, "cancel", entry["id"]],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for(lambda: signal.SIGTERM in pending_signals(pid), timeout=60, interval=0.005)
            time.sleep(0.2)
        finally:
            canceller.wait(timeout=60)

    return cancel


def _sending(*signums: int, held: float = 0) -> Stop:
    """A stop that sends gpuwait each of `signums`, the history lock then held `held` s more
    from when the first is pending (gpuwait holds it blocked while it waits for the lock)."""

    def send(_entry: dict[str, Any], pid: int) -> None:
        for signum in signums:
            os.kill(pid, signum)
        wait_for(lambda: signums[0] in pending_signals(pid), timeout=60, interval=0.005)
        if held:
            time.sleep(held)

    return send


def _recorded_exit_statuses(gpuwait_cmd: list[str]) -> list[int]:
    """The exit status of each run `gpuwait history --json` lists, in its order."""
    runs = subprocess.run(
        [*gpuwait_cmd, "history", "--json"], capture_output=True, text=True, timeout=60
    )
    assert runs.returncode == 0, runs.stderr
    return [r["exit_status"] for r in json.loads(runs.stdout)]


def test_a_job_cancelled_as_its_run_ran_out_is_not_started_again(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # The job's command ran out of GPU memory, and `gpuwait cancel` came before gpuwait had
    # decided to retry it (held here on the history lock, where it records the run): the
    # retry ignored the cancel, said "retrying with 21.6 GiB" and started the command again.
    sim_file(gpus=1, memory="24GiB")

    def cancel(entry: dict[str, Any], _pid: int) -> None:
        done = subprocess.run(
            [*gpuwait_cmd, "cancel", entry["id"]], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr

    returncode, err, starts, state = _ran_out_then(gpuwait_cmd, tmp_path, cancel)
    assert starts == "started\n", err
    assert "retrying" not in err and "was cancelled, so it is not retried" in err, err
    assert returncode == 1, err
    assert ledger_entries() == []
    finishes = [e for e in events.read_events(state) if e["kind"] == "finish"]
    assert [(e["outcome"], e["exit_status"]) for e in finishes] == [("cancelled", 1)]


def test_a_job_cancelled_while_another_process_holds_the_history_lock_is_told_why(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # As above, with the history lock held by another process (a long compaction, a stopped
    # one) until gpuwait had ended: gpuwait gave up recording the run at the cancel's TERM
    # and ended by it, exit 143, saying neither "retrying" nor "not retried", its entry left
    # for the next gpuwait to reap. Only the record is lost now.
    sim_file(gpus=1, memory="24GiB")

    def cancel(entry: dict[str, Any], _pid: int) -> None:
        subprocess.run([*gpuwait_cmd, "cancel", entry["id"]], capture_output=True, timeout=60)

    returncode, err, starts, state = _ran_out_then(gpuwait_cmd, tmp_path, cancel, kept=True)
    assert starts == "started\n", err
    assert "was cancelled, so it is not retried" in err and "retrying" not in err, err
    assert "could not record the run in the history: SIGTERM arrived" in err, err
    assert returncode == 1, err
    assert ledger_entries() == []
    finishes = [e for e in events.read_events(state) if e["kind"] == "finish"]
    assert [(e["outcome"], e["exit_status"]) for e in finishes] == [("cancelled", 1)]


def test_a_job_cancelled_while_the_history_lock_is_held_a_moment_keeps_its_record(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # As above, with the history lock held 0.2 s after the cancel (another gpuwait's record, a
    # compaction): gpuwait gave up the record at once at the TERM, "could not record the run in
    # the history: SIGTERM arrived while gpuwait waited for a lock", and `gpuwait history`
    # showed no run. It waits a moment for the lock, as a job leaving the queue does.
    sim_file(gpus=1, memory="24GiB")
    cancel = _cancelled_held_a_moment(gpuwait_cmd)
    returncode, err, starts, _ = _ran_out_then(gpuwait_cmd, tmp_path, cancel)
    assert starts == "started\n", err
    assert "was cancelled, so it is not retried" in err and "retrying" not in err, err
    assert "could not record" not in err, err
    assert returncode == 1, err
    assert _recorded_exit_statuses(gpuwait_cmd) == [1], err


def test_a_job_told_to_stop_as_its_run_ran_out_is_not_started_again(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # As above, but stopped by a TERM to its gpuwait alone: `gpuwait cancel` of a gpuwait from
    # before the entry kept who cancelled a job (a venv's own older copy) does only that, as
    # does `kill PID`. The retry said "retrying with 21.6 GiB", started the command again and
    # passed it the TERM, which ended it (exit 143).
    sim_file(gpus=1, memory="24GiB")
    returncode, err, starts, _ = _ran_out_then(
        gpuwait_cmd, tmp_path, lambda _entry, pid: os.kill(pid, signal.SIGTERM)
    )
    assert starts == "started\n", err
    assert "retrying" not in err and "so it is not retried" in err, err
    # Nobody cancelled it: the message names the signal, not a cancel.
    assert "gpuwait got SIGTERM" in err and "was cancelled" not in err, err
    assert returncode == 1, err
    assert ledger_entries() == []


def test_a_script_that_ends_its_process_group_on_exit_is_still_retried(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `trap 'kill 0' EXIT`, the idiom that ends a script's background children, sends TERM
    # to the script's whole process group, gpuwait's too. The script's own command ran out of
    # memory: gpuwait took the TERM for one from outside, recorded the run as stopped by it
    # (stopped_by 15) and did not retry. The status is the script's own, as bare (-15).
    sim_file(gpus=1, memory="24GiB")
    starts = tmp_path / "starts"
    script = (
        f"trap 'kill 0' EXIT; echo started >> {shlex.quote(str(starts))}; "
        f"{shlex.join(gpuwait_cmd)} sim job --vram 30G --hold 0"
    )
    bare = subprocess.run(
        ["bash", "-c", script], start_new_session=True, capture_output=True, timeout=60
    )
    starts.unlink()
    launch = subprocess.run(
        [*gpuwait_cmd, "--vram", "4G", "--retry-oom", "1", "--", "bash", "-c", script],
        start_new_session=True,  # kill 0 reaches the group, not this test's
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert starts.read_text() == "started\nstarted\n", launch.stderr
    assert "retrying" in launch.stderr and "not retried" not in launch.stderr, launch.stderr
    assert launch.returncode == bare.returncode == -signal.SIGTERM, launch.stderr
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    finishes = [e for e in events.read_events(state) if e["kind"] == "finish"]
    assert [(e["outcome"], e.get("signal")) for e in finishes][-1:] == [("failed", 15)], finishes
    runs = subprocess.run(
        [*gpuwait_cmd, "history", "--json"], capture_output=True, text=True, timeout=60
    )
    assert [r.get("stopped_by") for r in json.loads(runs.stdout)] == [None, None], runs.stdout


def test_a_script_run_by_a_wrapper_that_ends_its_process_group_on_exit_is_still_retried(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # As above, with the script a process of the command's own (make's recipe, a launcher
    # that forks): the script is gone by the time gpuwait looks at the TERM it sent (gpuwait
    # stopped meanwhile, as a loaded machine may leave it unscheduled), and its TERM was
    # taken for one from outside: no retry, 'not retried' and one start.
    sim_file(gpus=1, memory="24GiB")
    starts, go = tmp_path / "starts", tmp_path / "go"
    script = (
        f"trap 'kill 0' EXIT; echo started >> {shlex.quote(str(starts))}; "
        f"while [ ! -e {shlex.quote(str(go))} ]; do sleep 0.02; done; "
        f"{shlex.join(gpuwait_cmd)} sim job --vram 30G --hold 0"
    )
    wrapper = 'bash -c "$1"; exit $?'
    launch = subprocess.Popen(
        [
            *(*gpuwait_cmd, "--vram", "4G", "--retry-oom", "1", "--"),
            "sh",
            "-c",
            wrapper,
            "sh",
            script,
        ],
        start_new_session=True,  # kill 0 reaches the group, not this test's
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(starts.exists, timeout=60, message="the script never started")
        wait_for(lambda: any(e.get("child_pid") for e in ledger_entries()), timeout=60)
        child = next(e["child_pid"] for e in ledger_entries() if e.get("child_pid"))
        # The script's bash, under the wrapper's sh: gpuwait knows its TERM for the command's
        # only once a sample of the command's tree has seen it (it publishes each new tree),
        # and is stopped below before it could sample again.
        (script_pid,) = wait_for(
            lambda: [
                int(p) for p in Path(f"/proc/{child}/task/{child}/children").read_text().split()
            ],
            timeout=60,
        )
        wait_for(
            lambda: any(script_pid in e.get("pids", []) for e in ledger_entries()),
            timeout=60,
            message="gpuwait never saw the script in the command's tree",
        )
        lock = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.lock"

        def stopped_outside_the_lock() -> bool:
            os.kill(launch.pid, signal.SIGSTOP)
            inode = f":{lock.stat().st_ino} " if lock.exists() else None
            held = Path("/proc/locks").read_text().splitlines()
            if inode is not None and any(f" {launch.pid} " in h and inode in h for h in held):
                os.kill(launch.pid, signal.SIGCONT)
                return False
            return True

        wait_for(stopped_outside_the_lock, timeout=30, interval=0.05)
        go.touch()
        wait_for(lambda: _gone(child), timeout=60, message="the command never ended")
    finally:
        os.kill(launch.pid, signal.SIGCONT)
    _, err = launch.communicate(timeout=120)
    assert starts.read_text() == "started\nstarted\n", err
    assert "retrying" in err and "not retried" not in err, err


def test_a_signal_that_asks_for_no_stop_costs_no_record_while_the_history_lock_is_held(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # A SIGUSR1 (a job's way to have its workers log) that reached gpuwait as it waited for
    # the history lock to record a run that ran out, the lock held 2 s more by another
    # gpuwait: the record was given up after 1 s, "could not record the run in the history:
    # SIGUSR1 arrived while gpuwait waited for a lock", `gpuwait history` showed no run, and
    # the run was not retried, "no larger size to retry with".
    sim_file(gpus=1, memory="24GiB")
    _, err, starts, _ = _ran_out_then(gpuwait_cmd, tmp_path, _sending(signal.SIGUSR1, held=2))
    assert "could not record" not in err, err
    assert _recorded_exit_statuses(gpuwait_cmd)[:1] == [1], err
    # The run recorded, the estimate is raised and the command retried with it, as without
    # the signal (it was "no larger size to retry with"); the signal is the command's.
    assert "retrying with" in err and starts == "started\nstarted\n", err


def test_a_signal_that_asks_for_no_stop_leaves_a_run_its_exit_status_and_record(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # As above, for a run that ended well, not to be retried: gpuwait gave up the record after
    # 1 s and ended by the SIGUSR1 it had no command left to pass to, exit -10 for a command
    # that exited 0.
    sim_file(gpus=1, memory="24GiB")
    go = tmp_path / "go"
    job = f"while [ ! -e {shlex.quote(str(go))} ]; do sleep 0.02; done"
    returncode, err = _ended_then(
        [*gpuwait_cmd, "--vram", "4G", "--", "sh", "-c", job],
        go,
        _sending(signal.SIGUSR1, held=2),
    )
    assert returncode == 0, err
    assert "could not record" not in err, err
    assert _recorded_exit_statuses(gpuwait_cmd) == [0], err


#: gpuwait in which another process takes the history lock the moment a record is appended,
#: and holds it until this gpuwait has ended (another gpuwait's launch bringing the index up
#: to date in between): the index's update, after the record, finds it held.
_LOCK_TAKEN_AFTER_THE_RECORD = """
import subprocess, sys
from gpuwait.history import store
HOLD = (
    "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
    "print(flush=True); sys.stdin.read()"
)
appended = store.append_record
holders = []
def append_record(state_dir, *args, **kwargs):
    done = appended(state_dir, *args, **kwargs)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(state_dir / store.LOCK_NAME)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    holder.stdout.readline()
    holders.append(holder)
    return done
store.append_record = append_record
from gpuwait.cli import entry_point
entry_point()
"""


def test_a_job_cancelled_whose_record_is_written_is_not_told_it_was_lost(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # As above, the record written once the lock was let go, but the lock taken again by
    # another process before the history's index was brought up to date: gpuwait said "could
    # not record the run in the history: SIGTERM arrived while gpuwait waited for a lock",
    # though `gpuwait history` showed the run.
    sim_file(gpus=1, memory="24GiB")
    patched = [sys.executable, "-c", _LOCK_TAKEN_AFTER_THE_RECORD]
    cancel = _cancelled_held_a_moment(gpuwait_cmd)
    returncode, err, starts, _ = _ran_out_then(patched, tmp_path, cancel)
    assert starts == "started\n", err
    assert "was cancelled, so it is not retried" in err and "retrying" not in err, err
    assert returncode == 1, err
    assert _recorded_exit_statuses(gpuwait_cmd) == [1], err
    assert "could not record" not in err, err
    assert "the run is recorded, but the history index could not be brought up to date" in err


@pytest.mark.parametrize(
    ("sent", "name"),
    [([signal.SIGUSR1], "SIGUSR1"), ([signal.SIGRTMIN + 2] * 3, "SIGRTMIN+2")],
)
def test_a_signal_for_the_command_that_ran_out_does_not_reach_its_retry(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path, sent: list[int], name: str
) -> None:
    # A SIGUSR1 sent to gpuwait as it recorded a run that ran out, the history lock held by
    # another gpuwait, was passed on to the retried command the moment it started, before it
    # could take it, and killed it: gpuwait ended by it, 138 in a shell. So did the rest of
    # a real-time signal sent three times (the kernel queues each), one of them dropped.
    sim_file(gpus=1, memory="24GiB")
    returncode, err, starts, _ = _ran_out_then(
        gpuwait_cmd, tmp_path, _sending(*sent), retried="sleep 1 && exit 0"
    )
    # It is the ended command's: the retry runs as without it (it was killed, gpuwait ending
    # by the signal, -10), as does one that waits for no lock.
    assert starts == "started\nstarted\n", err
    assert returncode == 0, err
    assert f"{name} once the command had ended" in err, err


def test_a_signal_for_the_command_that_ran_out_ends_no_wait_for_the_ledger_before_its_retry(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # As above, the ledger's lock then held a moment by another gpuwait as the run was queued
    # again: the SIGUSR1, still pending, gave up that wait at once, and gpuwait ended by it,
    # 138 in a shell, its command never started again.
    sim_file(gpus=1, memory="24GiB")
    returncode, err, starts, _ = _ran_out_then(
        gpuwait_cmd, tmp_path, _sending(signal.SIGUSR1), retried="exit 0", queued_held=True
    )
    assert returncode == 0, err
    assert starts == "started\nstarted\n", err


@pytest.mark.parametrize(
    ("signum", "options", "queued_held"),
    [
        (signal.SIGUSR1, ["--pausable"], True),
        (signal.SIGTERM, ["--pausable", "--checkpoint-signal", "TERM"], False),
    ],
    ids=["USR1, the ledger's lock held", "TERM, the checkpoint signal"],
)
def test_a_checkpoint_request_once_a_pausable_run_ran_out_leaves_to_be_resumed(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    tmp_path: Path,
    signum: int,
    options: list[str],
    queued_held: bool,
) -> None:
    # A --pausable --retry-oom job asked to checkpoint (Slurm's USR1 before the time limit)
    # once its command had ended, out of memory, where one asked as the job waits leaves with
    # the resume status for the batch script to requeue it. USR1, the ledger's lock held a
    # moment by another gpuwait as the run was queued again, gave up that wait, and gpuwait
    # ended by it, 138 in a shell; TERM, the job's checkpoint signal, was taken as one asking
    # gpuwait to end, "gpuwait got SIGTERM, so it is not retried", and gpuwait ended with the
    # command's status.
    sim_file(gpus=1, memory="24GiB")
    returncode, err, starts, _ = _ran_out_then(
        gpuwait_cmd,
        tmp_path,
        _sending(signum),
        retried="exit 0",
        queued_held=queued_held,
        options=options,
    )
    assert (returncode, starts) == (75, "started\n"), err
    assert "asked to checkpoint" in err, err


def test_a_cancel_once_a_pausable_run_ran_out_is_no_checkpoint_request_by_term(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `gpuwait cancel` sends TERM: for a job whose checkpoint signal is TERM, a cancel once
    # its command had ended out of memory is still a cancel, not a request to be resumed.
    sim_file(gpus=1, memory="24GiB")
    returncode, err, starts, _ = _ran_out_then(
        gpuwait_cmd,
        tmp_path,
        _cancelled_held_a_moment(gpuwait_cmd),
        retried="exit 0",
        options=["--pausable", "--checkpoint-signal", "TERM"],
    )
    assert (returncode, starts) == (1, "started\n"), err
    assert "was cancelled, so it is not retried" in err, err


def test_a_real_time_signal_sent_thrice_once_the_command_ran_out_is_told_of_once(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # SIGRTMIN+2 sent three times as the run that ran out was recorded (the kernel queues
    # each): all three are the ended command's, and gpuwait says so in one line, not three.
    sim_file(gpus=1, memory="24GiB")
    returncode, err, starts, _ = _ran_out_then(
        gpuwait_cmd, tmp_path, _sending(*[signal.SIGRTMIN + 2] * 3), retried="exit 0"
    )
    assert (returncode, starts) == (0, "started\nstarted\n"), err
    assert err.count("SIGRTMIN+2 once the command had ended") == 1, err
