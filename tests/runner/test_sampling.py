"""How a running command's VRAM is sampled (what the history's peak can see), and how its
sampler keeps the job's entry in the ledger."""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.jobs import live_job

from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot, ProcessUsage
from gpuwait.queue import lifecycle
from gpuwait.queue.ledger import Ledger
from gpuwait.runner.launch import spawn
from gpuwait.runner.supervise import UsageSampler, supervise

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


def damage(ledger: Ledger, content: bytes) -> None:
    """Replace the ledger with a damaged one, as another process would: by rename."""
    damaged = ledger.path.with_name("ledger.json.tmp-test")
    damaged.write_bytes(content)
    os.replace(damaged, ledger.path)


class DamagedRightAfterALook(Ledger):
    """A ledger that another process replaces with a damaged one just after this one has taken
    its fingerprint (`change_token`), once `armed`: the worst moment for the sampler."""

    armed = False

    def change_token(self) -> tuple[object, ...] | None:
        token = super().change_token()
        if self.armed:
            self.armed = False
            damage(self, b'{"schema": 1, "jobs": [{"id": "a", "pid"')
        return token


@pytest.fixture
def running() -> Iterator[Callable[[Ledger], UsageSampler]]:
    """Sets up a running job's entry in a ledger and the sampler of its command (a sleep,
    reaped afterwards), which holds nothing on the GPU."""
    children: list[int] = []

    def start(ledger: Ledger) -> UsageSampler:
        child = spawn(["sleep", "30"], os.environ)
        children.append(child)
        job = live_job("held", gpu_uuids=[UUID], state="running")
        with ledger.transaction() as data:
            data.jobs.append(job)
        return UsageSampler(child, job, ledger, PeakInWindow(child, (0.0, 0.0)), 0.2)

    yield start
    for child in children:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_ledger_replaced_between_two_samples_gets_the_running_jobs_entry_back(
    tmp_path: Path, running: Callable[[Ledger], UsageSampler]
) -> None:
    # The running job's entry is its reservation: whenever its ledger is replaced without it
    # (a damaged one recovered), the job's gpuwait puts it back at its next sample, even when
    # the replacement lands right after the sampler last looked.
    ledger = DamagedRightAfterALook(tmp_path)
    sampler = running(ledger)
    now = time.monotonic()
    ledger.armed = True
    sampler.sample_if_due(now)
    assert Ledger(tmp_path).read().find("held") is None  # replaced without it
    sampler.sample_if_due(now + 1.0)
    assert Ledger(tmp_path).read().find("held") is not None
    assert list(tmp_path.glob("ledger.json.damaged-*"))  # the evidence kept


def test_a_put_back_that_fails_once_is_tried_again_at_the_next_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, running: Callable[[Ledger], UsageSampler]
) -> None:
    # The state directory refuses one write (a full disk for a moment) just as the entry is
    # to be put back: the next sample tries again instead of taking the change as handled.
    ledger = Ledger(tmp_path)
    sampler = running(ledger)
    damage(ledger, b"")
    publish, refusals = lifecycle.publish_usage, []

    def refused_once(*args: Any, **kwargs: Any) -> None:
        if not refusals:
            refusals.append(1)
            raise OSError(errno.ENOSPC, "No space left on device")
        publish(*args, **kwargs)

    monkeypatch.setattr(lifecycle, "publish_usage", refused_once)
    now = time.monotonic()
    sampler.sample_if_due(now)
    assert refusals and Ledger(tmp_path).read().find("held") is None
    sampler.sample_if_due(now + 1.0)
    assert Ledger(tmp_path).read().find("held") is not None
