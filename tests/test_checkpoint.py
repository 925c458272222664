"""gpuwait.checkpoint, the job's side of cooperative pausing, as a program under gpuwait uses it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.fixtures_sim import SimFileFactory


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


def test_a_process_that_outlived_its_pausable_job_is_not_pausable(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # A --pausable job's variables stay with a process that outlives it (a server it started,
    # a tmux session opened in it). checkpoint.install() there listened for the checkpoint
    # signal and had the program checkpoint and exit with the resume status, once any USR1
    # came, where no gpuwait was left to resume it. Inside the job it listens, as before.
    sim_file(gpus=1)
    listens = "from gpuwait import checkpoint; print(checkpoint.install())"
    saved = tmp_path / "env.json"
    dump = f"import json, os; json.dump(dict(os.environ), open({str(saved)!r}, 'w')); {listens}"
    inside = subprocess.run(
        [*gpuwait_cmd, "-q", "--pausable", "--vram", "1G", "--", sys.executable, "-c", dump],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (inside.returncode, inside.stdout) == (0, "True\n"), inside.stderr
    left = json.loads(saved.read_text())
    assert left["GPUWAIT_PAUSABLE"] == "1"
    after = subprocess.run(
        [sys.executable, "-c", listens], capture_output=True, text=True, timeout=60, env=left
    )
    assert (after.returncode, after.stdout) == (0, "False\n"), after.stderr
