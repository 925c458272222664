"""Shared set-up for the benchmarks: a private state dir and a simulated machine."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPUWAIT = [sys.executable, "-m", "gpuwait"]


def sandbox(gpus: int = 2, memory: str = "24GiB") -> dict[str, str]:
    """Environment with fresh XDG dirs and a new simulation file; returns it."""
    root = Path(tempfile.mkdtemp(prefix="gpuwait-bench-"))
    env = dict(os.environ)
    # Measure gpuwait as installed: with its bytecode cached, not compiled on every start.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(
        {
            "XDG_STATE_HOME": str(root / "state"),
            "XDG_CONFIG_HOME": str(root / "config"),
            "PYTHONPATH": str(REPO),
            "GPUWAIT_SIM": str(root / "sim.toml"),
        }
    )
    subprocess.run(
        [*GPUWAIT, "sim", "init", env["GPUWAIT_SIM"], "--gpus", str(gpus), "--memory", memory],
        env=env,
        check=True,
        capture_output=True,
    )
    return env


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def median(values: list[float]) -> float:
    return statistics.median(values)
