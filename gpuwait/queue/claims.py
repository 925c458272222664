"""Ledger entries as the pure policy sees them: claims read from the same snapshot as the GPUs."""

from __future__ import annotations

import time
from collections.abc import Sequence

from gpuwait.core.policy import Claim, FairShare
from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.queue.conditions import dependency_blocker
from gpuwait.queue.entries import RUNNING, Job, LedgerData
from gpuwait.queue.fairness import user_usage


def claim_of(
    job: Job,
    gpus: Sequence[GpuSnapshot],
    now: float | None = None,
    blocked: str | None = None,
    usage: float = 0.0,
) -> Claim:
    """`job` for the policy, its usage read from the same snapshot as the GPUs.

    `usage` is the owner's fair-share usage (see gpuwait.queue.fairness), which orders waiters
    of one priority between users.

    Taking `observed` from the snapshot (not from the ledger's last published figure) keeps
    `external` and `committed` consistent with each other: nothing is counted twice, and
    nothing allocated since the snapshot can be subtracted from a reading that lacks it.
    A running job's expected time is what is left of it at `now` (never below zero).
    """
    pids = set(job.pids)
    if job.child_pid is not None:
        pids.add(job.child_pid)
    observed = {g.uuid: g.process_bytes(pids) for g in gpus if g.uuid in job.gpu_uuids}
    expected = job.expected_seconds
    expected_by_gpu = job.expected_by_gpu
    if job.state == RUNNING and job.started_at is not None:
        elapsed = max(0.0, (time.time() if now is None else now) - job.started_at)
        if expected is not None:
            expected = max(0.0, expected - elapsed)
        expected_by_gpu = {u: max(0.0, s - elapsed) for u, s in expected_by_gpu.items()}
    return Claim(
        job_id=job.id,
        running=job.state == RUNNING,
        priority=job.effective_priority,
        order=job.order,
        request=job.memory_request(),
        gpus_wanted=job.gpus,
        candidates=frozenset(job.candidates) if job.candidates is not None else None,
        pick=job.pick,
        gpu_uuids=tuple(job.gpu_uuids),
        reserved_bytes=job.reserved_bytes,
        observed=observed,
        pids=frozenset(pids),
        requirements=job.requirements_for_policy(),
        blocked=blocked,
        expected_seconds=expected,
        expected_by_gpu=dict(expected_by_gpu),
        held=tuple(job.held_gpus),
        weights=dict(job.weights),
        uid=job.uid,
        usage=usage,
    )


def claims_for(
    data: LedgerData, gpus: Sequence[GpuSnapshot], fair: FairShare, now: float
) -> list[Claim]:
    """Every entry as a policy claim: its dependency blocker (if any), what is left of its
    expected time at `now`, and its user's usage when fair share is on."""
    usage = {} if fair.half_life is None else user_usage(data, now, fair.half_life)
    return [
        claim_of(j, gpus, now, blocked=dependency_blocker(j, data), usage=usage.get(j.uid, 0.0))
        for j in data.jobs
    ]
