"""Delivering gpuwait's checkpoint signal to the processes of a job that listen for it.

A process that has not installed a handler yet would be killed by SIGUSR1's default action, so
gpuwait signals only processes that catch it (SigCgt in /proc/PID/status): a job asked too early
is treated like one that ignores the request, and asked again later.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable


def parse_signal(text: str) -> int:
    """`USR1`, `SIGUSR1` or `10` as a signal number; raises ValueError."""
    name = text.strip().upper()
    if name.isascii() and name.isdigit():
        number = int(name)
        if number in signal.valid_signals():
            return number
        raise ValueError(f"{text!r} is not a signal number")
    if not name.startswith("SIG"):
        name = "SIG" + name
    value = getattr(signal, name, None)
    if not isinstance(value, signal.Signals) or value in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"{text!r} is not a signal a job can catch; use e.g. USR1, USR2, TERM")
    return int(value)


def catches(pid: int, signum: int) -> bool:
    """True when process `pid` has a handler installed for `signum`."""
    try:
        # Read as bytes: the Name line holds the process's name as it is, which need not be
        # text in any encoding (cut at 15 bytes, in the middle of a character, say).
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def deliver(pids: Iterable[int], signum: int) -> list[int]:
    """Send `signum` to each of `pids` that catches it; return those signalled."""
    sent = []
    for pid in pids:
        if catches(pid, signum):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
                sent.append(pid)
    return sent
