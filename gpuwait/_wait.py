"""The one waiting loop: sleep until something concerns this job, then plan for the whole queue.

Waking up fast after a release matters (a job that ends should be followed by the next one within
milliseconds), while every waiter reading NVML and re-planning on every change would swamp a
machine with a hundred of them. So:
- every plan is made for the whole queue, and admits every waiter that fits (not only the one
  that plans); the others find themselves admitted in the ledger and start;
- waiters sleep until a change concerns them, a signal arrives, or it is time to read the GPUs
  again: in a private ledger the writer signals just those waiters; in a shared one `wake.json`
  is watched (inotify, see `_watch`); with `wake = poll` it is stat-polled every `poll_interval`.
  On a change each reads only that small summary (see `_wake`). After a release, the first
  waiter in the queue plans;
- the GPUs are re-read every `nvml_interval` (with jitter) to notice processes outside gpuwait
  coming and going, by whichever waiter's timer fires first: the others skip their turn.
Every admission is decided under the ledger lock with a fresh snapshot, so two plans never both
hand out the same room. The same transaction records which GPUs the queue's head holds and notes
GPUs that stopped or started answering.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable

from gpuwait import _events, _signals, _wake
from gpuwait._backend import Backend
from gpuwait._bookkeeping import CANCELLED, DEPENDENCY_FAILED, Finished
from gpuwait._fairness import NO_FAIR_SHARE, FairShare, claims_for
from gpuwait._ledger import RUNNING, WAITING, Job, Ledger, LedgerData
from gpuwait._pause_runtime import ask_for_room, pause_progress
from gpuwait._pausing import PauseRules
from gpuwait._policy import (
    NO_CONDITIONS,
    Conditions,
    Plan,
    WaitReason,
    admission_fits,
    plan,
)
from gpuwait._queue import (
    UtilizationWindow,
    busy_gpus,
    name_processes,
    note_health,
    plan_conditions,
    record_hold,
    settle_dependencies,
)
from gpuwait._record import Record
from gpuwait._security import entry_owner_mismatch
from gpuwait._snapshot import GpuSnapshot, MachineSnapshot

#: While `--max-util` lacks enough readings to judge, the GPUs are read this often.
UTIL_SAMPLE_INTERVAL = 0.2
#: A waiter plans for itself at least this often, so its waiting line stays current...
OWN_PLAN_INTERVAL = 10.0
#: ... or, in a long queue, every this many seconds per waiter: a hundred waiters each reading
#: the GPUs and the whole ledger every 10 s would keep a third of a core busy doing nothing.
OWN_PLAN_SPACING = 0.5
#: After a release, the second waiter plans if the first has not within this long (it may be
#: stopped, e.g. suspended with Ctrl-Z).
BACKUP_DELAY = 0.25


class Admitted(Record, frozen=True):
    gpu_uuids: tuple[str, ...]
    reserved_bytes: int
    #: The GPUs, in the order of `gpu_uuids`, as last read.
    gpus: tuple[GpuSnapshot, ...]
    #: Found in the ledger, not planned by this process (another waiter's plan, or an edit).
    found: bool = False


class TimedOut(Record, frozen=True):
    reason: WaitReason | None


class Interrupted(Record, frozen=True):
    signum: int


class Cancelled:
    """`gpuwait cancel` took this job out of the queue."""

    __slots__ = ()


class DependencyFailed(Record, frozen=True):
    """An `--after-ok` dependency did not succeed, so this job can never start."""

    message: str


WaitOutcome = Admitted | TimedOut | Interrupted | Cancelled | DependencyFailed
_Attempt = Admitted | WaitReason | Cancelled | DependencyFailed | None


def _admit_all(ledger: Ledger, data: LedgerData, decided: Plan, snapshot: MachineSnapshot) -> None:
    """Mark every job the plan admits as running, on its GPUs."""
    now = time.time()
    index = {g.uuid: g.index for g in snapshot.gpus}
    for entry in data.jobs:
        uuids = decided.admitted.get(entry.id)
        if uuids is None:
            continue
        entry.state = RUNNING
        entry.gpu_uuids = list(uuids)
        entry.reserved_bytes = decided.reserved[entry.id]
        entry.started_at = entry.updated_at = now
        entry.held_gpus = []
        if entry.pick == "round-robin":
            data.rr_cursor = index[uuids[-1]]
        data.book.note_admitted(uuids)
        _events.emit(
            ledger.directory,
            "admit",
            job=entry.id,
            name=entry.name,
            gpus=list(uuids),
            reserved_bytes=entry.reserved_bytes,
            waited=round(now - entry.submitted_at, 3),
            backfill=list(decided.backfill.get(entry.id, ())),
        )


def _gpus_of(
    uuids: list[str], snapshot: MachineSnapshot, data: LedgerData
) -> tuple[GpuSnapshot, ...]:
    """The GPUs a job was given, from the snapshot, or as last seen where it lacks one."""
    seen = snapshot.by_uuid()
    gpus = []
    for uuid in uuids:
        health = data.book.health.get(uuid)
        if uuid in seen:
            gpus.append(seen[uuid])
        elif health is not None:
            gpus.append(GpuSnapshot(health.index, uuid, health.name, health.total_bytes, 0))
        else:
            gpus.append(GpuSnapshot(-1, uuid, "GPU", 0, 0))
    return tuple(gpus)


def try_admit(
    ledger: Ledger,
    job: Job,
    snapshot: MachineSnapshot,
    safety: float,
    conditions: Conditions = NO_CONDITIONS,
    fair: FairShare = NO_FAIR_SHARE,
) -> _Attempt:
    """Under the lock: plan for the queue and admit whoever fits; say what became of `job`."""
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
        if mine.state == RUNNING:
            return _found(job, mine, snapshot, data)
        note_health(ledger.directory, data, snapshot, now)
        failure = settle_dependencies(mine, data)
        if failure is not None:
            data.remove(job.id)
            data.book.note_finished(
                Finished(job.id, DEPENDENCY_FAILED, now, name=job.name, batch=job.batch)
            )
            _events.emit(ledger.directory, "leave", job=job.id, outcome=DEPENDENCY_FAILED)
            return DependencyFailed(failure)
        claims = claims_for(data, snapshot.gpus, fair, now)
        decided = plan(snapshot.gpus, claims, safety, data.rr_cursor, conditions, fair.limits)
        record_hold(data, decided.hold)
        _admit_all(ledger, data, decided, snapshot)
        job.__dict__.update(mine.__dict__)
        if job.id in decided.admitted:
            return Admitted(
                decided.admitted[job.id],
                mine.reserved_bytes,
                _gpus_of(mine.gpu_uuids, snapshot, data),
            )
        return decided.waiting.get(job.id)


def _reason_without_lock(
    data: LedgerData,
    job: Job,
    snapshot: MachineSnapshot,
    safety: float,
    conditions: Conditions,
    fair: FairShare = NO_FAIR_SHARE,
) -> WaitReason | None:
    """Why `job` still waits, judged from an unlocked read, or None when the lock is needed.

    It is needed to admit anyone, to reap a dead entry or drop a forged one, to settle a
    dependency, to record a GPU's health or the head's hold: anything that writes.
    """
    mine = data.find(job.id)
    if mine is None or mine.state == RUNNING or not all(j.is_alive() for j in data.jobs):
        return None
    if any(entry_owner_mismatch(j) is not None for j in data.jobs):
        return None  # a forged entry: the transaction drops it
    live = {j.id for j in data.jobs}
    if any(d not in live for d in (*mine.after, *mine.after_ok)):
        return None
    now = time.time()
    if data.book.health_would_change(snapshot, busy_gpus(data), now):
        return None
    claims = claims_for(data, snapshot.gpus, fair, now)
    decided = plan(snapshot.gpus, claims, safety, data.rr_cursor, conditions, fair.limits)
    if decided.admitted:
        return None
    for entry in data.jobs:
        held = decided.hold.gpu_uuids if decided.hold and entry.id == decided.hold.job_id else ()
        if entry.state != RUNNING and tuple(entry.held_gpus) != tuple(held):
            return None
    return decided.waiting.get(job.id)


def _admitted_by_another(ledger: Ledger, job: Job, last: MachineSnapshot | None) -> Admitted | None:
    """If another waiter's plan admitted `job`, what it was given.

    The GPUs are described from this waiter's last reading (or the ledger's record of them):
    reading them again would only delay the start.
    """
    data = ledger.read()
    mine = data.find(job.id)
    if mine is None or mine.state != RUNNING:
        return None
    return _found(job, mine, last or MachineSnapshot(backend="", gpus=()), data)


def _found(job: Job, mine: Job, snapshot: MachineSnapshot, data: LedgerData) -> Admitted:
    """`job` as its running entry `mine` has it, admitted by a plan other than this call's."""
    job.__dict__.update(mine.__dict__)
    return Admitted(
        tuple(mine.gpu_uuids),
        mine.reserved_bytes,
        _gpus_of(mine.gpu_uuids, snapshot, data),
        found=True,
    )


