"""Cooperative pausing, the waiter's side: ask running jobs to step aside, and follow what
became of the request.

There is no daemon. A waiting job of higher priority that cannot fit marks, in the ledger, the
running `--pausable` jobs whose room it needs (chosen by gpuwait.core.pausing). Each marked job's
own gpuwait notices the mark and does the rest (gpuwait.runner.paused): it sends its command the
checkpoint signal, and when the command exits with the resume status, puts the job back in the
queue with its original place; it is started again, with GPUWAIT_RESUME_COUNT raised, when it fits.
A `--freezable` job is chosen and marked the same way; its gpuwait freezes it instead
(gpuwait.runner.frozen) and thaws it where it was once it fits again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from gpuwait.core.pausing import (
    DEFAULT_GRACE_MAX,
    PauseChoice,
    PauseRules,
    RunningJob,
    choose_victims,
)
from gpuwait.core.policy import (
    NO_CONDITIONS,
    Claim,
    GpuRoom,
    UserLimits,
    closed,
    gpu_rooms,
    need_on,
    over_limit,
    user_holdings,
)
from gpuwait.core.sizes import format_duration
from gpuwait.core.snapshot import MachineSnapshot
from gpuwait.linux import proc
from gpuwait.linux.userns import same_user
from gpuwait.queue import lifecycle
from gpuwait.queue.conditions import claim_of, dependency_blocker, gpuwait_stopped
from gpuwait.queue.entries import RUNNING, Job, LedgerData, pause_stamps, run_time
from gpuwait.queue.ledger import Ledger


def _running_view(
    data: LedgerData,
    gpus_snapshot: MachineSnapshot,
    now: float,
    idle_jobs: frozenset[str] = frozenset(),
    uid: int | None = None,
    boot_now: float | None = None,
) -> list[RunningJob]:
    """The running jobs as the victim choice sees them; `idle_jobs` count as idle only where
    they are `uid`'s own: nothing is ever done to another user's job for being idle."""
    views = []
    for job in data.jobs:
        if job.state != RUNNING:
            continue
        claim = claim_of(job, gpus_snapshot.gpus, now, boot_now=boot_now)
        # The most it grew to counts: stepping aside frees that too.
        holds = max([job.reserved_bytes, *claim.observed.values(), *claim.grown.values()])
        views.append(
            RunningJob(
                job_id=job.id,
                priority=job.effective_priority,
                gpu_uuids=tuple(job.gpu_uuids),
                holds_bytes=holds,
                # An orphan's gpuwait, which would pass the signal on (or freeze it), is gone;
                # a stopped one (Ctrl-Z) does neither until continued: asked, it would keep
                # the waiter waiting out its grace for nothing, while others could step aside.
                pausable=(job.pausable or job.freezable)
                and job.orphaned_at is None
                and not gpuwait_stopped(job),
                run_seconds=run_time(job, now, boot_now),
                pauses=job.pauses + job.freezes,
                # A frozen job loses nothing to reload: its memory comes back as it was.
                reload_seconds=None if job.freezable else job.load_seconds,
                asked=job.pause_requested_at is not None,
                # Theirs too in a rootless container (its uid 0 is theirs outside).
                idle=job.id in idle_jobs and uid is not None and same_user(uid, job.uid, job.kuid),
                min_runtime=job.pause_min_runtime,
                max_pauses=job.pause_max,
            )
        )
    return views


def without_jobs(room: GpuRoom) -> GpuRoom:
    """`room` as it would be with no gpuwait job running on it (what is used outside stays)."""
    return room._replace(committed=0, running_jobs=0, exclusive_held=False)


def _expected_wait(claims: Sequence[Claim], need: dict[str, int]) -> float | None:
    """Roughly how long the waiter would wait without pausing anyone: until every running job
    on its best GPU has ended. None when some run time there is unknown."""
    best: float | None = None
    for uuid in need:
        on_gpu = [c for c in claims if c.running and uuid in c.gpu_uuids]
        if any(c.expected_seconds is None for c in on_gpu):
            continue
        wait = max((c.expected_seconds or 0.0 for c in on_gpu), default=0.0)
        best = wait if best is None else min(best, wait)
    return best


def _over_limit_anyway(
    waiter: Claim,
    claims: Sequence[Claim],
    data: LedgerData,
    rooms: Mapping[str, GpuRoom],
    limits: UserLimits | None,
) -> bool:
    """Whether its user's limits keep `waiter` from starting even once every job of that user
    that might step aside has done so: whoever stepped aside for it would do so for nothing,
    their GPU idle while the waiter waits for its user's other jobs to end."""
    if limits is None:
        return False
    may_step_aside = {j.id for j in data.jobs if j.state == RUNNING and (j.pausable or j.freezable)}
    staying = [c for c in claims if not (c.running and c.job_id in may_step_aside)]
    held = user_holdings(staying)
    return waiter.job_id in over_limit([waiter], rooms, NO_CONDITIONS, limits, held)


