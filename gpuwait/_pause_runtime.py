"""Cooperative pausing at run time: waiters ask through the ledger, the victim's gpuwait acts.

There is no daemon. A waiting job of higher priority that cannot fit marks, in the ledger, the
running `--pausable` jobs whose room it needs (chosen by gpuwait._pausing). Each marked job's own
gpuwait notices the mark, sends its command the checkpoint signal (only to processes that catch
it), and when the command exits with the resume status, puts the job back in the queue with its
original place; it is started again, with GPUWAIT_RESUME_COUNT raised, when it fits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence

from gpuwait import _events, _proc
from gpuwait._checkpoint_signal import deliver, parse_signal
from gpuwait._ledger import RUNNING, WAITING, Job, Ledger, LedgerData
from gpuwait._pausing import PauseRules, RunningJob, choose_victims
from gpuwait._policy import Claim, gpu_rooms, need_on
from gpuwait._sizes import format_duration
from gpuwait._snapshot import MachineSnapshot


def _running_view(data: LedgerData, gpus_snapshot: MachineSnapshot, now: float) -> list[RunningJob]:
    views = []
    for job in data.jobs:
        if job.state != RUNNING:
            continue
        claim = job.claim(gpus_snapshot.gpus, now)
        holds = max([job.reserved_bytes, *claim.observed.values()])
        views.append(
            RunningJob(
                job_id=job.id,
                priority=max(job.priority, job.boost),
                gpu_uuids=tuple(job.gpu_uuids),
                holds_bytes=holds,
                pausable=job.pausable,
                run_seconds=max(0.0, now - (job.started_at or now)),
                pauses=job.pauses,
                reload_seconds=job.load_seconds,
                asked=job.pause_requested_at is not None,
            )
        )
    return views


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


def ask_for_room(
    ledger: Ledger, job: Job, snapshot: MachineSnapshot, safety: float, rules: PauseRules
) -> tuple[str, ...]:
    """If `job` waits and pausing lower-priority jobs would let it in, mark them; return their ids.

    Nothing is asked while a request of this waiter is still pending, so one waiter never pauses
    more than it needs; jobs already asked by another waiter are neither asked again nor counted
    as room for this one.
    """
    if job.gpus != 1:
        return ()  # a gang would need room freed on several GPUs at once: not offered
    quick = ledger.read()
    priority = max(job.priority, job.boost)
    if not any(
        j.state == RUNNING and j.pausable and j.pause_requested_at is None and j.priority < priority
        for j in quick.jobs
    ):
        return ()
    now = time.time()
    with ledger.transaction() as data:
        mine = data.find(job.id)
        if mine is None or mine.state != WAITING:
            return ()
        if any(j.pause_requested_by == job.id for j in data.jobs if j.state == RUNNING):
            return ()
        claims = [j.claim(snapshot.gpus, now) for j in data.jobs]
        rooms = gpu_rooms(snapshot.gpus, claims, safety)
        my_claim = mine.claim(snapshot.gpus, now)
        need = {}
        for uuid, room in rooms.items():
            bytes_needed = need_on(my_claim, room)
            if bytes_needed is not None:
                need[uuid] = bytes_needed
        choice = choose_victims(
            need,
            {u: r.room for u, r in rooms.items()},
            priority,
            _running_view(data, snapshot, now),
            rules,
            expected_wait=_expected_wait(claims, need),
        )
        if choice is None:
            return ()
        for victim_id in choice.victims:
            victim = data.find(victim_id)
            if victim is not None:
                victim.pause_requested_at = now
                victim.pause_requested_by = job.id
        _events.emit(
            ledger.directory,
            "pause-request",
            job=job.id,
            victims=list(choice.victims),
            gpu=choice.gpu_uuid,
        )
        return choice.victims


#: A victim's gpuwait signals within a second or so of a request; one not signalled after this
#: long has a command that does not catch the signal (yet).
NOT_CAUGHT_AFTER = 5.0


def pause_progress(data: LedgerData, waiter_id: str, now: float) -> str | None:
    """What became of the jobs `waiter_id` asked to step aside, for its wait line; None if none.

    Worded without a running clock, so that a wait line written to a file changes only when
    the situation does.
    """
    parts = []
    for victim in data.jobs:
        if victim.state != RUNNING or victim.pause_requested_by != waiter_id:
            continue
        signalled = victim.pause_signalled_at
        signal_name = victim.checkpoint_signal.upper().removeprefix("SIG")
        if signalled is None and now - (victim.pause_requested_at or now) < NOT_CAUGHT_AFTER:
            parts.append(f"asked job {victim.id} to checkpoint and step aside")
        elif signalled is None:
            parts.append(
                f"asked job {victim.id} to checkpoint and step aside "
                f"(it does not catch {signal_name} yet; signalled once it does)"
            )
        elif now - signalled <= victim.grace_seconds:
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
                "(it was started without --grace-kill); waiting for it to end"
            )
    return "; ".join(parts) or None


class PauseResponder:
    """The victim's side: signal the command once asked; TERM after the grace if told to."""

    def __init__(self, ledger: Ledger, job: Job) -> None:
        self.ledger = ledger
        self.job = job
        self.signum = parse_signal(job.checkpoint_signal)
        self.token: object = None
        self.requested = False
        self.signalled_at: float | None = None
        self.killed = False

    def check(self, child: int) -> None:
        """Called often by the supervisor: cheap unless the ledger changed or a request waits."""
        token = self.ledger.change_token()
        if not self.requested and token == self.token:
            return
        self.token = token
        if not self.requested:
            entry = self.ledger.read().find(self.job.id)
            self.requested = entry is not None and entry.pause_requested_at is not None
            if not self.requested:
                return
        now = time.time()
        if self.signalled_at is None:
            # Only processes that catch the signal get it: one that has not installed its
            # handler yet would be killed by the default action. Asked again next time.
            sent = deliver(_proc.process_tree([child]), self.signum)
            if sent:
                self.signalled_at = now
                self._note_signalled(now, sent)
        elif (
            self.job.grace_kill
            and not self.killed
            and now - self.signalled_at > self.job.grace_seconds
        ):
            self.killed = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGTERM)
            _events.emit(self.ledger.directory, "pause-grace-kill", job=self.job.id)

    def _note_signalled(self, now: float, pids: Sequence[int]) -> None:
        with contextlib.suppress(Exception):
            with self.ledger.transaction() as data:
                mine = data.find(self.job.id)
                if mine is not None:
                    mine.pause_signalled_at = now
            _events.emit(self.ledger.directory, "pause-signal", job=self.job.id, pids=list(pids))


def requeue(ledger: Ledger, job: Job, run_seconds: float) -> None:
    """Put a job that checkpointed back in the queue, in its original place."""
    with ledger.transaction() as data:
        mine = data.find(job.id)
        if mine is None:
            data.jobs.append(job)
            mine = job
        requester = data.find(mine.pause_requested_by) if mine.pause_requested_by else None
        mine.boost = max(mine.boost, requester.priority if requester else 0)
        mine.yield_to = requester.id if requester else None
        mine.state = WAITING
        mine.gpu_uuids, mine.reserved_bytes, mine.observed = [], 0, {}
        mine.pids, mine.child_pid, mine.started_at = [], None, None
        mine.held_gpus = []
        mine.pauses += 1
        mine.pause_requested_at = mine.pause_requested_by = mine.pause_signalled_at = None
        mine.updated_at = time.time()
        vars(job).update(vars(mine))
    _events.emit(
        ledger.directory, "paused", job=job.id, pauses=job.pauses, ran_seconds=round(run_seconds, 3)
    )
