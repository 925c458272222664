"""How a running command's VRAM is sampled: what the history's peak can see."""

from __future__ import annotations

import os
import time
from pathlib import Path

from helpers.jobs import live_job

from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot, ProcessUsage
from gpuwait.queue.ledger import Ledger
from gpuwait.runner.launch import spawn
from gpuwait.runner.supervise import supervise

GiB = 2**30
UUID = "GPU-00000000-0000-0000-0000-000000000001"


class PeakInWindow:
    """One GPU on which `pid` holds 1 GiB only between `window` seconds after `reset`."""

    name = "fake"

    def __init__(self, pid: int, window: tuple[float, float]) -> None:
        self.pid, self.window = pid, window
        self.reset()

    def reset(self) -> None:
        self.started = time.monotonic()

    def snapshot(self) -> MachineSnapshot:
        elapsed = time.monotonic() - self.started
        used = GiB if self.window[0] <= elapsed < self.window[1] else 0
        processes = (ProcessUsage(self.pid, used),) if used else ()
        gpu = GpuSnapshot(0, UUID, "Fake GPU", 8 * GiB, used, processes)
        return MachineSnapshot("fake", (gpu,))

    def close(self) -> None:
        pass


def test_a_peak_late_in_the_first_second_is_seen(tmp_path: Path) -> None:
    # A short job whose allocation lives from 0.8 s to 1.2 s after its start (default
    # sample_interval 1 s): the first second is sampled densely, so its peak is recorded.
    child = spawn(["sleep", "1.5"], os.environ)
    backend = PeakInWindow(child, (0.8, 1.2))
    job = live_job("sampled", gpu_uuids=[UUID], state="running")
    backend.reset()
    result = supervise(child, job, Ledger(tmp_path), backend, sample_interval=1.0)
    assert result.returncode == 0
    assert result.peak_bytes.get(UUID) == GiB
    assert result.attributed == {UUID}
