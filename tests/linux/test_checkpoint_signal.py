"""The checkpoint signal reaches only processes that listen for it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from gpuwait.linux.checkpoint_signal import catches, deliver, parse_signal

LISTENER = """
import signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
print("ready", flush=True)
deadline = time.monotonic() + 30
while not got and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(75 if got else 1)
"""


def test_only_listeners_are_signalled() -> None:
    listener = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True)
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "ready"
        assert catches(listener.pid, signal.SIGUSR1)
        assert not catches(bystander.pid, signal.SIGUSR1)
        sent = deliver([listener.pid, bystander.pid], signal.SIGUSR1)
        assert sent == [listener.pid]
        assert listener.wait(timeout=30) == 75
        # Not a precondition but the window under test: a SIGUSR1 sent to the bystander would
        # have killed it within this time. A signal that never comes shows no state to wait for.
        time.sleep(0.1)
        assert bystander.poll() is None  # SIGUSR1's default action would have killed it
    finally:
        for p in (listener, bystander):
            p.kill()
            p.wait()


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("USR1", 10),
        ("sigusr2", 12),
        ("TERM", 15),
        ("10", 10),
        # As kill -l and kill -s name the real-time signals: they were said to be no signal a
        # job can catch.
        ("RTMIN+2", signal.SIGRTMIN + 2),
        ("SIGRTMAX-1", signal.SIGRTMAX - 1),
        ("rtmin", signal.SIGRTMIN),
    ],
)
def test_signal_names(text: str, number: int) -> None:
    assert parse_signal(text) == number


@pytest.mark.parametrize(
    "text",
    [
        *("KILL", "STOP", "9", "19", "NOPE", "999", "", "RTMIN+99", "RTMAX-99", "RTMIN+"),
        *("RTMIN-1", "RTMIN+\u0663", "RTMAX-\uff11"),
    ],
)
def test_bad_signal_names(text: str) -> None:
    with pytest.raises(ValueError):
        parse_signal(text)
