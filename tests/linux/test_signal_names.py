"""Signals named in gpuwait's messages and `gpuwait history` as the shell's kill -l names them."""

from __future__ import annotations

import signal
import subprocess

from gpuwait.linux.signals import signal_name


def test_every_real_time_signal_is_named_as_kill_l_names_it() -> None:
    # `kill -s RTMAX-3` at gpuwait was said back as SIGRTMIN+27: kill -l names the upper half
    # of the real-time signals from RTMAX.
    numbers = range(signal.SIGRTMIN, signal.SIGRTMAX + 1)
    shown = subprocess.run(
        ["bash", "-c", 'for n in "$@"; do kill -l "$n"; done', "bash", *map(str, numbers)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert [signal_name(n) for n in numbers] == [f"SIG{name}" for name in shown.stdout.split()]