def _confirm_found(
    ledger: Ledger,
    backend: Backend,
    job: Job,
    asked: Job,
    safety: float,
    ignore_processes: frozenset[str],
) -> Admitted | None:
    """An admission found in a shared ledger, checked against fresh readings before it is used.

    Any member of the group can write the shared ledger, so an entry marked running may be an
    edit rather than a plan: one that puts the job (as it asked, `asked`) where the GPUs have no
    room for it is undone, and the job waits on. Another waiter's plan passes the check.
    """
    snapshot = backend.snapshot()
    if ignore_processes:
        snapshot = name_processes(snapshot)

    def check(data: LedgerData) -> tuple[Job | None, bool]:
        """This job's entry if it is running, and whether its admission holds."""
        mine = data.find(job.id)
        if mine is None or mine.state != RUNNING:
            return None, False
        ours = mine.uid == asked.uid and mine.pid == asked.pid
        others = [j.claim(snapshot.gpus) for j in data.jobs if j is not mine]
        return mine, ours and admission_fits(
            asked.claim(snapshot.gpus),
            mine.gpu_uuids,
            mine.reserved_bytes,
            others,
            snapshot.gpus,
            safety,
            ignore_processes,
        )

    # A lock-free read first: it can only count more than is there (entries of dead processes
    # not yet reaped), so an admission that holds on it holds; the lock is taken to undo one.
    data = ledger.read()
    mine, holds = check(data)
    if mine is not None and holds:
        return _found(job, mine, snapshot, data)
    with ledger.transaction() as data:
        mine, holds = check(data)
        if mine is None:
            return None
        if holds:
            return _found(job, mine, snapshot, data)
        ledger.warnings.append(
            f"ledger {ledger.path}: ignored an admission of job {job.id} that no plan made "
            "(its GPUs have no room for it, or the entry is not this process's); waiting on"
        )
        if mine.uid == asked.uid and mine.pid == asked.pid:
            mine.state = WAITING
            mine.gpu_uuids, mine.reserved_bytes, mine.held_gpus = [], 0, []
            mine.started_at = None
        job.__dict__.update(asked.__dict__)
    return None


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
    use_inotify: bool = True,
    fair: FairShare = NO_FAIR_SHARE,
    pause_rules: PauseRules | None = None,
) -> WaitOutcome:
    """Block until `job` is admitted, the monotonic `deadline` passes, or a signal arrives.

    Also ends when the job is cancelled or a dependency it needs to succeed fails.
    """
    state_dir = ledger.directory
    summary_path = _wake.wake_path(state_dir)
    #: The job as it asked: a shared ledger's entry can be edited by any member of the group.
    asked = job._replace()
    last_token: object = object()
    last_release: int | None = None
    next_read = 0.0
    next_own = 0.0
    reason: WaitReason | None = None
    window = UtilizationWindow()
    wants_utilization = job.requirements.get("max_util_pct") is not None
    watch = None
    # In a private ledger every writer is this user, and signals the waiters a change concerns.
    kicked = use_inotify and not ledger.shared
    queue_length = 1
    last: MachineSnapshot | None = None
    #: (monotonic time to act, wall time the release was seen) while standing in for the first.
    backup: tuple[float, float] | None = None

    def trusted(admitted: Admitted | None) -> Admitted | None:
        if admitted is None or not admitted.found or not ledger.shared:
            return admitted
        return _confirm_found(ledger, backend, job, asked, safety, ignore_processes)

    def attempt() -> _Attempt:
        """Read the GPUs, plan; take the lock only if the plan changes anything."""
        nonlocal last
        snapshot = last = backend.snapshot()
        if ignore_processes:
            snapshot = name_processes(snapshot)
        window.add(snapshot)
        facts = plan_conditions(window, ignore_processes)
        quiet = _reason_without_lock(ledger.read(), job, snapshot, safety, facts, fair)
        outcome = (
            quiet if quiet is not None else try_admit(ledger, job, snapshot, safety, facts, fair)
        )
        _wake.note_planned(state_dir)
        if isinstance(outcome, WaitReason) and pause_rules is not None:
            ask_for_room(ledger, job, snapshot, safety, pause_rules)
            # Said on every reading, not only when asking: the waiter must keep seeing why it
            # still waits (a job that does not catch the signal yet, or ignores it).
            outcome = outcome._replace(pause=pause_progress(ledger.read(), job.id, time.time()))
        return outcome

    try:
        while True:
            now = time.monotonic()
            event = False
            check_admitted = False
            token = _wake.file_token(summary_path)
            if token != last_token:
                last_token = token
                seen = _wake.read_summary(state_dir)
                if seen is None:
                    event = True
                elif job.id in seen.running:
                    check_admitted = True
                elif job.id not in seen.waiting:
                    event = True  # cancelled, or the ledger was recovered: look under the lock
                else:
                    position = seen.waiting.index(job.id)
                    if last_release is not None and seen.release != last_release:
                        if position == 0:
                            event = True
                        elif position == 1:
                            backup = (now + BACKUP_DELAY, time.time())
                    unfinished = set(seen.waiting) | seen.running
                    if any(d not in unfinished for d in (*job.after, *job.after_ok)):
                        event = True
                    last_release = seen.release
                    queue_length = len(seen.waiting)
            if check_admitted:
                found = _admitted_by_another(ledger, job, last)
                admitted = trusted(found)
                if admitted is not None:
                    return admitted
                if found is not None:
                    reason = None  # say why it waits again, after the warning
                event = True
            if backup is not None and now >= backup[0]:
                # Stand in for the first waiter only if it has not planned since the release.
                event = event or not _wake.planned_since(state_dir, backup[1] - 0.05)
                backup = None
            act = event
            if not event and now >= next_read:
                # A timer, not an event: another waiter's recent reading serves for this one,
                # unless this one's own waiting line is due.
                recently = time.time() - nvml_interval * 0.8
                act = now >= next_own or not _wake.planned_since(state_dir, recently)
                if not act:
                    next_read = now + nvml_interval * random.uniform(0.8, 1.2)
            if act:
                # Releases counted from here on come after this plan's reading: seen next time.
                seen = _wake.read_summary(state_dir)
                last_release = seen.release if seen is not None else None
                queue_length = len(seen.waiting) if seen is not None else queue_length
                outcome = attempt()
                if isinstance(outcome, Admitted):
                    outcome = trusted(outcome)
                    if outcome is None:
                        reason = None  # say why it waits again, after the warning
                if isinstance(outcome, (Admitted, Cancelled, DependencyFailed)):
                    return outcome
                if outcome is not None and outcome != reason:
                    on_reason(outcome)
                reason = outcome
                interval = nvml_interval
                if wants_utilization and window.needs_more():
                    interval = min(interval, UTIL_SAMPLE_INTERVAL)
                next_read = time.monotonic() + interval * random.uniform(0.8, 1.2)
                next_own = time.monotonic() + max(
                    OWN_PLAN_INTERVAL, OWN_PLAN_SPACING * queue_length
                )
            if watch is None and not kicked:
                # Set up only once the job has to wait: a launch that fits at once pays nothing.
                from gpuwait._watch import LedgerWatch

                watch = LedgerWatch(state_dir if use_inotify else None, bool(ledger.shared))
                continue  # the summary may have changed before the watch began
            watching = watch is not None and watch.active
            wake_at = next_read if backup is None else min(next_read, backup[0])
            sleep = max(0.0, wake_at - time.monotonic()) if kicked or watching else poll_interval
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    # Admitted by another waiter's plan at the last moment: then it runs.
                    return trusted(_admitted_by_another(ledger, job, last)) or TimedOut(reason)
                sleep = min(sleep, remaining)
            also = (watch.wake_signal,) if watch is not None and watching else ()
            info = _signals.next_signal(sleep, also=also)
            if info is None or info.si_signo == signal.SIGCHLD:
                continue  # SIGCHLD: a ledger writer's wake-up (a waiter has no child)
            if watch is not None and watching and info.si_signo == watch.wake_signal:
                watch.drain()
                continue
            return Interrupted(info.si_signo)
    finally:
        if watch is not None:
            watch.close()
