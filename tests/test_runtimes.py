"""Run times learned from history feed the queue (backfill, ETAs)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from gpuwait._runtimes import run_time_estimates


def test_run_time_comes_from_earlier_runs(
    sim_file: object, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    sim_file()  # type: ignore[operator]
    job = [*gpuwait_cmd, "sim", "job", "--vram", "1G", "--hold", "0.6s"]
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    estimates = run_time_estimates(state)
    assert estimates.expected_seconds(job, str(tmp_path)) is None
    for _ in range(3):
        done = subprocess.run(
            [*gpuwait_cmd, "--vram", "2G", "-q", "--", *job],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    seconds = estimates.expected_seconds(job, str(tmp_path))
    assert seconds is not None and 0.6 <= seconds < 10
    assert estimates.expected_seconds(job, str(tmp_path), gpu_uuid="GPU-x") is None
