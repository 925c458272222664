"""The command sees what it would see bare: a signal sent to the whole process group (kill -PGID,
`kill %1`, `timeout`, systemd's control-group kill) reaches it once, not once from the sender and
again from gpuwait; and a gpuwait killed with SIGKILL while its stderr is a pipe leaves the
command running with its output still arriving.

Real processes on the simulation.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.crash import gpuwait_signalled_at
from helpers.processes import children, pending_signals
from helpers.trap import TRAP, wait_for_text
from helpers.waiting import ledger_entries, sleeping_in, wait_for

from gpuwait.linux import signals

GROUP_SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT]


def tree(pid: int) -> list[int]:
    found = [pid]
    for child in children(pid):
        found += tree(child)
    return found


def start_trap(
    gpuwait_cmd: list[str], flag: Path, procs: Callable[..., subprocess.Popen[Any]]
) -> subprocess.Popen[Any]:
    """gpuwait running TRAP, leading its own process group, once TRAP's handlers are in place."""
    command = [*gpuwait_cmd, "--vram", "1G", "--", sys.executable, "-c", TRAP, str(flag)]
    proc = procs(command)
    wait_for_text(flag, "ready")
    return proc


@pytest.mark.usefixtures("sim")
@pytest.mark.parametrize("signum", GROUP_SIGNALS)
def test_a_signal_to_the_process_group_reaches_the_command_once(
    gpuwait_cmd: list[str],
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[Any]],
    signum: int,
) -> None:
    flag = tmp_path / "flag"
    proc = start_trap(gpuwait_cmd, flag, procs)
    os.killpg(proc.pid, signum)  # as `kill -TERM -PGID` or bash's `kill %1`
    assert proc.wait(timeout=30) == 41, flag.read_text()
    assert flag.read_text() == str(int(signum))