def ask_for_room(
    ledger: Ledger,
    job: Job,
    snapshot: MachineSnapshot,
    safety: float,
    rules: PauseRules,
    idle_jobs: frozenset[str] = frozenset(),
    limits: UserLimits | None = None,
) -> tuple[str, ...]:
    """If `job` waits and pausing lower-priority jobs would let it in, mark them; return their ids.
    `idle_jobs`: running jobs seen idle (`idle_action = pause`), asked whatever their priority
    where they are the waiter's user's own. `limits`: the per-user limits in force; a waiter
    that they would keep from starting in the room freed asks nobody.

    Nothing is asked while a request of this waiter is still pending, so one waiter never pauses
    more than it needs; jobs already asked by another waiter are neither asked again nor counted
    as room for this one.
    """
    if job.gpus != 1:
        return ()  # a gang would need room freed on several GPUs at once: not offered
    quick = ledger.read()
    if dependency_blocker(quick.find(job.id) or job, quick) is not None:
        return ()  # it could not start in the room freed (see `choose`)
    # Its own priority, not the boost of a job that stepped aside: that boost keeps its place
    # in the queue, it does not make jobs of higher priority than its own step aside for it.
    priority = job.priority
    if not any(
        j.state == RUNNING
        and (j.pausable or j.freezable)
        and j.orphaned_at is None
        and j.pause_requested_at is None
        and (j.effective_priority < priority or (j.id in idle_jobs and j.uid == job.uid))
        for j in quick.jobs
    ):
        return ()
    now, boot_now = time.time(), proc.boot_clock()

    def choose(data: LedgerData, mine: Job) -> PauseChoice | None:
        if dependency_blocker(mine, data) is not None:
            # Held back by its dependencies (or behind the job it stepped aside for), it could
            # not use the room: whoever stepped aside would wait for nothing, its GPU idle.
            return None
        claims = [claim_of(j, snapshot.gpus, now, boot_now=boot_now) for j in data.jobs]
        rooms = gpu_rooms(snapshot.gpus, claims, safety)
        my_claim = claim_of(mine, snapshot.gpus, now, boot_now=boot_now)
        if _over_limit_anyway(my_claim, claims, data, rooms, limits):
            return None
        need = {}
        for uuid, room in rooms.items():
            bytes_needed = need_on(my_claim, room)
            if my_claim.exclusive or closed(room):
                # A whole GPU wanted, or a card a job has to itself (a whole GPU's, or any on a
                # card that takes one process at a time): the waiter fits only once every job
                # there has stepped aside, so it needs all the room the card would then have.
                emptied = without_jobs(room)
                fits = need_on(my_claim, emptied)
                bytes_needed = emptied.room if fits is not None and fits <= emptied.room else None
            if bytes_needed is not None:
                need[uuid] = bytes_needed
        return choose_victims(
            need,
            {u: r.room for u, r in rooms.items()},
            priority,
            _running_view(data, snapshot, now, idle_jobs, job.uid, boot_now),
            rules,
            expected_wait=_expected_wait(claims, need),
        )

    return lifecycle.request_pause(ledger, job.id, choose, now, boot_now, rules.grace_max)


#: A victim's gpuwait signals within a second or so of a request; one not signalled after this
#: long has a command that does not catch the signal (yet).
NOT_CAUGHT_AFTER = 5.0


