"""Delivering gpuwait's checkpoint signal to the processes of a job that listen for it.

A process that has not installed a handler yet would be killed by SIGUSR1's default action, so
gpuwait signals only processes that catch it (SigCgt in /proc/PID/status): a job asked too early
is treated like one that ignores the request, and asked again later.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterable

from gpuwait.core.text import whole_number


def parse_signal(text: str) -> int:
    """`USR1`, `SIGUSR1`, `10` or `RTMIN+2` as a signal number; raises ValueError."""
    name = text.strip().upper()
    number = whole_number(name)
    # The real-time signals as kill -l names them: RTMIN+N, RTMAX-N.
    # re.ASCII: the digits 0-9 only; '٣' (an Arabic-Indic three) is no three here.
    offset = re.fullmatch(r"(?:SIG)?(RTMIN\+|RTMAX-)(\d+)", name, re.ASCII)
    if number is not None:
        if number not in signal.valid_signals():
            raise ValueError(f"{text!r} is not a signal number")
    elif offset is not None:
        start, step = offset.group(1), int(offset.group(2))
        number = signal.SIGRTMIN + step if start == "RTMIN+" else signal.SIGRTMAX - step
        if not signal.SIGRTMIN <= number <= signal.SIGRTMAX:
            raise ValueError(f"{text!r} is not a signal number")
    else:
        value = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
        if not isinstance(value, signal.Signals):
            raise ValueError(f"{text!r} is no signal's name; use e.g. USR1, USR2, TERM")
        number = int(value)
    # KILL and STOP by number too (9, 19): no handler can be installed for them, so a job
    # could never be asked, and its checkpoint.install() would fail.
    if number in (0, signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"{text!r} is not a signal a job can catch; use e.g. USR1, USR2, TERM")
    return number


def signal_name(signum: int) -> str:
    """`signum` as the job is told it: its name without SIG, as a shell's `trap` and `kill -s`
    take it (`USR2` for 12; a real-time one as kill -l names it, `RTMIN+2`)."""
    from gpuwait.linux.signals import signal_name as named  # only --pausable

    return named(signum).removeprefix("SIG")


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
