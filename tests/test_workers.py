"""The suite run in pytest-xdist workers (README's `pytest -n auto`): a worker takes signals as
a one-process pytest does, a worker started after another crashed too (see conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

#: A test that ends its worker, then one that holds SIGALRM blocked, as gpuwait's waits do,
#: while an alarm is sent to the process: a one-process pytest takes it with sigtimedwait.
TESTS = """
import os, signal

def test_a_crash():
    os.kill(os.getpid(), signal.SIGKILL)

def test_an_alarm_while_blocked():
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        os.kill(os.getpid(), signal.SIGALRM)
        assert signal.sigtimedwait({signal.SIGALRM}, 30) is not None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
"""


def test_a_worker_started_after_a_crash_takes_signals_as_the_first_ones_did(
    tmp_path: Path,
) -> None:
    pytest.importorskip("xdist")
    (tmp_path / "test_crashing.py").write_text(TESTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    # The suite's conftest as a plugin, in a run of its own, with a worker to replace the one
    # that crashes; everything it makes stays in tmp_path.
    options = ["-p", "conftest", "-p", "no:cacheprovider", "-n", "1", "--max-worker-restart", "2"]
    options += ["-q", "-c", os.devnull, "--rootdir", str(tmp_path)]
    options += ["--basetemp", str(tmp_path / "temp")]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *options, str(tmp_path / "test_crashing.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout
    # The first worker dies with the test that kills it; the one started in its place runs
    # the next test to its end.
    assert "1 failed, 1 passed" in out, out + done.stderr
    assert "crashed while running 'test_crashing.py::test_a_crash'" in out, out