def pause_progress(
    data: LedgerData,
    waiter_id: str,
    now: float,
    boot_now: float | None = None,
    grace_max: float = DEFAULT_GRACE_MAX,
) -> str | None:
    """What became of the jobs `waiter_id` asked to step aside, for its wait line; None if none.
    Timed on the boot clock where `boot_now` and the entries allow (entries.pause_stamps).

    Worded without a running clock, so that a wait line written to a file changes only when
    the situation does.
    """
    parts = []
    for victim in data.jobs:
        if victim.state != RUNNING or victim.pause_requested_by != waiter_id:
            continue
        if victim.freezable:
            parts.append(_freeze_progress(victim))
            continue
        requested, signalled, at = pause_stamps(victim, now, boot_now)
        signal_name = victim.checkpoint_signal.upper().removeprefix("SIG")
        asked_for = at - (requested or at)
        if signalled is None and asked_for > grace_max:
            # Its waiter asks others now; its own gpuwait still signals it once it catches it.
            parts.append(
                f"job {victim.id} does not catch {signal_name} (signalled once it does) and is "
                f"not waited for past {format_duration(grace_max)} (pause_grace_max; other "
                "jobs may be asked)"
            )
        elif signalled is None and not victim.grace_kill and asked_for > victim.grace_seconds:
            parts.append(
                f"job {victim.id} does not catch {signal_name} (signalled once it does) and is "
                f"not waited for past its grace ({format_duration(victim.grace_seconds)}); "
                "other jobs may be asked"
            )
        elif signalled is None and asked_for < NOT_CAUGHT_AFTER:
            parts.append(f"asked job {victim.id} to checkpoint and step aside")
        elif signalled is None:
            parts.append(
                f"asked job {victim.id} to checkpoint and step aside "
                f"(it does not catch {signal_name} yet; signalled once it does)"
            )
        elif (
            at - signalled > grace_max
            and victim.grace_kill
            and at - signalled <= victim.grace_seconds
        ):
            # Its waiter asks others now, but its own gpuwait still ends it at its grace.
            parts.append(
                f"job {victim.id} has not stepped aside in {format_duration(grace_max)} "
                f"(pause_grace_max; other jobs may be asked); it gets TERM at its own grace "
                f"({format_duration(victim.grace_seconds)})"
            )
        elif at - signalled > grace_max and (victim.grace_kill or grace_max < victim.grace_seconds):
            parts.append(
                f"job {victim.id} has not stepped aside in {format_duration(grace_max)} "
                f"and is left alone (pause_grace_max; its own grace is "
                f"{format_duration(victim.grace_seconds)})"
            )
        elif at - signalled <= victim.grace_seconds:
            parts.append(f"asked job {victim.id} to checkpoint and step aside")
        elif victim.grace_kill:
            parts.append(
                f"job {victim.id} has not stepped aside within its grace "
                f"({format_duration(victim.grace_seconds)}); it gets TERM"
            )
        else:
            parts.append(
                f"job {victim.id} has not stepped aside within its grace "
                f"({format_duration(victim.grace_seconds)}) and is left alone "
                "(it was started without --grace-kill)"
            )
    return "; ".join(parts) or _stopped_note(data, waiter_id)


def _stopped_note(data: LedgerData, waiter_id: str) -> str | None:
    """Where the waiter asked nobody: the jobs that may step aside for it (of lower priority,
    on a card it may use) but are passed over while their gpuwait is stopped (Ctrl-Z)."""
    waiter = data.find(waiter_id)
    if waiter is None or waiter.gpus != 1:
        return None
    stopped = [
        j.id
        for j in data.jobs
        if j.state == RUNNING
        and (j.pausable or j.freezable)
        and j.orphaned_at is None
        and j.pause_requested_at is None
        and j.effective_priority < waiter.priority
        and (waiter.candidates is None or not set(waiter.candidates).isdisjoint(j.gpu_uuids))
        and gpuwait_stopped(j)
    ]
    if not stopped:
        return None
    which = ", ".join(f"job {i}" for i in stopped)
    return (
        f"{which}, which may step aside for it, {'is' if len(stopped) == 1 else 'are'} "
        "stopped (Ctrl-Z, SIGSTOP): not asked until continued"
    )


def _freeze_progress(victim: Job) -> str:
    """A --freezable victim's gpuwait freezes it at once, or marks the request acted on when
    freezing failed (lifecycle.freeze_failed): then the job runs on, and is waited for."""
    if victim.pause_signalled_at is None:
        return f"job {victim.id} is being frozen to make room"
    return f"job {victim.id} could not be frozen and runs on; waiting for it to end"
