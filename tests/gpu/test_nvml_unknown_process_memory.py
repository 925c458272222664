"""Processes NVML lists without a memory figure (usedGpuMemory N/A, as in many containers and
under vGPU): a job's own memory is not counted twice, once as its reservation and once more as
someone else's; memory whose owner cannot be told still counts as taken.

Real pynvml over the fake libnvidia-ml.so.1 (mem=na: NVML_VALUE_NOT_AVAILABLE).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers.fixtures_nvml import GIB, FakeGpu, FakeNvml
from helpers.waiting import ledger_entries, wait_for

GPUWAIT = [sys.executable, "-m", "gpuwait"]


def test_a_jobs_own_memory_without_a_figure_leaves_the_rest_of_the_card_free(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    # One 24 GiB card (21.6 GiB usable at safety 0.9). Job A reserved 10 GiB and uses it; NVML
    # lists A's command with no figure. A's 10 GiB was counted as A's reservation and again as
    # memory of someone else's: 1.6 GiB looked free, and B (8G) waited as long as A ran.
    fake_nvml.set_gpus([FakeGpu(uuid="GPU-aaaa", total=24 * GIB)])
    stop = tmp_path / "stop"
    env = {**fake_nvml.env(), "GPUWAIT_SAMPLE_INTERVAL": "0.1s"}
    waiting = f"while [ ! -e {stop} ]; do sleep 0.05; done"
    a = subprocess.Popen(
        [*GPUWAIT, "-q", "--vram", "10G", "--", "sh", "-c", waiting],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        entry = wait_for(
            lambda: next((e for e in ledger_entries() if e.get("child_pid") in e["pids"]), None),
            timeout=30,
        )
        fake_nvml.update_gpu(0, used=10 * GIB)
        fake_nvml.add_process(0, entry["child_pid"], None)
        b = subprocess.run(
            [*GPUWAIT, "--vram", "8G", "--timeout", "20s", "--", "true"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        status = subprocess.run(
            [*GPUWAIT, "status", "--json"], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        stop.touch()
        try:
            a.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            a.kill()
            a.communicate()
    assert b.returncode == 0, b.stderr
    (gpu,) = json.loads(status.stdout)["gpus"]
    assert (gpu["external_bytes"], gpu["reserved_bytes"]) == (0, 10 * GIB)
