"""gpuwait.checkpoint, the job's side of cooperative pausing, as a program under gpuwait uses it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("where", ["main", "thread"])
def test_exit_for_resume_ends_the_process_with_the_resume_status(where: str) -> None:
    # A training loop run in a thread of its own (a web app's worker, a service): its
    # exit_for_resume() must end the job, not that thread alone, or the job would run on
    # holding its memory and never be resumed.
    call = (
        "checkpoint.exit_for_resume()"
        if where == "main"
        else "t = threading.Thread(target=checkpoint.exit_for_resume); t.start(); t.join()"
    )
    script = f"import threading\nfrom gpuwait import checkpoint\n{call}\nprint('ran on')\n"
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GPUWAIT_RESUME_EXIT": "80"},
    )
    assert (done.returncode, done.stdout) == (80, ""), done.stderr
