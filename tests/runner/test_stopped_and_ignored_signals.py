"""A gpuwait stopped and continued (Ctrl-Z then `fg`, SIGSTOP then SIGCONT) goes on as it was,
waiting or running; signals its caller left ignored (`nohup`'s HUP, the INT and QUIT of a
script's background job) do not end it, as they would not end the command bare.

Real processes on the simulation.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.fixtures_sim import SIMJOB
from helpers.processes import children, process_name
from helpers.waiting import process_state, wait_for

pytestmark = pytest.mark.usefixtures("sim")


def ledger_jobs() -> list[dict[str, object]]:
    path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    if not path.exists():
        return []
    return list(json.loads(path.read_text())["jobs"])


def wait_for_jobs(count: int, state: str | None = None) -> None:
    wait_for(
        lambda: len([j for j in ledger_jobs() if state is None or j["state"] == state]) >= count,
        timeout=90,
        interval=0.02,
        message=lambda: f"never saw {count} {state or ''} jobs: {ledger_jobs()}",
    )


def both_cards_held(gpuwait_cmd: list[str]) -> subprocess.Popen[str]:
    """A gpuwait job that keeps 20 GiB of each of the two 24 GiB cards until terminated."""
    holder = subprocess.Popen(
        [*gpuwait_cmd, "-q", "--vram", "20G", "--gpus", "2", "--", "sleep", "120"], text=True
    )
    wait_for_jobs(1, "running")
    return holder


def end(holder: subprocess.Popen[str]) -> None:
    holder.terminate()
    holder.wait(timeout=60)


def test_a_waiting_gpuwait_stopped_past_its_sleep_and_continued_waits_on(
    gpuwait_cmd: list[str],
) -> None:
    holder = both_cards_held(gpuwait_cmd)
    try:
        waiter = subprocess.Popen(
            [*gpuwait_cmd, "--vram", "15G", "--", "echo", "started"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for_jobs(2)
        time.sleep(0.5)  # asleep in its waiting loop, as a waiter is nearly all the time
        # Stopped for longer than that loop ever sleeps: the sleep's time is up when it
        # continues.
        waiter.send_signal(signal.SIGSTOP)
        time.sleep(2.5)
        waiter.send_signal(signal.SIGCONT)
        time.sleep(0.5)
        assert waiter.poll() is None, waiter.communicate()
    finally:
        end(holder)
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, err
    assert out == "started\n"
    assert "Traceback" not in err
    assert ledger_jobs() == []


def test_a_running_gpuwait_stopped_and_continued_sees_its_command_to_the_end(
    gpuwait_cmd: list[str],
) -> None:
    job = subprocess.Popen(
        [*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", "sleep 3; echo done; exit 7"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_jobs(1, "running")
    time.sleep(0.3)
    job.send_signal(signal.SIGSTOP)
    time.sleep(1.0)
    job.send_signal(signal.SIGCONT)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 7, err
    assert out == "done\n"
    assert "Traceback" not in err
    # It saw the command to its end: the entry is gone and the run is in the history.
    assert ledger_jobs() == []
    runs = subprocess.run(
        [*gpuwait_cmd, "history", "--json"], capture_output=True, text=True, timeout=60
    )
    assert [r["exit_status"] for r in json.loads(runs.stdout)] == [7]


IGNORED = "trap '' HUP INT QUIT; exec \"$@\""
SEES_HUP_IGNORED = "import signal; print(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN)"


def test_signals_the_caller_ignored_neither_end_gpuwait_nor_reach_the_command(
    gpuwait_cmd: list[str],
) -> None:
    # As `nohup gpuwait ...`, or `gpuwait ... &` in a script: the caller ignores HUP, INT and
    # QUIT, and the command inherits them ignored; bare, none of them would end it.
    holder = both_cards_held(gpuwait_cmd)
    command = [sys.executable, "-c", f"import time; time.sleep(1.5); {SEES_HUP_IGNORED}"]
    try:
        waiter = subprocess.Popen(
            ["sh", "-c", IGNORED, "sh", *gpuwait_cmd, "--vram", "15G", "--", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for_jobs(2)
        for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT):
            waiter.send_signal(signum)
        time.sleep(0.5)
        assert waiter.poll() is None, waiter.communicate()
    finally:
        end(holder)
    wait_for_jobs(1, "running")
    waiter.send_signal(signal.SIGHUP)  # as a terminal closing while it runs
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, err
    assert out == "True\n"
    assert "Traceback" not in err


def test_a_caller_that_ignores_sigchld_still_gets_the_commands_exit_status(
    gpuwait_cmd: list[str],
) -> None:
    # Some daemons ignore SIGCHLD and pass that on to what they start: the kernel would reap
    # gpuwait's command and throw its exit status away.
    starter = (
        "import os, signal, sys; signal.signal(signal.SIGCHLD, signal.SIG_IGN);"
        " os.execvp(sys.argv[1], sys.argv[1:])"
    )
    done = subprocess.run(
        [sys.executable, "-c", starter, *gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", "exit 3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    assert ledger_jobs() == []


def test_ctrl_z_sent_to_gpuwaits_pid_stops_its_command_too_and_cont_resumes_both(
    gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """`kill -TSTP $!` from a script, or another tool aimed at gpuwait's pid: as bare, the job
    stops (the command with it, not left running unwatched), and `kill -CONT` goes on."""
    flag = tmp_path / "ticks"
    # A process group of its own whose parent is in another group of the session, as a job
    # control shell starts a job (the kernel ignores Ctrl-Z in an orphaned group).
    job = subprocess.Popen(
        [*gpuwait_cmd, "-q", "--vram", "1G", "--", "sh", "-c", TICKS, "sh", str(flag)],
        process_group=0,
    )
    try:
        wait_for(lambda: flag.exists() and flag.read_text().count("tick") >= 2, timeout=30)
        command = next(p for p in children(job.pid) if process_name(p) == "sh")
        job.send_signal(signal.SIGTSTP)
        wait_for(lambda: process_state(command) == "T" and process_state(job.pid) == "T")
        job.send_signal(signal.SIGCONT)
        assert job.wait(timeout=30) == 5
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
    assert flag.read_text().count("tick") == 8


def test_a_job_stopped_as_a_group_and_continued_by_gpuwaits_pid_goes_on_whole(
    gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """`kill -TSTP -PGID` (the whole job) and then `kill -CONT` of gpuwait's pid, as `gpuwait
    cancel` continues a stopped job pid by pid: gpuwait, continued first, found its command
    still stopped from the job's own stop, took that for the command stopping by itself and
    stopped again, for good, with the TERM of the cancel pending."""
    flag = tmp_path / "ticks"
    # One process: continued by its pid, a shell's `sleep` would stay stopped, bare as well.
    ticks = (
        "import sys, time\n"
        "for _ in range(8):\n"
        "    open(sys.argv[1], 'a').write('tick\\n'); time.sleep(0.1)\n"
        "sys.exit(5)\n"
    )
    job = subprocess.Popen(
        [*gpuwait_cmd, "-q", "--vram", "1G", "--", sys.executable, "-c", ticks, str(flag)],
        process_group=0,
    )
    try:
        wait_for(lambda: flag.exists() and flag.read_text().count("tick") >= 2, timeout=30)
        (command,) = (p for p in children(job.pid) if str(flag) in command_line(p))
        os.killpg(job.pid, signal.SIGTSTP)
        wait_for(lambda: process_state(command) == "T" and process_state(job.pid) == "T")
        job.send_signal(signal.SIGCONT)
        assert job.wait(timeout=15) == 5
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
    assert flag.read_text().count("tick") == 8


#: Eight ticks into a file, a tenth of a second apart, then exit 5.
TICKS = 'for i in 1 2 3 4 5 6 7 8; do echo tick >> "$1"; sleep 0.1; done; exit 5'


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def stop_outside_the_ledger_lock(pid: int) -> None:
    """SIGSTOP gpuwait `pid` where it holds no ledger lock: stopped in a transaction (a STOP
    cannot be held off), it would keep every other gpuwait waiting for the lock, which is
    not what the tests that stop it are about."""
    lock = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.lock"

    def stopped_outside() -> bool:
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: process_state(pid) == "T", timeout=30)
        inode = f":{lock.stat().st_ino} " if lock.exists() else None
        locks = Path("/proc/locks").read_text().splitlines()
        if inode is not None and any(f" {pid} " in line and inode in line for line in locks):
            os.kill(pid, signal.SIGCONT)
            return False
        return True

    wait_for(stopped_outside, timeout=30, interval=0.05)


def test_a_job_whose_command_ended_while_its_gpuwait_was_stopped_holds_no_room(
    gpuwait_cmd: list[str],
) -> None:
    """`kill -STOP` aimed at gpuwait's pid alone (STOP cannot be caught): the command goes on
    and ends, and its gpuwait, stopped, cannot take the entry out. What the command held is
    free: the next job starts rather than waiting for someone to continue that gpuwait."""
    first = subprocess.Popen(
        [*gpuwait_cmd, "-q", "--vram", "15G", "--gpus", "2", "--", "sleep", "0.5"], text=True
    )
    try:
        wait_for(lambda: any(j.get("child_pid") for j in ledger_jobs()), timeout=30)
        command = next(j["child_pid"] for j in ledger_jobs() if j.get("child_pid"))
        stop_outside_the_ledger_lock(first.pid)
        wait_for(lambda: process_state(command) == "Z", timeout=30)
        second = subprocess.run(
            [*gpuwait_cmd, "-q", "--vram", "10G", "--timeout", "5s", "--", "echo", "ran"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (second.returncode, second.stdout) == (0, "ran\n"), second.stderr
    finally:
        first.send_signal(signal.SIGCONT)
        first.wait(timeout=60)
    assert first.returncode == 0
    assert ledger_jobs() == []


def test_a_job_that_grew_and_whose_command_ended_while_its_gpuwait_was_stopped_holds_no_room(
    gpuwait_cmd: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, for a job that used more than its reservation before its command ended: the
    most it used is no more its than its reservation, once no process of it is left."""
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "0.1s")
    simjob = shlex.join(SIMJOB)
    first = subprocess.Popen(
        [
            *(*gpuwait_cmd, "-q", "--vram", "2G", "--gpus", "2", "--"),
            *("sh", "-c", f"{simjob} --vram 18G --hold 1s && sleep 1"),
        ],
        text=True,
    )
    try:
        wait_for(lambda: any(j.get("grown") for j in ledger_jobs()), timeout=60)
        command = next(j["child_pid"] for j in ledger_jobs() if j.get("child_pid"))
        stop_outside_the_ledger_lock(first.pid)
        wait_for(lambda: process_state(command) == "Z", timeout=30)
        second = subprocess.run(
            [*(*gpuwait_cmd, "-q", "--vram", "10G", "--gpus", "2"), "--timeout", "5s", "echo"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 0, second.stderr
    finally:
        first.send_signal(signal.SIGCONT)
        first.wait(timeout=60)
    assert first.returncode == 0
    assert ledger_jobs() == []


#: A job control shell that runs its first argument, a job that stops itself, in the foreground,
#: says what it saw, then continues the job with `fg`.
JOB_CONTROL = textwrap.dedent(
    """
    set -m
    "$@"
    echo "status $?"
    fg >/dev/null
    echo "after fg $?"
    """
)


def session_of(leader: int) -> list[int]:
    """The processes of the session `leader` leads (a job control shell's jobs included)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(name)) == leader:
                    found.append(int(name))
    return found


def in_a_shell(script: str, args: list[str], env: dict[str, str] | None = None) -> tuple[str, str]:
    """What a job control shell running `script` with `args` wrote (stdout, stderr), in a session
    of its own, whose every process is killed at the end."""
    shell = subprocess.Popen(
        ["bash", "-c", script, "bash", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        return shell.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        return "", "the shell never got its terminal back"
    finally:
        for pid in session_of(shell.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shell.wait(timeout=30)


@pytest.mark.parametrize("stop", ["TSTP", "STOP"])
def test_a_command_that_stops_itself_gives_the_shell_back_its_terminal_as_bare(
    gpuwait_cmd: list[str], stop: str
) -> None:
    """ssh's `~^Z`, a program's own suspend, `kill -STOP` aimed at the command: bare, a job
    control shell sees its job stopped, says so and takes the terminal back; `fg` goes on."""
    command = ["sh", "-c", f"kill -{stop} $$; echo resumed; exit 4"]
    statuses = {"TSTP": 128 + signal.SIGTSTP, "STOP": 128 + signal.SIGSTOP}
    out, err = in_a_shell(JOB_CONTROL, [*gpuwait_cmd, "-q", "--vram", "1G", "--", *command])
    assert out == f"status {statuses[stop]}\nresumed\nafter fg 4\n", err
    assert "Traceback" not in err
    assert ledger_jobs() == []


def test_a_command_stopped_and_continued_by_pid_in_a_script_runs_on_under_its_gpuwait(
    gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """No job control shell to take a terminal back (a script, a service): `kill -STOP` and
    `kill -CONT` aimed at the command pause it and let it go on, as bare, and gpuwait, which
    nobody would continue, waits for it rather than stop with it."""
    flag = tmp_path / "pid"
    command = ["sh", "-c", 'echo $$ > "$0"; kill -STOP $$; echo resumed; exit 4', str(flag)]
    job = subprocess.Popen(
        [*gpuwait_cmd, "-q", "--vram", "1G", "--", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: flag.exists() and flag.read_text().strip(), timeout=30)
        pid = int(flag.read_text())
        wait_for(lambda: process_state(pid) == "T", timeout=30)
        os.kill(pid, signal.SIGCONT)
        out, err = job.communicate(timeout=30)
    finally:
        job.kill()
        job.wait(timeout=30)
    assert (job.returncode, out) == (4, "resumed\n"), err


#: A job control shell that runs its arguments, a command that stops itself and writes its pid
#: to $FLAG, in the foreground; once the shell has the terminal back, continues the command by
#: its pid alone, as a user's `kill -CONT PID` from the prompt, and waits (up to 10 s) for the
#: job to end, then says how it is. What `jobs` says goes to stderr, where the shell tells of
#: the job's end unasked: the job may end during a `jobs`, which then tells it instead.
CONTINUED_BY_PID = textwrap.dedent(
    """
    set -m
    "$@"
    echo "status $?"
    kill -CONT "$(cat "$FLAG")"
    n=0
    while { jobs %1 2>/dev/null; } >&2 && [ $((n += 1)) -lt 100 ]; do sleep 0.1; done
    jobs %1 2>/dev/null || echo "ended"
    """
)


@pytest.mark.parametrize("bare", [True, False])
def test_a_command_stopped_and_continued_by_pid_at_a_prompt_goes_on_as_bare(
    gpuwait_cmd: list[str], tmp_path: Path, bare: bool
) -> None:
    """`kill -STOP PID` of the command gives the shell its terminal back, as bare; `kill -CONT
    PID` lets it go on, and the shell sees the job run on and end with the command's status,
    as bare, rather than a job left stopped until someone types `fg`."""
    flag = tmp_path / "pid"
    command = ["sh", "-c", 'echo $$ > "$FLAG"; kill -STOP $$; echo resumed; exit 4']
    wrapper = [] if bare else [*gpuwait_cmd, "-q", "--vram", "1G", "--"]
    out, err = in_a_shell(CONTINUED_BY_PID, [*wrapper, *command], {"FLAG": str(flag)})
    assert out == f"status {128 + signal.SIGSTOP}\nresumed\nended\n", err
    # The shell saw it end with the command's status.
    assert re.search(r"Exit 4 ", err), err
    assert ledger_jobs() == []


def test_a_real_time_signal_ends_a_wait_for_the_ledger_lock_by_the_signal(
    gpuwait_cmd: list[str],
) -> None:
    """`kill -s RTMIN+2` at a gpuwait waiting for the ledger's lock, another gpuwait holding
    it: gpuwait ended in a traceback, exit 1, "ValueError: 36 is not a valid Signals" (Python
    names no real-time signal past RTMIN). It ends by the signal, as it does while it waits
    for room."""
    lock_path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    launch = None
    try:
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)
        launch = subprocess.Popen(
            [*gpuwait_cmd, "--vram", "1G", "--", "true"], stderr=subprocess.PIPE, text=True
        )
        inode = os.fstat(lock).st_ino
        wait_for(
            lambda: any(
                line.split()[1] == "->" and f" {launch.pid} " in line and f":{inode} " in line
                for line in Path("/proc/locks").read_text().splitlines()
            ),
            timeout=60,
            message="gpuwait never waited for the ledger lock",
        )
        os.kill(launch.pid, signal.SIGRTMIN + 2)
        _, err = launch.communicate(timeout=60)
    finally:
        os.close(lock)
        if launch is not None and launch.poll() is None:
            launch.kill()
            launch.communicate()
    assert "Traceback" not in err, err
    assert launch.returncode == -(signal.SIGRTMIN + 2), err


@pytest.mark.parametrize("name", ["RTMIN+2", "RTMAX-3"])
def test_history_names_a_real_time_signal_that_ended_a_run(
    gpuwait_cmd: list[str], name: str
) -> None:
    """A run its command ended by `kill -s RTMIN+2` showed in `gpuwait history` as "signal
    36", where gpuwait's messages name it SIGRTMIN+2, as kill -l does."""
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", f"kill -s {name} $$"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode < 0, done.stderr
    shown = subprocess.run(
        [*gpuwait_cmd, "history", "--all"], capture_output=True, text=True, timeout=60
    )
    (row,) = [line for line in shown.stdout.splitlines() if "kill -s" in line]
    assert f" SIG{name} " in row, shown.stdout
