"""Waiting for a state that can be seen, instead of sleeping and hoping it came meanwhile.

`wait_for` polls a predicate until it holds and fails the test, saying what never came, after a
deadline. The predicates below read what the kernel shows of a process (/proc) and what a
gpuwait process shows of itself in the ledger, for preconditions such as "the waiter has planned
and sleeps" or "the command catches its checkpoint signal".
"""

from __future__ import annotations

import json
import os
import platform
import select
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 10.0,
    interval: float = 0.01,
    message: str | Callable[[], str] | None = None,
) -> Any:
    """Poll until `predicate()` is truthy and return it; fail the test after `timeout` seconds.

    `message` says what never came; a callable is asked only then, so it can show the state as
    it was at the deadline. Without one, the failure names the predicate.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            said = message() if callable(message) else message
            pytest.fail(f"not within {timeout:g}s: {said if said is not None else predicate}")
        time.sleep(interval)


# --- processes, as /proc shows them ---------------------------------------------------------

#: Syscall numbers, for kernels whose /proc/PID/wchan names no function (no kallsyms).
_SYSCALLS = {
    "x86_64": {"sigtimedwait": (128,), "nanosleep": (35, 230), "flock": (73,), "write": (1,)},
    "aarch64": {"sigtimedwait": (137,), "nanosleep": (101, 115), "flock": (32,), "write": (64,)},
}
#: What /proc/PID/wchan names for a call whose kernel function is not called after it.
_WCHAN = {"flock": ("flock", "lock_inode_wait"), "write": ("pipe_write",)}


def sleeping_in(pid: int, call: str) -> bool:
    """Process `pid` is blocked in the system call `call` ("sigtimedwait", "nanosleep", "flock").

    Read from /proc/PID/wchan, the kernel function it sleeps in (e.g. do_sigtimedwait). That
    says "0" for a process that runs, and also where the kernel cannot name functions: then the
    syscall number in /proc/PID/syscall decides ("running" while it runs). False once it ended.
    """
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        return False
    if wchan not in ("", "0"):
        return any(name in wchan for name in _WCHAN.get(call, (call,)))
    numbers = _SYSCALLS.get(platform.machine(), {}).get(call, ())
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return bool(fields) and fields[0].isdigit() and int(fields[0]) in numbers


def process_state(pid: int) -> str | None:
    """The state letter in /proc/PID/stat (R, S, D, T, Z, ...), or None when there is no such
    process (or it has been reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name, in parentheses, may hold spaces and parentheses: the state follows the
    # last closing one.
    return stat[stat.rindex(")") + 2]


def catches_signal(pid: int, signum: int) -> bool:
    """Process `pid` has a handler installed for `signum` (SigCgt in /proc/PID/status)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_bytes().splitlines()
    except OSError:
        return False
    for line in lines:
        if line.startswith(b"SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


# --- gpuwait processes, as the ledger shows them --------------------------------------------


def ledger_entries() -> list[dict[str, Any]]:
    """The entries of this test's ledger ($XDG_STATE_HOME/gpuwait/ledger.json, or this user's
    file in a shared one, $GPUWAIT_LEDGER_DIR/ledger.<uid>.json); [] while none."""
    shared = os.environ.get("GPUWAIT_LEDGER_DIR")
    if shared:
        path = Path(shared) / f"ledger.{os.getuid()}.json"
    else:
        path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    try:
        return list(json.loads(path.read_text())["jobs"])
    except (OSError, ValueError):
        return []


def ledger_entry(pid: int) -> dict[str, Any] | None:
    """The entry of the gpuwait process `pid`, or None."""
    return next((j for j in ledger_entries() if j.get("pid") == pid), None)


def named_entry(name: str) -> dict[str, Any] | None:
    """The entry of the job started with `--name name`, or None."""
    return next((j for j in ledger_entries() if j.get("name") == name), None)


def asleep_waiting(pid: int) -> bool:
    """The gpuwait process `pid` has planned at least once and sleeps in its waiting loop.

    The loop plans before it first sleeps, and sigtimedwait is where it sleeps. The process is
    read before its entry: one admitted in between (then asleep supervising its command, in
    sigtimedwait too) has a running entry by the time the entry is read, and is not taken for
    a waiter.
    """
    if not sleeping_in(pid, "sigtimedwait"):
        return False
    entry = ledger_entry(pid)
    return entry is not None and entry.get("state") == "waiting"


def asleep_supervising(pid: int) -> bool:
    """The gpuwait process `pid` runs its command and sleeps between two samples of it.

    It records the command's pid (child_pid) just before supervising, and the supervisor takes
    its first sample before it first sleeps (in sigtimedwait): so the first sample is taken.
    """
    entry = ledger_entry(pid)
    if entry is None or entry.get("state") != "running" or not entry.get("child_pid"):
        return False
    return sleeping_in(pid, "sigtimedwait")


def said(process: subprocess.Popen[str], words: str, timeout: float = 30) -> str:
    """What `process` wrote to its piped stderr up to and with `words`, read straight from the
    pipe as it comes (its text-mode file reads nothing ahead, so communicate() then gives the
    rest); fails the test after `timeout` seconds without them, or once the pipe is closed."""
    assert process.stderr is not None
    fd = process.stderr.fileno()
    told = b""
    deadline = time.monotonic() + timeout
    while words.encode() not in told:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            pytest.fail(f"never said {words!r}; said: {told.decode(errors='replace')}")
        told += chunk
    return told.decode()
