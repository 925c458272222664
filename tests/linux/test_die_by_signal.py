"""gpuwait ends by the signal its command died of, and no crash reporter takes gpuwait's own
death for a crash of Python: a `core_pattern` pipe (apport, systemd-coredump) ignores
RLIMIT_CORE 0, and runs for no process that is not dumpable."""

from __future__ import annotations

import signal
import subprocess
import sys

CHILD = """
import ctypes, os, signal, sys
from gpuwait.linux import signals
prctl = ctypes.CDLL(None).prctl
real_kill = os.kill
def kill(pid, signum):
    print(prctl(3, 0, 0, 0, 0), flush=True)  # PR_GET_DUMPABLE as the signal is sent
    real_kill(pid, signum)
os.kill = kill
signals.die_by_signal(signal.SIGWINCH)  # ignored by default: still alive after it
print(prctl(3, 0, 0, 0, 0), flush=True)
signals.die_by_signal(int(sys.argv[1]))
"""


def test_gpuwait_dies_by_the_commands_signal_undumpable_and_is_dumpable_if_it_lives() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(int(signal.SIGABRT))],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == -signal.SIGABRT, done.stderr
    # Not dumpable when the signal is sent; dumpable again where it did not end the process.
    assert done.stdout.split() == ["0", "1", "0"], done.stderr
