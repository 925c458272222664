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
the same room.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuwait import _signals
from gpuwait._backend import Backend
from gpuwait._fairness import NO_FAIR_SHARE, FairShare, claims_for
from gpuwait._ledger import RUNNING, Job, Ledger, LedgerData
from gpuwait._policy import WaitReason, plan
from gpuwait._snapshot import MachineSnapshot


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


WaitOutcome = Admitted | TimedOut | Interrupted

_Fingerprint = dict[str, tuple[str, int, tuple[int, ...], int | None]]


def _fingerprint(data: LedgerData) -> _Fingerprint:
    return {j.id: (j.state, j.reserved_bytes, tuple(j.pids), j.child_pid) for j in data.jobs}


def _released(before: _Fingerprint, after: _Fingerprint) -> bool:
    """True when `after` may hold room that `before` did not."""
    for job_id, (state, reserved, pids, child) in before.items():
        now = after.get(job_id)
        if now is None:
            return True
        if state == RUNNING and (now[0] != RUNNING or now[1] < reserved or now[2] != pids):
            return True
        if state == RUNNING and now[3] != child:
            return True
    return False


def try_admit(
    ledger: Ledger,
    job: Job,
    snapshot: MachineSnapshot,
    safety: float,
    fair: FairShare = NO_FAIR_SHARE,
) -> Admitted | WaitReason | None:
    """Under the lock: admit `job` if the plan lets it start now; otherwise say why it waits."""
    with ledger.transaction() as data:
        mine = data.find(job.id)
        if mine is None:
            # Our entry vanished (a damaged ledger was recovered): put it back where it was.
            data.jobs.append(job)
            mine = job
        claims = claims_for(data, snapshot.gpus, fair, time.time())
        decided = plan(snapshot.gpus, claims, safety, data.rr_cursor, fair.limits)
        if job.id not in decided.admitted:
            return decided.waiting.get(job.id)
        uuids = decided.admitted[job.id]
        mine.state = RUNNING
        mine.gpu_uuids = list(uuids)
        mine.reserved_bytes = decided.reserved[job.id]
        mine.started_at = mine.updated_at = time.time()
        if mine.pick == "round-robin":
            index = {g.uuid: g.index for g in snapshot.gpus}
            data.rr_cursor = index[uuids[-1]]
        job.__dict__.update(mine.__dict__)
        return Admitted(uuids, mine.reserved_bytes, snapshot)


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
    fair: FairShare = NO_FAIR_SHARE,
) -> WaitOutcome:
    """Block until `job` is admitted, the monotonic `deadline` passes, or a signal arrives."""
    last_token: object = object()
    last_seen: _Fingerprint | None = None
    next_read = 0.0
    reason: WaitReason | None = None
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
            snapshot = backend.snapshot()
            outcome = try_admit(ledger, job, snapshot, safety, fair)
            if isinstance(outcome, Admitted):
                return outcome
            if outcome is not None and outcome != reason:
                on_reason(outcome)
            reason = outcome
            last_token = ledger.change_token()
            next_read = time.monotonic() + nvml_interval * random.uniform(0.8, 1.2)
        sleep = poll_interval
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return TimedOut(reason)
            sleep = min(sleep, remaining)
        info = _signals.next_signal(sleep)
        if info is not None and info.si_signo != signal.SIGCHLD:
            return Interrupted(info.si_signo)
