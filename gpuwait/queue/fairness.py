"""Fair share between the users of one ledger, and their per-user limits: the arithmetic of the
policy in force (gpuwait.core.policy.FairShare, plain data).

Within a priority, a user who has held more VRAM·time goes after one who has held less. A user's
usage is the VRAM·time of their finished jobs, kept in the ledger per uid and halved every
`fair_share_half_life`, plus that of their jobs running now (what each reserves on all its GPUs
together × time since start: on cards of different sizes, each card's reservation there). Jobs
of one user keep their submission order among themselves. Limits (`user_max_gpus`,
`user_max_vram`) cap what one user holds at once. Both are set by an administrator in the site
config; in a private ledger, where every job is the same user's, fair share changes nothing.

Past usage decays by wall-clock time (usage must mean the same to every process, across boots),
so a clock stepped backwards is clamped: no job ever counts negative time. A running job's time
since its start is its run time so far (entries.charged_run_time): on the boot clock where its
entry has the stamp, less any suspend, and with a thawed job's runs before its freeze, as it is
charged once it ends.
"""

from __future__ import annotations

from gpuwait.core.policy import FairShare
from gpuwait.queue.entries import RUNNING, LedgerData, UserUsage, charged_run_time


def decayed(usage: UserUsage, now: float, half_life: float | None) -> float:
    """What `usage` still counts at `now`."""
    if half_life is None:
        return usage.vram_seconds
    elapsed = max(0.0, now - usage.at)
    return float(usage.vram_seconds * 0.5 ** (elapsed / half_life))


def user_usage(
    data: LedgerData, now: float, half_life: float | None, boot_now: float | None = None
) -> dict[int, float]:
    """Each user's usage now: decayed past use plus what their running jobs have held so far
    (timed as their run time is, `run_time`: on the boot clock where `boot_now` and their
    entries allow, less a suspend; what the job is charged once it ends)."""
    totals = {uid: decayed(u, now, half_life) for uid, u in data.usage.items()}
    for job in data.jobs:
        if job.state == RUNNING and job.started_at is not None:
            held = job.reserved_in_all() * charged_run_time(job, now, boot_now)
            totals[job.uid] = totals.get(job.uid, 0.0) + held
    return totals


def charge(
    data: LedgerData, uid: int, vram_seconds: float, now: float, half_life: float | None
) -> None:
    """Add a finished job's VRAM·time to its user's usage."""
    past = data.usage.get(uid)
    before = decayed(past, now, half_life) if past is not None else 0.0
    data.usage[uid] = UserUsage(min(before + max(0.0, vram_seconds), 1e29), max(0.0, now))


#: First come first served, no limits: what a ledger without a site policy gets.
NO_FAIR_SHARE = FairShare()
