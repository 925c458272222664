"""Run times learned from history feed the queue: backfill, ETAs, and adaptive-throughput's
choice of the GPU where the command runs fastest."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from helpers.history import a_run

from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.gpu.sim import load_sim_file
from gpuwait.history.learn import learn, save_record

GiB = 2**30


def test_run_time_comes_from_earlier_runs(
    sim_file: object, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    path = sim_file()  # type: ignore[operator]
    job = [*gpuwait_cmd, "sim", "job", "--vram", "1G", "--hold", "0.6s"]
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    assert learn(state, job, str(tmp_path)).run_time is None
    for _ in range(3):
        done = subprocess.run(
            [*gpuwait_cmd, "--vram", "2G", "-q", "--", *job],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    learned = learn(state, job, str(tmp_path))
    assert learned.run_time is not None and 0.6 <= learned.run_time.median < 10
    # Every run had the first card (best-fit, both free): a figure there, none elsewhere.
    first, second = (g.uuid for g in load_sim_file(path).gpus)
    on = learned.run_seconds_on([first, second, "GPU-x"])
    assert set(on) == {first} and 0.6 <= on[first] < 10


def _runs_on(state: Path, command: list[str], cwd: Path, gpu: GpuSnapshot, seconds: float) -> None:
    """Three successful runs of `command` on `gpu`, each taking `seconds`, in the history."""
    for n in range(3):
        save_record(
            state,
            a_run(
                command,
                str(cwd),
                time.time() - 60 + n,
                job_id=f"{gpu.index}{n}",
                request={"bytes": GiB},
                reserved_bytes=GiB,
                gpus=[gpu],
                peak_by_gpu={gpu.uuid: GiB // 2},
                run_seconds=seconds,
                samples=5,
            ),
            64 * 2**20,
        )


def test_adaptive_throughput_takes_the_gpu_where_the_command_ran_fastest(
    sim_file: object, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    path = sim_file()  # type: ignore[operator]
    gpus = [
        GpuSnapshot(g.index, g.uuid, g.name, g.total_bytes, 0) for g in load_sim_file(path).gpus
    ]
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    command = ["sh", "-c", 'echo "GPU $GPUWAIT_GPU_INDICES"']
    # Slow on the first card, fast on the second: both free, best-fit would take the first.
    _runs_on(state, command, tmp_path, gpus[0], 60.0)
    _runs_on(state, command, tmp_path, gpus[1], 5.0)
    assert learn(state, command, str(tmp_path)).run_seconds_on(g.uuid for g in gpus) == {
        gpus[0].uuid: 60.0,
        gpus[1].uuid: 5.0,
    }

    def started_on(pick: str) -> str:
        done = subprocess.run(
            [*gpuwait_cmd, "--vram", "1G", "--pick", pick, "-q", "--", *command],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert started_on("adaptive-throughput") == "GPU 1"
    assert started_on("best-fit") == "GPU 0"
