"""`gpuwait status` as plain data: GPUs, running jobs, the queue, batches and users.

The report is versioned by its `schema` field and documented in docs/queue-and-status.md;
fields are only ever added within a schema version. Reading it changes nothing:
the ledger is read without the lock, and a transaction is made only where one would change
something anyway (an entry to reap, a GPU's health to note, a damaged file to recover).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from gpuwait.core.overuse import Overuse
from gpuwait.core.policy import (
    Claim,
    Conditions,
    FairShare,
    WaitReason,
    closed,
    estimate_starts,
    gpu_rooms,
)
from gpuwait.core.record import Record
from gpuwait.core.snapshot import MachineSnapshot
from gpuwait.linux import proc, userns
from gpuwait.queue import lifecycle
from gpuwait.queue.bookkeeping import GPU_OK, Book
from gpuwait.queue.conditions import (
    machine_user,
    plan_ledger,
    planned_claims,
    uids_by_user,
)
from gpuwait.queue.entries import RUNNING, Job, LedgerData, elsewhere, since
from gpuwait.queue.fairness import NO_FAIR_SHARE, user_usage
from gpuwait.queue.ledger import Ledger, LockBusy

STATUS_SCHEMA = 2
#: Seconds a report waits for the ledger lock to tidy the ledger before showing it as read.
TIDY_LOCK_WAIT = 2.0


class View(Record, frozen=True):
    """The settings the report reads."""

    safety: float
    ignore_processes: frozenset[str] = frozenset()
    fair: FairShare = NO_FAIR_SHARE


def read_queue(ledger: Ledger, snapshot: MachineSnapshot | None) -> tuple[LedgerData, float]:
    """The ledger as a report shows it, and the moment it was read."""
    now = time.time()
    data = ledger.read()
    if ledger.damaged or lifecycle.would_tidy(data, snapshot, now, ledger.directory):
        try:
            # Tidying is a courtesy: a lock held for long (a stopped or hostile process) must
            # not keep the report from showing what the ledger holds.
            with ledger.lock_wait(TIDY_LOCK_WAIT):
                data = lifecycle.tidy(ledger, snapshot, now)
        except LockBusy as exc:
            ledger.warnings.append(f"{exc.message}; showing the ledger as read, not tidied")
    return data, now


def _held(data: LedgerData) -> list[str]:
    """Why no job is started now, whatever the room, for another member's file that cannot
    be used while a gpuwait of theirs runs: said whether or not a job waits."""
    held = lifecycle.unread_hold(data)
    return [] if held is None else [f"{held[0]}; no job is started meanwhile"]


def report_from(
    snapshot: MachineSnapshot | None,
    data: LedgerData,
    now: float,
    view: View,
    ledger_warnings: Sequence[str] = (),
    problem: str | None = None,
    boot_now: float | None = None,
) -> dict[str, Any]:
    """The dashboard from one reading of the GPUs (None: none could be had, `problem` says
    why) and of the ledger, at `now` (`boot_now` on the boot clock, which times what the
    entries stamped there: entries.since)."""
    safety = view.safety
    fair = view.fair
    gpus = snapshot.gpus if snapshot else ()
    # One reading only: utilization is taken as measured, so --max-util waiters get a reason.
    conditions = Conditions(
        utilization={g.uuid: g.utilization_pct for g in gpus if not g.utilization_failed},
        ignore_processes=view.ignore_processes,
    )
    usage = user_usage(data, now, fair.half_life, boot_now)
    claims, _ = planned_claims(data, gpus, fair, now, safety, conditions, boot_now)
    by_id = {c.job_id: c for c in claims}
    # Running first, then the queue in the order the policy serves it (fair share included).
    jobs = sorted(data.jobs, key=lambda j: (j.state != RUNNING, by_id[j.id].sort_key(), j.order))
    rooms = gpu_rooms(gpus, claims, safety, conditions.ignore_processes)
    # As a waiter plans: from the last plan's order, within the plan budget (a status of a
    # long queue is not to take seconds). The lookahead plan's starts are those its wait
    # lines give; the in-order policy's are replayed.
    decided = plan_ledger(data, gpus, claims, safety, conditions, fair)
    etas = (
        decided.starts
        if fair.order is not None
        else estimate_starts(gpus, claims, safety, data.rr_cursor, conditions, limits=fair.limits)
    )
    held_for = {u: decided.hold.job_id for u in decided.hold.gpu_uuids} if decided.hold else {}
    if fair.order is not None:
        # The lookahead order serves the waiters in its plan's order, which their wait lines
        # count ("N ahead of you"): the listing's places are those (a waiter the plan starts
        # now first), not strict order's, which would list a job as 2nd with 4 ahead of it.
        def served(job: Job) -> int:
            reason = decided.waiting.get(job.id)
            return -1 if reason is None else reason.ahead

        jobs.sort(key=lambda j: (j.state != RUNNING, 0 if j.state == RUNNING else served(j)))
    index = {g.uuid: g.index for g in gpus}
    # Health read from another source (another simulation file) is about other GPUs.
    same_source = snapshot is None or data.book.health_backend == snapshot.origin
    known = data.book.health if same_source else {}
    lost = data.book.lost_gpus() if same_source else {}
    # A GPU that this reading does not list, and that is not lost, is one this gpuwait does not
    # see (in a container given some of the machine's GPUs): the ledger's number for it is
    # another numbering's, and may be that of another GPU here. Without a reading, the last.
    numbered = known if snapshot is None else lost
    index.update({u: h.index for u, h in numbered.items() if u not in index})
    waiting_ids = [j.id for j in jobs if j.state != RUNNING]
    report: dict[str, Any] = {
        "schema": STATUS_SCHEMA,
        "generated_at": now,
        "backend": snapshot.backend if snapshot else None,
        "backend_error": problem,
        "safety": safety,
        "ledger_created_at": data.created_at,
        "warnings": [*(snapshot.warnings if snapshot else ()), *ledger_warnings, *_held(data)],
        "gpus": [],
        "jobs": [],
        "batches": _batches(data.jobs, data.book),
        "users": _users(data.jobs, usage, by_id),
        "fair_share": {
            "half_life_seconds": fair.half_life,
            "user_max_gpus": fair.limits.max_gpus if fair.limits else None,
            "user_max_vram_bytes": fair.limits.max_vram if fair.limits else None,
        },
    }
    for room in rooms.values():
        report["gpus"].append(
            _gpu_entry(
                room.gpu.index,
                room.gpu.uuid,
                room.gpu.name,
                room.gpu.total_bytes,
                data.book,
                {
                    "health": GPU_OK,
                    "health_since": _since(data.book, room.gpu.uuid),
                    "health_detail": None,
                    "used_bytes": room.gpu.used_bytes,
                    "external_bytes": room.external,
                    "driver_bytes": room.gpu.driver_bytes,
                    "ignored_bytes": room.ignored_bytes,
                    "reserved_bytes": room.committed,
                    # Nothing more starts on a card a job has to itself, whatever memory is free.
                    "free_bytes": 0 if closed(room) else max(0, room.room),
                    "utilization_pct": room.gpu.utilization_pct,
                    "compute_capability": _capability(room.gpu.compute_capability),
                    "per_process": room.gpu.per_process,
                    "compute_mode": room.gpu.compute_mode,
                    "running_jobs": [j.id for j in jobs if room.gpu.uuid in j.gpu_uuids],
                    "held_for": held_for.get(room.gpu.uuid),
                },
            )
        )
    for uuid, health in sorted(lost.items(), key=lambda uh: uh[1].index):
        if uuid in rooms:
            continue
        report["gpus"].append(
            _gpu_entry(
                health.index,
                uuid,
                health.name,
                health.total_bytes,
                data.book,
                {
                    "health": health.state,
                    "health_since": health.since,
                    "health_detail": health.detail,
                    "used_bytes": None,
                    "external_bytes": None,
                    "driver_bytes": None,
                    "ignored_bytes": None,
                    "reserved_bytes": None,
                    "free_bytes": None,
                    "utilization_pct": None,
                    "compute_capability": None,
                    "per_process": None,
                    "compute_mode": None,
                    "running_jobs": [j.id for j in jobs if uuid in j.gpu_uuids],
                    "held_for": None,
                },
            )
        )
    report["gpus"].sort(key=lambda g: (g["index"], g["uuid"]))
    for job in jobs:
        claim = by_id[job.id]
        running = job.state == RUNNING
        # Nobody is admitted while another member's file cannot be used (a gpuwait of theirs
        # running): as the waiters' own lines say, whatever the plan would start.
        unread = None if running else lifecycle.held_for_unread(data, job)
        reason = unread or decided.waiting.get(job.id)
        report["jobs"].append(
            {
                "id": job.id,
                "name": job.name,
                "batch": job.batch,
                "state": job.state,
                "position": None if running else waiting_ids.index(job.id) + 1,
                "pid": job.pid,
                "child_pid": job.child_pid,
                "orphaned": job.orphaned_at is not None,
                "other_pid_namespace": elsewhere(job),
                "pause_asked_by": _asker(data, job),
                "overuse": _overuse(job),
                "held_by": list(job.held_by),
                "uid": job.uid,
                "command": job.command,
                "cwd": job.cwd,
                "priority": job.priority,
                # A job that stepped aside queues at least as high as whom it made room for.
                "queued_priority": job.effective_priority,
                "pauses": job.pauses,
                "request": job.request,
                "exclusive": job.request == {},
                "gpus": job.gpus,
                "gpu_uuids": job.gpu_uuids,
                "gpu_indices": [index.get(u) for u in job.gpu_uuids],
                "lost_gpus": [u for u in job.gpu_uuids if u in lost],
                "reserved_bytes": job.reserved_bytes,
                "reserved_by_gpu_bytes": [job.reserved_on(u) for u in job.gpu_uuids],
                "observed_bytes": sum(claim.observed.values()),
                "submitted_at": job.submitted_at,
                "started_at": job.started_at,
                "elapsed_seconds": since(job.started_at, job.started_boot, now, boot_now)
                if running and job.started_at
                else None,
                "expected_remaining_seconds": claim.expected_seconds if running else None,
                "expected_seconds": job.expected_seconds,
                "waiting_reason": _said(reason, job),
                "blocked": claim.blocked,
                "eta_seconds": None if running or unread else etas.get(job.id),
                "held_gpus": job.held_gpus
                if decided.hold and decided.hold.job_id == job.id
                else [],
                "after": job.after,
                "after_ok": job.after_ok,
                "requirements": job.requirements,
                "once": job.once,
                "prefer": job.prefer,
            }
        )
    return report


def _said(reason: WaitReason | None, job: Job) -> str | None:
    """A waiter's reason as its own wait line says it: where its size came from, and how a
    line a shell hook runs asks for less (GPUWAIT_DEFAULT_VRAM, not --vram)."""
    if reason is None:
        return None
    if job.size_source:
        reason = reason._replace(source=job.size_source)
    return reason.describe(hooked=job.from_hook)


def _overuse(job: Job) -> dict[str, Any] | None:
    """What `status` says of a job above its reservation: the most it used, why, what to do."""
    if job.overuse_since is None:
        return None
    found = Overuse.seen(
        job.reserved_on(job.overuse_gpu), job.overuse_bytes, job.overuse_total_bytes
    )
    return {
        "since": job.overuse_since,
        "used_bytes": job.overuse_bytes,
        "cause": found.cause(),
        "advice": found.advice(),
        "text": found.describe(),
    }


def _gpu_entry(
    index: int, uuid: str, name: str, total: int, book: Book, fields: dict[str, Any]
) -> dict[str, Any]:
    counters = book.gpus.get(uuid)
    return {
        "index": index,
        "uuid": uuid,
        "name": name,
        "total_bytes": total,
        **fields,
        "counters": {
            "dispatched": counters.dispatched if counters else 0,
            "completed": counters.completed if counters else 0,
            "failed": counters.failed if counters else 0,
            "oom": counters.oom if counters else 0,
            "throughput_per_hour": counters.per_hour() if counters else None,
        },
    }


def _since(book: Book, uuid: str) -> float | None:
    health = book.health.get(uuid)
    return health.since if health else None


def _capability(value: tuple[int, int] | None) -> str | None:
    return None if value is None else f"{value[0]}.{value[1]}"


def _batches(jobs: list[Job], book: Book) -> list[dict[str, Any]]:
    names = {j.batch for j in jobs if j.batch} | set(book.batches)
    rows = []
    for name in sorted(n for n in names if n is not None):
        counts = book.batches.get(name)
        tally = {
            "done": counts.done if counts else 0,
            "running": sum(1 for j in jobs if j.batch == name and j.state == RUNNING),
            "waiting": sum(1 for j in jobs if j.batch == name and j.state != RUNNING),
            "failed": counts.failed if counts else 0,
            "cancelled": counts.cancelled if counts else 0,
        }
        ended_at = counts.updated_at if counts and counts.updated_at > 0 else None
        rows.append({"name": name, **tally, "total": sum(tally.values()), "ended_at": ended_at})
    return rows


#: Decayed usage (VRAM·seconds) under which a user with no job is no row of the report: one
#: byte for one second, nothing. A member who left keeps their file (and usage) in a shared
#: directory, which nobody writes again: without this, a row of theirs for ever; with it, one
#: for some fifty half-lives after their last job.
FORGOTTEN_USAGE = 1.0


def _users(
    jobs: list[Job], usage: dict[int, float], claims: Mapping[str, Claim]
) -> list[dict[str, Any]]:
    """Per user: what they reserve and what that counts for against their VRAM limit
    (`Claim.limit_on`: more where a job uses more than its margin allows), wait for, and
    their fair-share usage (lower goes first). One
    user of the machine is one row: a rootless container's uid 0 and its user's uid on the host
    are one (`machine_user`), shown by the uid this namespace knows them by."""
    uids = uids_by_user(jobs)
    for uid in usage:
        if not any(uid in known for known in uids.values()):
            uids.setdefault(uid, set()).add(uid)
    rows = []
    for key, theirs in uids.items():
        shown = min((u for u in theirs if userns.outer(u) == key), default=min(theirs))
        mine = [j for j in jobs if machine_user(j) == key]
        used = sum(usage.get(u, 0.0) for u in theirs)
        if not mine and used < FORGOTTEN_USAGE:
            continue
        running = [j for j in mine if j.state == RUNNING]
        rows.append(
            {
                "uid": shown,
                "user": proc.user_name(shown),
                "running": len(running),
                "waiting": len(mine) - len(running),
                "gpus_held": sum(len(j.gpu_uuids) for j in running),
                "vram_held_bytes": sum(j.reserved_in_all() for j in running),
                "vram_counted_bytes": sum(
                    sum(map(claims[j.id].limit_on, claims[j.id].gpu_uuids)) for j in running
                ),
                "usage_vram_seconds": round(used, 1),
            }
        )
    return sorted(rows, key=lambda row: row["uid"])


def _asker(data: LedgerData, job: Job) -> dict[str, Any] | None:
    """Who asked a running job to step aside: the waiting job and its owner."""
    if job.pause_requested_by is None:
        return None
    asker = data.find(job.pause_requested_by)
    return {
        "job": job.pause_requested_by,
        "uid": asker.uid if asker is not None else None,
        "signalled": job.pause_signalled_at is not None,
    }
