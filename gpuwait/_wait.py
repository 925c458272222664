"""The one waiting loop: poll the ledger cheaply, re-plan when something was released.

Waking up fast after a release matters (a job that ends should be followed by the next one within
milliseconds), while reading NVML on every tick would be slow and heavy. So the loop:
- checks the ledger file's fingerprint every `poll_interval` (a stat call);
- when it changed, reads it without the lock and re-plans only if something was released
  (an entry gone, a reservation smaller, a process tree changed) — a new waiter or a running job
  publishing its usage cannot make room;
- re-reads the GPUs at least every `nvml_interval` (with jitter, so that many waiters do not read
  in lockstep) to notice processes outside gpuwait coming and going.
Every decision is made under the ledger lock with a fresh snapshot, so two waiters never both take
the same room. The same transaction records which GPUs the queue's head holds, notes GPUs that
stopped or started answering, and notices that this job was cancelled or that a dependency it
needed to succeed did not.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuwait import _events, _signals
from gpuwait._backend import Backend
from gpuwait._bookkeeping import CANCELLED, DEPENDENCY_FAILED, Finished
from gpuwait._ledger import RUNNING, Job, Ledger, LedgerData
from gpuwait._policy import NO_CONDITIONS, Conditions, WaitReason, plan
from gpuwait._queue import (
    UtilizationWindow,
    claims_for,
    name_processes,
    plan_conditions,
    record_hold,
    settle_dependencies,
)
from gpuwait._snapshot import MachineSnapshot

#: While `--max-util` lacks enough readings to judge, the GPUs are read this often.
UTIL_SAMPLE_INTERVAL = 0.2


@dataclass(frozen=True)
class Admitted:
    gpu_uuids: tuple[str, ...]
    reserved_bytes: int
    snapshot: MachineSnapshot


@dataclass(frozen=True)
class TimedOut:
    reason: WaitReason | None


@dataclass(frozen=True)
class Interrupted:
    signum: int


@dataclass(frozen=True)
class Cancelled:
    """`gpuwait cancel` took this job out of the queue."""


@dataclass(frozen=True)
class DependencyFailed:
    """An `--after-ok` dependency did not succeed, so this job can never start."""

    message: str


WaitOutcome = Admitted | TimedOut | Interrupted | Cancelled | DependencyFailed

_Fingerprint = dict[str, tuple[str, int, tuple[int, ...], int | None, tuple[str, ...]]]


def _fingerprint(data: LedgerData) -> _Fingerprint:
    return {
        j.id: (j.state, j.reserved_bytes, tuple(j.pids), j.child_pid, tuple(j.held_gpus))
        for j in data.jobs
    }


def _released(before: _Fingerprint, after: _Fingerprint) -> bool:
    """True when `after` may hold room that `before` did not."""
    for job_id, (state, reserved, pids, child, held) in before.items():
        now = after.get(job_id)
        if now is None:
            return True
        if state == RUNNING and (now[0] != RUNNING or now[1] < reserved or now[2] != pids):
            return True
        if state == RUNNING and now[3] != child:
            return True
        if held and not set(held) <= set(now[4]):
            return True  # the head let go of a GPU
    return False


def try_admit(
    ledger: Ledger,
    job: Job,
    snapshot: MachineSnapshot,
    safety: float,
    conditions: Conditions = NO_CONDITIONS,
) -> Admitted | WaitReason | Cancelled | DependencyFailed | None:
    """Under the lock: admit `job` if the plan lets it start now; otherwise say why it waits."""
    with ledger.transaction() as data:
        now = time.time()
        mine = data.find(job.id)
        if mine is None:
            done = data.book.outcome(job.id)
            if done is not None and done.outcome == CANCELLED:
                return Cancelled()
            # Our entry vanished (a damaged ledger was recovered): put it back where it was.
            data.jobs.append(job)
            mine = job
        busy = frozenset(u for j in data.jobs if j.state == RUNNING for u in j.gpu_uuids)
        for event in data.book.note_health(snapshot, busy, now):
            _events.emit(ledger.directory, **event)
        failure = settle_dependencies(mine, data)
        if failure is not None:
            data.remove(job.id)
            data.book.note_finished(
                Finished(job.id, DEPENDENCY_FAILED, now, name=job.name, batch=job.batch)
            )
            _events.emit(ledger.directory, "leave", job=job.id, outcome=DEPENDENCY_FAILED)
            return DependencyFailed(failure)
        claims = claims_for(data, snapshot.gpus, now)
        decided = plan(snapshot.gpus, claims, safety, data.rr_cursor, conditions)
        record_hold(data, decided.hold)
        if job.id not in decided.admitted:
            job.__dict__.update(mine.__dict__)
            return decided.waiting.get(job.id)
        uuids = decided.admitted[job.id]
        mine.state = RUNNING
        mine.gpu_uuids = list(uuids)
        mine.reserved_bytes = decided.reserved[job.id]
        mine.started_at = mine.updated_at = now
        if mine.pick == "round-robin":
            index = {g.uuid: g.index for g in snapshot.gpus}
            data.rr_cursor = index[uuids[-1]]
        data.book.note_admitted(uuids)
        _events.emit(
            ledger.directory,
            "admit",
            job=job.id,
            name=job.name,
            gpus=list(uuids),
            reserved_bytes=mine.reserved_bytes,
            waited=round(now - mine.submitted_at, 3),
        )
        job.__dict__.update(mine.__dict__)
        return Admitted(uuids, mine.reserved_bytes, snapshot)


def _busy(data: LedgerData) -> frozenset[str]:
    return frozenset(u for j in data.jobs if j.state == RUNNING for u in j.gpu_uuids)


def _reason_without_lock(
    data: LedgerData,
    job: Job,
    snapshot: MachineSnapshot,
    safety: float,
    conditions: Conditions,
) -> WaitReason | None:
    """Why `job` still waits, judged from an unlocked read, or None when the lock is needed.

    It is needed to admit the job, to reap a dead entry, to settle a dependency, to record a
    GPU's health or the head's hold: anything that writes. A release wakes every waiter; this
    lets all but the ones it admits go back to sleep without queueing for the lock, so the
    admitted one gets it at once.
    """
    mine = data.find(job.id)
    if mine is None or not all(j.is_alive() for j in data.jobs):
        return None
    live = {j.id for j in data.jobs}
    if any(d not in live for d in (*mine.after, *mine.after_ok)):
        return None
    now = time.time()
    if data.book.health_would_change(snapshot, _busy(data), now):
        return None
    decided = plan(
        snapshot.gpus, claims_for(data, snapshot.gpus, now), safety, data.rr_cursor, conditions
    )
    if job.id in decided.admitted:
        return None
    for entry in data.jobs:
        held = decided.hold.gpu_uuids if decided.hold and entry.id == decided.hold.job_id else ()
        if entry.state != RUNNING and tuple(entry.held_gpus) != tuple(held):
            return None
    return decided.waiting.get(job.id)


def _only_dependencies_hold_it(data: LedgerData, job: Job) -> bool:
    """True while `job` waits for dependencies that all still run or wait: no GPU matters."""
    mine = data.find(job.id)
    if mine is None or not (mine.after or mine.after_ok):
        return False
    live = {j.id for j in data.jobs}
    return all(d in live for d in (*mine.after, *mine.after_ok)) and all(
        j.is_alive() for j in data.jobs
    )


def wait_for_admission(
    ledger: Ledger,
    backend: Backend,
    job: Job,
    *,
    safety: float,
    poll_interval: float,
    nvml_interval: float,
    deadline: float | None,
    on_reason: Callable[[WaitReason], None],
    ignore_processes: frozenset[str] = frozenset(),
) -> WaitOutcome:
    """Block until `job` is admitted, the monotonic `deadline` passes, or a signal arrives.

    Also ends when the job is cancelled or a dependency it needs to succeed fails. Between
    attempts it sleeps until the ledger is rewritten (inotify, see `_watch`; else a stat poll
    every `poll_interval`), a signal arrives, or it is time to read the GPUs again.
    """
    last_token: object = object()
    last_seen: _Fingerprint | None = None
    next_read = 0.0
    reason: WaitReason | None = None
    window = UtilizationWindow()
    wants_utilization = job.requirements.get("max_util_pct") is not None
    snapshot: MachineSnapshot | None = None
    watch = None
    try:
        while True:
            now = time.monotonic()
            token = ledger.change_token()
            replan = now >= next_read
            if token != last_token:
                last_token = token
                seen = _fingerprint(ledger.read())
                if last_seen is None or _released(last_seen, seen):
                    replan = True
                last_seen = seen
            if replan:
                outcome: Admitted | WaitReason | Cancelled | DependencyFailed | None = None
                data = ledger.read()
                if snapshot is not None and _only_dependencies_hold_it(data, job):
                    claims = claims_for(data, snapshot.gpus, time.time())
                    outcome = plan(snapshot.gpus, claims, safety, data.rr_cursor).waiting.get(
                        job.id
                    )
                else:
                    snapshot = backend.snapshot()
                    if ignore_processes:
                        snapshot = name_processes(snapshot)
                    window.add(snapshot)
                    facts = plan_conditions(window, ignore_processes)
                    outcome = _reason_without_lock(data, job, snapshot, safety, facts)
                    if outcome is None:
                        outcome = try_admit(ledger, job, snapshot, safety, facts)
                        if ledger.committed is not None:
                            last_token = ledger.token
                            last_seen = _fingerprint(ledger.committed)
                if isinstance(outcome, (Admitted, Cancelled, DependencyFailed)):
                    return outcome
                if outcome is not None and outcome != reason:
                    on_reason(outcome)
                reason = outcome
                interval = nvml_interval
                if wants_utilization and window.needs_more():
                    interval = min(interval, UTIL_SAMPLE_INTERVAL)
                next_read = time.monotonic() + interval * random.uniform(0.8, 1.2)
            if watch is None:
                # Set up only once the job has to wait: a launch that fits at once pays nothing.
                from gpuwait._watch import LedgerWatch

                watch = LedgerWatch(ledger.directory)
                continue  # the ledger may have changed before the watch began
            sleep = max(0.0, next_read - time.monotonic()) if watch.active else poll_interval
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return TimedOut(reason)
                sleep = min(sleep, remaining)
            info = _signals.next_signal(sleep, also=(watch.wake_signal,) if watch.active else ())
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            if watch.active and info.si_signo == watch.wake_signal:
                watch.drain()
                continue
            return Interrupted(info.si_signo)
    finally:
        if watch is not None:
            watch.close()
