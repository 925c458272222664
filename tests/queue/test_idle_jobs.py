"""Idleness pauses only the waiter's own user's jobs: another user's idle job is never asked."""

from __future__ import annotations

from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot
from gpuwait.queue.entries import RUNNING, Job, LedgerData
from gpuwait.queue.pausing import _running_view

GIB = 2**30


def running(job_id: str, uid: int, kuid: int | None = None) -> Job:
    return Job(
        kuid=kuid,
        id=job_id,
        pid=1,
        start_time=1,
        uid=uid,
        command=["train"],
        cwd="/",
        request={"bytes": 8 * GIB},
        state=RUNNING,
        gpu_uuids=["GPU-a"],
        pausable=True,
        started_at=0.0,
    )


def test_only_the_waiters_own_jobs_count_as_idle() -> None:
    snapshot = MachineSnapshot(
        backend="sim", gpus=(GpuSnapshot(0, "GPU-a", "sim", 24 * GIB, 16 * GIB),)
    )
    data = LedgerData(jobs=[running("mine", 1000), running("theirs", 1001)])
    views = _running_view(data, snapshot, 100.0, frozenset({"mine", "theirs"}), uid=1000)
    assert {v.job_id: v.idle for v in views} == {"mine": True, "theirs": False}


def test_the_waiters_own_idle_job_in_a_rootless_container_counts_as_idle() -> None:
    # Its container's uid 0 is the waiter's user outside (the entry records it): their own
    # idle job, asked to step aside as one on the host is. uid 0 with no such record is not.
    snapshot = MachineSnapshot(
        backend="sim", gpus=(GpuSnapshot(0, "GPU-a", "sim", 24 * GIB, 16 * GIB),)
    )
    data = LedgerData(jobs=[running("contained", 0, kuid=1000), running("roots", 0)])
    views = _running_view(data, snapshot, 100.0, frozenset({"contained", "roots"}), uid=1000)
    assert {v.job_id: v.idle for v in views} == {"contained": True, "roots": False}