@pytest.mark.usefixtures("sim")
def test_a_signal_to_gpuwait_alone_after_one_to_the_group_still_reaches_the_command(
    gpuwait_cmd: list[str], tmp_path: Path, procs: Callable[..., subprocess.Popen[Any]]
) -> None:
    # A server that reloads on USR1: `kill -USR1 -PGID` once, later `kill -USR1 PID`. The
    # second, sent to gpuwait alone, must be passed on: the group's first is no reason to
    # drop it once it is past the moment in which the two are taken for one.
    flag = tmp_path / "flag"
    counts = (
        f"n=0; trap 'n=$((n+1)); printf %s \"$n\" > {flag}' USR1; printf ready > {flag}; "
        "while :; do sleep 0.05; done"
    )
    proc = procs([*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", counts])
    wait_for_text(flag, "ready")
    os.killpg(proc.pid, signal.SIGUSR1)
    wait_for_text(flag, "1")
    time.sleep(signals.SAME_SIGNAL_WINDOW + 0.1)  # past the window, however slow the machine
    os.kill(proc.pid, signal.SIGUSR1)
    wait_for_text(flag, "2", timeout=10)


@pytest.mark.usefixtures("sim")
def test_without_cat_a_signal_to_gpuwait_alone_still_reaches_the_command(
    gpuwait_cmd: list[str], tmp_path: Path, procs: Callable[..., subprocess.Popen[Any]]
) -> None:
    # Where no `cat` is found (a distroless image), nothing tells group signals apart: each
    # is taken as sent to gpuwait alone and passed on, never dropped.
    empty = tmp_path / "bin"
    empty.mkdir()
    flag = tmp_path / "flag"
    command = [*gpuwait_cmd, "--vram", "1G", "--", sys.executable, "-c", TRAP, str(flag)]
    proc = procs(command, env={**os.environ, "PATH": str(empty)})
    wait_for_text(flag, "ready")
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 41, flag.read_text()


#: A command that signals its whole process group the moment it starts (as a launcher script's
#: `kill -HUP 0`, or a `kill %1` typed as soon as the job shows), while gpuwait is still
#: recording it in the ledger; exits 40 + the HUPs it received.
SIGNALS_ITS_GROUP_AT_ONCE = 'n=0; trap "n=\\$((n+1))" HUP; kill -HUP 0; sleep 0.3; exit $((40+n))'


@pytest.mark.usefixtures("sim")
def test_a_signal_to_the_group_as_the_command_starts_reaches_it_once(
    gpuwait_cmd: list[str], procs: Callable[..., subprocess.Popen[Any]]
) -> None:
    command = [*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", SIGNALS_ITS_GROUP_AT_ONCE]
    proc = procs(command)
    assert proc.wait(timeout=30) == 41


@pytest.mark.usefixtures("sim")
def test_every_process_of_a_service_signalled_the_command_gets_it_once(
    gpuwait_cmd: list[str], tmp_path: Path, procs: Callable[..., subprocess.Popen[Any]]
) -> None:
    """systemd's KillMode=control-group sends SIGTERM to each process of the unit in turn."""
    flag = tmp_path / "flag"
    proc = start_trap(gpuwait_cmd, flag, procs)
    for pid in tree(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 41, flag.read_text()
    assert flag.read_text() == str(int(signal.SIGTERM))


@pytest.mark.usefixtures("sim")
@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
def test_under_timeout_the_command_gets_the_signal_once(
    gpuwait_cmd: list[str], tmp_path: Path, procs: Callable[..., subprocess.Popen[Any]]
) -> None:
    flag = tmp_path / "flag"
    inner = [*gpuwait_cmd, "--vram", "1G", "--", sys.executable, "-c", TRAP, str(flag)]
    limited = procs(["timeout", "-s", "TERM", "60", *inner])
    wait_for_text(flag, "ready")
    # Its time is up: `timeout` learns so by its timer's SIGALRM, here once the command's
    # handlers are in place, and not after a fixed time that a loaded machine may take to start.
    limited.send_signal(signal.SIGALRM)
    assert limited.wait(timeout=60) == 124
    assert flag.read_text() == str(int(signal.SIGTERM))


@pytest.mark.usefixtures("sim")
def test_kill_percent_one_in_a_job_control_shell_reaches_the_command_once(
    gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    flag = tmp_path / "flag"
    inner = " ".join(
        f"'{a}'" for a in [*gpuwait_cmd, "--vram", "1G", "--", sys.executable, "-c", TRAP]
    )
    script = textwrap.dedent(
        f"""
        set -m
        {inner} "$1" &
        until [ "$(cat "$1" 2>/dev/null)" = ready ]; do sleep 0.05; done
        kill -HUP %1
        wait %1
        echo "status $?"
        """
    )
    done = subprocess.run(
        ["bash", "-c", script, "bash", str(flag)], capture_output=True, text=True, timeout=90
    )
    assert "status 41" in done.stdout, done.stdout + done.stderr
    assert flag.read_text() == str(int(signal.SIGHUP))


CHATTY = textwrap.dedent(
    """
    import os, sys, time
    for i in range(30):
        os.write(2, b"line %d\\n" % i)
        time.sleep(0.1)
    open(sys.argv[1], "w").write("finished")
    """
)


@pytest.mark.usefixtures("sim")
def test_a_killed_gpuwait_leaves_the_command_running_with_its_stderr(
    gpuwait_cmd: list[str], tmp_path: Path, procs: Callable[..., subprocess.Popen[Any]]
) -> None:
    marker = tmp_path / "finished"
    command = [*gpuwait_cmd, "-q", "--vram", "1G", "--", sys.executable, "-c", CHATTY, str(marker)]
    proc = procs(command, text=False, stdout=subprocess.DEVNULL)
    assert proc.stderr is not None
    first = proc.stderr.readline()
    assert first == b"line 0\n"
    proc.kill()  # gpuwait alone, SIGKILL
    proc.wait(timeout=10)
    rest = proc.stderr.read()  # until every writer of the pipe has closed it
    wait_for(marker.exists, timeout=10, message="the command did not outlive its gpuwait")
    lines = (first + rest).decode().splitlines()
    assert lines == [f"line {i}" for i in range(30)]


#: The command lists its open descriptors below 3, then leaves with a status of its own.
LISTS_ITS_FDS = 'ls /proc/$$/fd > "$1"; echo to-stderr >&2; exit 3'


@pytest.mark.usefixtures("sim")
def test_a_gpuwait_started_with_its_standard_descriptors_closed_passes_them_on_closed(
    gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """As `gpuwait ... <&- >&- 2>&-` from a daemon or a cron wrapper: the command finds them
    closed as it would bare (no state file of gpuwait's where its stderr would be), and its
    exit status is gpuwait's."""
    listing = tmp_path / "fds"
    command = [*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", LISTS_ITS_FDS, "sh", str(listing)]
    done = subprocess.run(
        ["sh", "-c", 'exec "$@" <&- >&- 2>&-', "sh", *command], timeout=60, check=False
    )
    assert done.returncode == 3
    assert not {"0", "2"} & set(listing.read_text().split())


@pytest.mark.usefixtures("sim")
def test_messages_nobody_reads_any_more_cost_the_job_nothing(
    gpuwait_cmd: list[str], tmp_path: Path, procs: Callable[..., subprocess.Popen[Any]]
) -> None:
    """`gpuwait -v ... 2>&1 | head -1`, or `gpuwait ... & disown` in a terminal closed since:
    gpuwait's own lines can no longer be written (EPIPE, EIO), and the command still runs in
    its turn, gpuwait ending with its status."""
    holder = procs([*gpuwait_cmd, "-q", "--vram", "20G", "--gpus", "2", "--", "sleep", "30"])
    wait_for(lambda: [j["state"] for j in ledger_entries()] == ["running"])
    ran = tmp_path / "ran"
    waiter = procs(
        [*gpuwait_cmd, "-v", "--vram", "15G", "--", "sh", "-c", f"touch {ran}; exit 3"],
        stdout=subprocess.DEVNULL,
    )
    assert waiter.stderr is not None
    assert "waiting for 15.0 GiB" in waiter.stderr.readline()
    waiter.stderr.close()  # the reader goes away, as `head -1` does
    holder.terminate()
    assert waiter.wait(timeout=30) == 3
    assert ran.exists()


#: Runs the rest of its command line with the terminal on its stdin as its controlling
#: terminal (it leads a session of its own), as a shell runs a job in the foreground.
ON_ITS_TERMINAL = (
    "import fcntl, os, sys, termios\n"
    "fcntl.ioctl(0, termios.TIOCSCTTY, 0)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)
#: A command that ends 42 at a Ctrl-C, and 0 a second after it started without one.
ENDS_42_AT_CTRL_C = 'trap "exit 42" INT; sleep 1 & wait; exit 0'


@pytest.mark.usefixtures("sim")
def test_a_ctrl_c_typed_just_before_the_command_starts_reaches_it(
    gpuwait_cmd: list[str], procs: Callable[..., subprocess.Popen[Any]]
) -> None:
    # Typed as gpuwait was about to start the command (its room just given, here held up
    # saying so on a stderr nobody reads yet), the Ctrl-C waited for gpuwait, which then took
    # it for one the command had had from the terminal too, and dropped it: the job ran on.
    import pty

    leader, follower = pty.openpty()
    read_end, write_end = os.pipe()
    try:
        os.set_blocking(write_end, False)
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(write_end, b"x" * 65536)
        os.set_blocking(write_end, True)
        argv = [sys.executable, "-c", ON_ITS_TERMINAL, *gpuwait_cmd, "--verbose", "--vram", "1G"]
        proc = procs(
            [*argv, "--", "sh", "-c", ENDS_42_AT_CTRL_C],
            stdin=follower,
            stdout=follower,
            stderr=write_end,
        )
        wait_for(lambda: sleeping_in(proc.pid, "write"), message="gpuwait never said it starts")
        os.write(leader, b"\x03")  # Ctrl-C, to the terminal's foreground group: gpuwait alone
        wait_for(lambda: signal.SIGINT in pending_signals(proc.pid))
        os.set_blocking(read_end, False)
        with contextlib.suppress(BlockingIOError):
            while os.read(read_end, 65536):
                pass
        assert proc.wait(timeout=30) in (42, -signal.SIGINT)
    finally:
        for fd in (leader, follower, read_end, write_end):
            os.close(fd)


@pytest.mark.usefixtures("sim")
@pytest.mark.parametrize("launch", [["--"], ["shell-hook", "--"]])
def test_a_ctrl_c_while_gpuwait_starts_stops_the_shells_line_as_bare(
    launch: list[str], procs: Callable[..., subprocess.Popen[Any]]
) -> None:
    # Ctrl-C lands while gpuwait is still loading, before its command exists: bare, the
    # command would have died of it, and the shell would have stopped the rest of its line.
    # (Typed `python a.py; python b.py`, or a `for` loop: with gpuwait exiting 130 instead, b.py
    # ran and the loop went on.) The terminal sends it to the whole foreground group.
    gpuwait = gpuwait_signalled_at("gpuwait.commands.run", "build_parser", "SIGINT", "group")
    line = shlex.join([*gpuwait, *launch, sys.executable, "-c", "print('ran')"])
    shell = procs(["bash", "-c", f"{line}; echo next"])
    out, err = shell.communicate(timeout=30)
    assert (shell.returncode, out) == (-signal.SIGINT, ""), err
    assert "Traceback" not in err
