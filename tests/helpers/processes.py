"""`procs`: start processes in a test and have them always reaped.

Each process leads a process group of its own, so the end of the test reaches everything it
started: gpuwait, its command, and what that command started. TERM first (gpuwait passes it on
and cleans up), SIGKILL to the group for whatever is still there after a while.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture
def procs() -> Iterator[Callable[..., subprocess.Popen[Any]]]:
    """start(argv, **popen) -> a running process (text mode, stdout and stderr piped unless
    given otherwise), stopped with its process group and reaped at the end of the test."""
    started: list[subprocess.Popen[Any]] = []

    def start(argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        kw.setdefault("text", True)
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        started.append(subprocess.Popen(argv, start_new_session=True, **kw))
        return started[-1]

    yield start
    for proc in started:
        _signal_group(proc, signal.SIGTERM)
    for proc in started:
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.communicate(timeout=10)


def _signal_group(proc: subprocess.Popen[Any], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)
