"""gpuwait's files replaced under a launch that waits (`pip uninstall`, or `pip install -U`,
which removes the old files before it writes the new ones): what the launch needs once it is
admitted is in memory already."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from subprocess import Popen
from typing import Any

import pytest
from conftest import REPO
from helpers.waiting import asleep_waiting, ledger_entry, wait_for

HOLD_UNTIL = 'while [ ! -e "$0" ]; do sleep 0.05; done'


@pytest.mark.parametrize("options", [["--pausable"], ["--enforce", "limit"]])
def test_a_launch_admitted_after_gpuwait_was_uninstalled_under_its_wait_runs_its_command(
    options: list[str],
    tmp_path: Path,
    sim_file: Any,
    procs: Callable[..., Popen[str]],
    gpuwait_cmd: list[str],
) -> None:
    # Admitted after the files were gone, it started its command, then ended in a traceback
    # (No module named 'gpuwait.runner.paused') with exit 1 while the command ran on without
    # it, or (enforce = limit) in one before it started it.
    sim_file(gpus=1)
    site = tmp_path / "site"
    shutil.copytree(REPO / "gpuwait", site / "gpuwait", ignore=shutil.ignore_patterns("*.pyc"))
    release = tmp_path / "release"
    holder = procs([*gpuwait_cmd, "--vram", "20G", "--", "sh", "-c", HOLD_UNTIL, str(release)])
    wait_for(lambda: (ledger_entry(holder.pid) or {}).get("state") == "running")
    waiter = procs(
        [sys.executable, "-m", "gpuwait", *options, "--vram", "20G", "--", "sh", "-c", "exit 9"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    wait_for(lambda: asleep_waiting(waiter.pid))
    shutil.rmtree(site / "gpuwait")
    release.touch()
    _, err = waiter.communicate(timeout=30)
    assert waiter.returncode == 9 and "Traceback" not in err, err
    history = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    wait_for(lambda: holder.poll() is not None)
    records = [json.loads(line) for line in history.read_text().splitlines()]
    assert sorted(r["exit_status"] for r in records) == [0, 9]
