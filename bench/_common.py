"""Shared set-up for the benchmarks: a private state dir and a simulated machine."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
GPUWAIT = [sys.executable, "-m", "gpuwait"]


def sandbox(gpus: int = 2, memory: str = "24GiB", shared: bool = False) -> dict[str, str]:
    """Environment with fresh XDG dirs and a new simulation file; returns it. `shared` (root
    only): every user may run simulated jobs on it (`sim init --shared`) and enter the sandbox."""
    root = Path(tempfile.mkdtemp(prefix="gpuwait-bench-"))
    if shared:
        os.chmod(root, 0o755)
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
        [*GPUWAIT, "sim", "init", env["GPUWAIT_SIM"], "--gpus", str(gpus), "--memory", memory]
        + (["--shared"] if shared else []),
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


def ledger_jobs(env: dict[str, str]) -> list[dict[str, object]]:
    """The entries of the sandbox's ledger as they stand ([] while it is missing or mid-write)."""
    path = Path(env["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    try:
        jobs = json.loads(path.read_text())["jobs"]
        return jobs if isinstance(jobs, list) else []
    except (OSError, ValueError, KeyError):
        return []


def wait_until(predicate: Callable[[], object], timeout: float, poll: float = 0.02) -> None:
    """Poll until `predicate()` is true; give up with a message after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("bench: timed out waiting for the queue")
        time.sleep(poll)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far; OSError once it is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS
