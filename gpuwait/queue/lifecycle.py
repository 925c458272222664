"""The one home of every change of a job's state.

A job's life in the ledger, each step a function here and nowhere else:

    submit ─> admit ─> start ─> publish usage ... ─> finish
                 │                  └─> pause request ─> pause signal ─> step aside ─> (admit ...)
                 │                                    └─> freeze ─> (admit ...) ─> thaw
                 └─> leave (timed out, interrupted, a dependency failed)     cancel, reap

Every function opens one write transaction (`_change`), and only this module calls
`Ledger.transaction` (a test checks it). Each transaction first reaps what no longer belongs in
the ledger: entries whose gpuwait process is gone, and entries that name another user's process
(forged). The events a change reports (see gpuwait.queue.events) are logged once the change is
in the file: a transaction that fails logs nothing. Functions return the job as the ledger now
has it; the caller's own `Job` is never changed.

What is read without a change (planning while nothing is to be written, `status`) does not come
here; `would_tidy` says when a lock-free reader has seen something a transaction would change.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from signal import SIGCONT, SIGTERM
from typing import Any

from gpuwait.core.errors import AlreadyQueued, ImpossibleRequest, StateError, UsageError
from gpuwait.core.estimate import DEFAULT_MARGIN
from gpuwait.core.overuse import overuse
from gpuwait.core.pausing import DEFAULT_GRACE_MAX, PauseChoice, still_pending
from gpuwait.core.policy import (
    NO_CONDITIONS,
    Claim,
    Conditions,
    FairShare,
    Plan,
    UserLimits,
    WaitReason,
    describe_need,
    unlisted_of_strangers,
)
from gpuwait.core.record import Record, field
from gpuwait.core.sizes import format_size
from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot
from gpuwait.linux import alive, netfs, pidns, proc, security, signals, userns
from gpuwait.linux.atomic import keep_damaged, write_atomic
from gpuwait.linux.security import (
    control_refusal,
    ensure_private_dir,
    entry_owner_mismatch,
    orphan_command_problem,
    orphan_control_refusal,
)
from gpuwait.queue import entries, events
from gpuwait.queue.bookkeeping import (
    CANCELLED,
    DEPENDENCY_FAILED,
    ENDED,
    FAILED,
    LOST,
    OUTCOMES,
    Finished,
)
from gpuwait.queue.conditions import (
    adoption_over_limit,
    busy_gpus,
    failed_dependency,
    machine_user,
    plan_ledger,
    planned_claims,
    record_hold,
    resolve_references,
    settle_dependencies,
    their_own_processes,
)
from gpuwait.queue.entries import (
    MAX_DEPENDENCIES,
    MAX_ENTRIES_PER_UID,
    RUNNING,
    WAITING,
    Job,
    LedgerData,
    charged_run_time,
    copy_job,
    elsewhere,
    of_an_earlier_boot,
    pause_stamps,
    run_before_freezing,
    run_time,
    since,
)
from gpuwait.queue.fairness import NO_FAIR_SHARE, charge
from gpuwait.queue.ledger import Ledger

_Said = list[tuple[events.Kind, dict[str, Any]]]
#: History records of runs found ended (adopted processes, jobs whose gpuwait was killed):
#: (state dir, record), written after commit.
_Ended = list[tuple[str, dict[str, Any]]]
#: Words of how runs ended (leave_word) that a transaction read: (path, believed), taken away
#: once it is written, so that one that writes nothing (a launch refused) leaves them be.
_Words = list[tuple[Path, bool]]

#: The entries' processes, looked at in every transaction (see gpuwait.linux.proc.LivenessReader).
_LIVENESS = proc.LivenessReader()

#: How long after a ledger was started afresh (a damaged one recovered, or removed) nobody is
#: admitted while jobs of this user live without an entry: each one's gpuwait puts it back
#: (a running job at its next sample, a waiter when it wakes), and its reservation counts
#: again; one that never does (its gpuwait killed, its command left) holds nobody longer.
RECOVERY_GRACE = 30.0


def forget_cached() -> None:
    """As if this process had never read or written a ledger (tests and benchmarks)."""
    entries.forget_cached_entries()
    _LIVENESS.close()


@contextmanager
def _change(ledger: Ledger, words: _Words | None = None) -> Iterator[tuple[LedgerData, _Said]]:
    """A write transaction, reaped first; the events said in it are logged once it committed.
    `words`, where given, gets the words of how reaped runs ended that it read (taken away, or
    set aside, once it is written)."""
    said: _Said = []
    quiet: set[str] = set()
    ended: _Ended = []
    words = [] if words is None else words
    with ledger.transaction(quiet) as data:
        _reap(ledger, data, quiet, said, ended, words)
        _carry_out_requests(data, said)
        for job in _yielding_to_a_started_job(data):
            job.yield_to = None
        yield data, said
    _take_words(words)
    for kind, fields in said:
        events.emit(ledger.directory, kind, **fields)
    if ended:
        from gpuwait.history import store  # only a run found ended needs it

    for state_dir, record in ended:
        # Its process is gone; only the record would be lost, never the transaction (but for
        # the timeout of a program that reserves from Python, raised by its handler as this
        # waited for the history's lock: that reaches the program).
        with signals.suppress_failures(OSError):
            store.append_record(Path(state_dir), record)


def _reap(
    ledger: Ledger, data: LedgerData, quiet: set[str], said: _Said, ended: _Ended, words: _Words
) -> None:
    """Take out the entries whose processes are gone (their jobs count as lost) and those that
    name another user's process (forged); their ids go into `quiet`: nobody is woken for them.
    The words of how their runs ended that it read go into `words`, to take away once written.

    A running job whose gpuwait is gone but whose command still runs (gpuwait was killed with
    SIGKILL) is orphaned, not gone: its entry keeps the command's room until the command ends,
    since the command goes on allocating and handing its room to the next job would kill it.
    """
    # Other users' entries are theirs to reap: they were read only if the kernel shows a
    # job of theirs behind them (gpuwait.queue.ledger).
    own: list[Job] = []
    gone: list[Job] = []
    for job in data.jobs:
        if data.mine(job) and not elsewhere(job):
            # Left by a machine that went down: whoever has their pids now, they are gone.
            (gone if of_an_earlier_boot(job.boot) else own).append(job)
    lives = _LIVENESS.alive([(j.pid, j.start_time) for j in own])
    gone += [
        j
        for j in data.jobs
        if data.mine(j) and elsewhere(j) and not lives_elsewhere(ledger.directory, j)
    ]
    now = time.time()
    for job, running in zip(own, lives, strict=True):
        if running:
            continue
        if not command_lives(job, ledger.directory) and not _command_found(ledger, job):
            gone.append(job)
        elif job.orphaned_at is None:
            job.orphaned_at = now
            said.append(
                (
                    "orphaned",
                    {
                        "job": job.id,
                        "pid": job.pid,
                        "child_pid": job.child_pid,
                        "gpus": job.gpu_uuids,
                    },
                )
            )
    for job in gone:
        data.jobs.remove(job)
        read = len(words)
        told = _word_left(job, words)
        # A word left but not believed (damaged, another schema's) still says that its gpuwait
        # saw the run end, and records it: a record of it found ended would be a second one.
        recorded_itself = len(words) > read
        if told is not None:
            # Its gpuwait saw how it ended, and recorded the run, but could not take the
            # entry out before it left (another process kept the lock): it ended so.
            outcome, how = told
            ran_on = job.gpu_uuids if job.state == RUNNING else []
            charge_usage = how.get("charge_usage")
            done, fields = _run_ended(
                job,
                outcome,
                ran_on,
                now,
                how.get("exit_status"),
                how.get("signal"),
                how.get("run_seconds"),
                how.get("paused"),
                how.get("oom"),
                _cancelled_by(data, job),
            )
            data.book.note_finished(done, ran_on)
            if charge_usage is not None:
                charge(data, job.uid, charge_usage[0], now, charge_usage[1])
            said.append(("finish" if ran_on else "leave", fields))
            continue
        if job.state == RUNNING and job.started_at is not None:
            # Its gpuwait cannot charge its run any more (killed with its command, or an
            # adopted process's end): what it held until it was found gone is its user's.
            held = job.reserved_in_all() * _ran_until_gone(job, now)
            charge(data, job.uid, held, now, ledger.fair_half_life)
        by_uid = _cancelled_by(data, job)
        data.book.note_finished(
            Finished(
                id=job.id,
                outcome=(
                    CANCELLED
                    if by_uid is not None
                    else LOST
                    if job.adopted_history is None
                    else ENDED
                ),
                finished_at=now,
                name=job.name,
                batch=job.batch,
                by_uid=by_uid,
            ),
            job.gpu_uuids if job.state == RUNNING else (),
        )
        if job.adopted_history is not None:
            ended.append((job.adopted_history, _found_ended_record(job, data, now)))
        elif (
            job.history_dir is not None
            and job.state == RUNNING
            and job.started_at is not None
            and not recorded_itself
        ):
            ended.append((job.history_dir, _found_ended_record(job, data, now)))
        said.append(
            ("reap", {"job": job.id, "pid": job.pid, "state": job.state, "gpus": job.gpu_uuids})
        )
    # An orphan's own gpuwait pid is gone (and may be anyone's now): it is judged by its command.
    forged = [
        j
        for j in data.jobs
        if data.mine(j)
        and j.orphaned_at is None
        and not elsewhere(j)
        and entry_owner_mismatch(j) is not None
    ]
    if forged:
        from gpuwait.core.text import printable  # only a hostile file needs it

        for job in forged:
            data.jobs.remove(job)
            ledger.warnings.append(
                f"ledger {ledger.path}: dropped entry {printable(job.id, 16)}: it claims uid "
                f"{job.uid} but its process {job.pid} belongs to another user"
            )
    quiet.update(j.id for j in (*gone, *forged))
    if gone:
        alive.sweep(ledger.directory, {j.id for j in data.jobs if data.mine(j)})


#: Where a gpuwait that could not take its job's entry out leaves how the job ended, under the
#: job's state dir (its history_dir): `ended/<job id>.json`.
_WORD_DIR = "ended"


def _word_path(job: Job) -> Path | None:
    if job.history_dir is None or not job.id.isalnum():
        return None
    return Path(job.history_dir) / _WORD_DIR / f"{job.id}.json"


def leave_word(ledger: Ledger, job: Job, outcome: str, **how: Any) -> bool:
    """How `job` ended (`outcome`, and finish's keywords), for whoever reaps its entry once
    this gpuwait is gone: for a gpuwait about to end that could not take the entry out (another
    process kept the ledger's lock), rather than keep its user waiting for the lock. False
    where it cannot be left (the entry is then reaped as lost)."""
    import json  # only a run that ends while the lock is held needs it

    path = _word_path(job)
    if path is None:
        return False
    try:
        ensure_private_dir(path.parent)
        # The ledger it is for, and this machine's: a word its entry no longer stands for
        # there is tidied away (`_sweep_words`).
        word = {"schema": _WORD_SCHEMA, "outcome": outcome, **_words_ledger(ledger), **how}
        write_atomic(path, json.dumps(word).encode())
    except (OSError, StateError):
        return False
    return True


def _words_ledger(ledger: Ledger) -> dict[str, str | None]:
    """What a word says of the ledger it was left for: its path, and the machine it is on (its
    host name, and this boot of it). A state dir in a home that several machines mount holds
    the words of each, where a `ledger_dir` of one path (/var/lib/gpuwait) is a ledger of each
    machine's own."""
    return {
        "ledger": str(ledger.directory),
        "machine": netfs.machine_name(),
        "boot": proc.boot_id(),
    }


def _left_here(word: dict[str, Any], ledger: Ledger) -> bool:
    """Was `word` left for `ledger` on this machine: by its host name, or by this boot (a
    container with a host name of its own runs on it too)? A word left on another machine
    is that machine's to read."""
    here = _words_ledger(ledger)
    return word.get("ledger") == here["ledger"] and any(
        here[key] is not None and word.get(key) == here[key] for key in ("machine", "boot")
    )


def _of_old(word: dict[str, Any], ledger: Ledger) -> bool:
    """Was `word` left for `ledger` by a gpuwait of before words named their machine (no host
    name, no boot id)? It may be another machine's, at the same ledger path there: only once
    older than _OLD_WORD_AGE is it taken for none that a gpuwait still waits to read."""
    return (
        word.get("ledger") == str(ledger.directory) and "machine" not in word and "boot" not in word
    )


#: A word is read by the next transaction of its ledger's machine, seconds after it is left:
#: one of before words named their machine, older than this, is nobody's to read any more.
_OLD_WORD_AGE = 30 * 24 * 3600.0
#: The version of a word's layout (leave_word): one of another is not believed.
_WORD_SCHEMA = 1
#: A word is a line of a few fields; a bigger file is none.
_WORD_CAP = 64 << 10


def _figure(value: Any, low: float, high: float) -> bool:
    """Is `value` a number from `low` up to (not including) `high`? (NaN and infinities are
    none.)"""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value < high


def _pair(value: Any, first: Callable[[Any], bool], second: Callable[[Any], bool]) -> bool:
    return isinstance(value, list) and len(value) == 2 and first(value[0]) and second(value[1])


#: The keywords of finish a word left (leave_word) may give, and what each may be: a figure
#: that no run ends with is damage, which, believed, would fail every transaction (a half-life
#: of zero), or go into the book, which the next read would drop whole with every outcome.
_WORD_FIELDS: dict[str, Callable[[Any], bool]] = {
    "exit_status": lambda v: type(v) is int and 0 <= v < 2**31,
    "signal": lambda v: type(v) is int and 0 < v < 2**31,
    "run_seconds": lambda v: _figure(v, 0, 1e12),
    # (VRAM-seconds, half-life or None)
    "charge_usage": lambda v: _pair(
        v, lambda a: _figure(a, 0, 1e30), lambda b: b is None or (_figure(b, 0, 1e12) and b > 0)
    ),
    # (pauses, seconds stepped aside)
    "paused": lambda v: _pair(v, lambda a: _figure(a, 0, 1e9), lambda b: _figure(b, 0, 1e12)),
    "oom": lambda v: isinstance(v, str) and 0 < len(v) <= 64,
}


def _word_left(job: Job, words: _Words) -> tuple[str, dict[str, Any]] | None:
    """How the gone `job` ended, as its gpuwait left word of it (leave_word), the word added to
    `words` (for _take_words once the entry's removal is written); None where none was left, or
    it cannot be read (a damaged word is not believed: the entry is then reaped as lost; nor is
    one that is no plain file of this user's, or is over the cap, which is never waited on or
    read whole)."""
    path = _word_path(job)
    if path is None:
        return None
    try:
        raw = security.read_state_file(path, _WORD_CAP, security.mine())
    except security.UnsafePath:
        raw = b""  # not believed, and set aside as a damaged word is
    except OSError:
        return None
    if raw is None:
        return None
    word = _parsed_word(raw)
    words.append((path, word is not None))
    return word


def _take_words(words: _Words) -> None:
    """Take away the words read (_word_left), their entries' removal written: a word believed
    is deleted, a damaged one kept beside, as evidence."""
    for path, believed in words:
        with contextlib.suppress(OSError):
            if believed:
                path.unlink()
            else:
                keep_damaged(path)


def _sweep_words(
    ledger: Ledger, state_dir: str | None, listed: set[str], read: Collection[Path] = ()
) -> None:
    """Remove the words left in `state_dir` for this ledger that no entry (`listed`: this
    user's job ids in it) stands for any more: a program whose thread took its entry out once
    the lock was free ended before it removed its word. Called under the ledger's lock, so no
    word is taken away that a gpuwait left for an entry still there; one left for another
    ledger (the same state dir serves several, on one machine or several) is not this one's
    to judge, nor one this transaction `read` as it reaped the entry (_take_words takes it
    once that is written)."""
    import json  # only where words were ever left

    if state_dir is None:
        return
    directory = Path(state_dir) / _WORD_DIR
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        job_id, _, rest = name.partition(".")
        path = directory / name
        if rest != "json" or job_id in listed or path in read:
            continue
        try:
            # As a word is read where its entry is reaped: never waited on (a FIFO), never
            # followed (a symlink), never read past its cap. UnsafePath is an OSError.
            raw = security.read_state_file(path, _WORD_CAP, security.mine())
            word = json.loads(raw or b"null")
            age = time.time() - os.lstat(path).st_mtime
        except (OSError, ValueError, RecursionError):
            continue
        if isinstance(word, dict) and (
            _left_here(word, ledger) or (_of_old(word, ledger) and age > _OLD_WORD_AGE)
        ):
            with contextlib.suppress(OSError):
                path.unlink()


def _parsed_word(raw: bytes) -> tuple[str, dict[str, Any]] | None:
    import json

    try:
        word = json.loads(raw)
    except ValueError:
        return None
    if (
        not isinstance(word, dict)
        or word.get("schema") != _WORD_SCHEMA
        or word.get("outcome") not in OUTCOMES
    ):
        return None
    how: dict[str, Any] = {}
    for name, valid in _WORD_FIELDS.items():
        value = word.get(name)
        if value is None:
            continue
        if not valid(value):
            return None
        how[name] = tuple(value) if isinstance(value, list) else value
    return word["outcome"], how


def _command_found(ledger: Ledger, job: Job) -> bool:
    """Whether the running `job`, whose gpuwait was killed after it started the command and
    before the entry named it (`started`), has that command running: found by the job's id in
    its environment, which every command gets, and named in the entry now, so that the entry
    is kept for it as for any orphan rather than reaped while it runs in the job's room."""
    if job.state != RUNNING or job.child_pid is not None or of_an_earlier_boot(job.boot):
        return False
    if job.pidns is not None and alive.held(ledger.directory, job.uid, job.id, job.kuid) is False:
        return False  # nothing holds the job's lock, which its command inherits: none runs
    child = proc.started_with(b"GPUWAIT_JOB_ID", job.id)
    if child is None:
        return False
    job.child_pid, job.child_start_time, job.pids = child, proc.start_time(child), [child]
    return command_lives(job, ledger.directory)


def _found_ended_record(job: Job, data: LedgerData, now: float) -> dict[str, Any]:
    """The history record of a running job found ended, which no gpuwait waited on: an
    adopted process, or the command of a job whose gpuwait was killed (`lost`). Its exit status
    is unknown (recorded as None), so no estimate learns from it, and its peak is the last
    that was published of it (an adopted process's: what it used when it was adopted). Its
    run time is until it was found gone (`_ran_until_gone`)."""
    from gpuwait.history import record as run_record  # rarely needed: kept out of launches

    adopted = job.adopted_history is not None
    gpus = []
    for uuid in job.gpu_uuids:
        health = data.book.health.get(uuid)
        if health is not None:
            gpus.append(GpuSnapshot(health.index, uuid, health.name, health.total_bytes, 0))
        else:
            gpus.append(GpuSnapshot(-1, uuid, "GPU", 0, 0))
    started_at = job.started_at if job.started_at is not None else job.submitted_at
    record = run_record.build(
        job_id=job.id,
        name=job.name,
        batch=job.batch,
        command=job.command,
        cwd=job.cwd,
        key=job.key,
        history_commands=job.adopted_commands if adopted else job.history_commands,
        request=job.request,
        request_source="adopted" if adopted else "unknown",
        reserved_bytes=job.reserved_bytes,
        gpus=gpus,
        measured=run_record.Measured(
            peak_by_gpu=dict(job.observed),
            peak_approximate=False,
            time_to_peak=None,
            samples=1 if job.observed else 0,
            free_at_peak_bytes={},
            run_seconds=_ran_until_gone(job, now),
            returncode=0,
            oom=False,
            oom_evidence=None,
            stderr_watched="off",
        ),
        wait_seconds=0.0,
        started_at=started_at,
    )
    record["exit_status"] = None
    record["adopted" if adopted else "lost"] = True
    return record


def _ran_until_gone(job: Job, now: float) -> float:
    """How long the running `job`, whose processes were found gone at `now`, ran at most:
    timed as a running job's is charged (entries.charged_run_time: on the boot clock, less a
    suspend, with a thawed job's runs before its freeze), where it ran in this boot; one of an
    earlier boot, whose clocks those are not, ended by the time this boot began, and is timed
    on the wall clock up to then. (Since its start, or where none was recorded, its
    submission.)"""
    boot_now = proc.boot_clock()
    if job.started_at is not None and not of_an_earlier_boot(job.boot):
        return charged_run_time(job, now, boot_now)
    started = job.started_at if job.started_at is not None else job.submitted_at
    ended = min(now, now - boot_now) if of_an_earlier_boot(job.boot) else now
    return max(0.0, ended - started) + run_before_freezing(job)


def _carry_out_requests(data: LedgerData, said: _Said) -> None:
    """Cancel this user's waiting jobs that root asked to cancel, and forget this user's own
    requests whose target or asker has left. (Pause requests are read as marks on their targets:
    gpuwait.queue.entries.mark_pause_requests.)"""
    for request in _cancels_for_me(data):
        job = next((j for j in data.jobs if request.targets(j)), None)
        if job is None or job.state != WAITING:
            continue
        data.jobs.remove(job)
        data.book.note_finished(
            Finished(
                job.id,
                CANCELLED,
                time.time(),
                name=job.name,
                batch=job.batch,
                by_uid=request.by_uid,
            )
        )
        said.append(
            (
                "cancel",
                {
                    "job": job.id,
                    "name": job.name,
                    "state": job.state,
                    "by_uid": request.by_uid,
                    "refused": False,
                },
            )
        )
    ids = {j.id for j in data.jobs}
    data.requests = [
        r
        for r in data.requests
        if data.me not in (None, r.by_uid)
        or (any(r.targets(j) for j in data.jobs) and (r.by_job is None or r.by_job in ids))
    ]


def _cancelled_by(data: LedgerData, entry: Job) -> int | None:
    """Who cancelled the running job `entry` (`cancel`): its owner, marked in the entry, or
    root, in a request of its own file; None where nobody did."""
    if entry.cancelled_by is not None:
        return entry.cancelled_by
    asked = next((r for r in _cancels_for_me(data) if r.targets(entry)), None)
    return None if asked is None else asked.by_uid


def was_cancelled(ledger: Ledger, job: Job) -> bool:
    """Was the running job `job` cancelled (`cancel`)? A read, which changes nothing."""
    data = ledger.read()
    mine = data.find(job.id)
    return mine is not None and _cancelled_by(data, mine) is not None


def _cancels_for_me(data: LedgerData) -> list[entries.Request]:
    """Requests from other users' files to cancel a job of this user's: root's only."""
    if data.me is None:
        return []
    return [
        r
        for r in data.requests
        if r.kind == entries.CANCEL and r.by_uid == 0 and r.uid == data.me != 0
    ]


def _drop_requests(data: LedgerData, job_id: str) -> None:
    """A waiter that starts or leaves no longer asks anyone to step aside."""
    data.requests = [
        r for r in data.requests if not (r.by_job == job_id and data.me in (None, r.by_uid))
    ]
    entries.mark_pause_requests(data)


def lives_elsewhere(ledger_dir: Path, job: Job) -> bool:
    """Does a job of another pid namespace live: its lock held (or not to be told, which keeps
    it as a live one is kept)? Its gpuwait or its command may hold it (gpuwait.linux.alive)."""
    return alive.held(ledger_dir, job.uid, job.id, job.kuid) is not False


def command_lives(job: Job, ledger_dir: Path) -> bool:
    """Does the command of a running job still run, as its entry's owner? (Pid and start time,
    so a reused pid never counts; another user's process named there never does.)"""
    return (
        job.state == RUNNING
        and not of_an_earlier_boot(job.boot)
        and orphan_command_problem(
            job, job.child_pid, job.child_start_time, _holds_lock(job, ledger_dir)
        )
        is None
    )


#: (ledger directory, job id, command pid, its start time) of commands found holding their
#: job's liveness lock: that process stays the job's command (an exec keeps both), so its open
#: files, a thousand in a server, are looked through once, not in every waiter's every plan.
_LOCK_HOLDERS: set[tuple[Path, str, int, int | None]] = set()


def _holds_lock(job: Job, ledger_dir: Path) -> Callable[[], bool]:
    """Whether the command `job` names has the job's liveness lock open (inherited from its
    gpuwait): proof that it is the job's own where its environment was written over."""

    def holds() -> bool:
        if job.child_pid is None:
            return False
        key = (ledger_dir, job.id, job.child_pid, job.child_start_time)
        if key in _LOCK_HOLDERS:
            return True
        if not alive.opened_by(ledger_dir, job.uid, job.id, job.child_pid, job.kuid):
            return False
        if len(_LOCK_HOLDERS) > 4096:
            _LOCK_HOLDERS.clear()
        _LOCK_HOLDERS.add(key)
        return True

    return holds


def _entry(data: LedgerData, job: Job) -> Job:
    """`job`'s entry in `data`; put back (a copy) where it went missing, e.g. when a damaged
    ledger was recovered: a job that runs or waits must never lose its place or reservation."""
    mine = data.find(job.id)
    if mine is None:
        mine = copy_job(job)
        data.jobs.append(mine)
        data.put_back = True
        _keep_place(data, mine)
    return mine


def _keep_place(data: LedgerData, mine: Job) -> None:
    """Keep the place in the queue of `mine`, a waiter's entry put back: a file started afresh
    numbers its launches from 1 again, so one launched after `mine` may have been given a
    place before it. Such entries of this file go behind it, in their own order: with every
    other one launched after it, those numbered past it too (`third` of three launches, 3, is
    not to pass `first` and `second`, 1 and 2, where `mine` is 2). `mine` itself goes behind
    one launched before it that has a place behind it: its gpuwait knew it by a place it was
    given before the entries were renumbered (the ledger damaged twice), and those launched
    after it go behind it again. So does it where another member's job launched after it has
    a place before it (given while this file was lost, which numbers the directory's launches
    from 1 again): it takes the first free place behind those launched before it, from 0."""
    data.next_order = max(data.next_order, mine.order + 1)
    if mine.state == RUNNING:
        return
    # How long ago each was launched, on the boot clock where both were stamped on it: the
    # wall clock set back since `mine`'s launch stamps those made after it earlier.
    now, boot_now = time.time(), proc.boot_clock()
    age = since(mine.submitted_at, mine.submitted_boot, now, boot_now)
    others = [j for j in data.jobs if j is not mine and data.mine(j) and j.state != RUNNING]
    after = [_launched_after(j, mine, age, now, boot_now) for j in others]
    later = sorted((j for j, a in zip(others, after, strict=True) if a), key=lambda j: j.order)
    if any(j.order >= mine.order for j, a in zip(others, after, strict=True) if not a) or any(
        j.order < mine.order and _launched_after(j, mine, age, now, boot_now)
        for j in data.jobs
        if not data.mine(j) and j.state != RUNNING
    ):
        later = [mine, *later]
    elif all(j.order > mine.order for j in later):
        return
    _renumber(data, later, now, boot_now)


def _renumber(data: LedgerData, moved: list[Job], now: float, boot_now: float | None) -> None:
    """Give `moved`, entries of this file, places in their own order, each behind every entry
    waiting that was launched before it, whoever's, and ahead of those launched after it where
    a place is free between: in a shared ledger directory other members' jobs keep theirs, and
    one launched after `moved` is not to be passed by the directory's next number. Places go
    down to 0, the lowest a reader takes (an entry with a lower one is dropped as malformed):
    the one free before an entry given place 1."""
    moving = {id(m) for m in moved}
    taken = {j.order for j in data.jobs if id(j) not in moving}
    waiting = [j for j in data.jobs if j.state != RUNNING and id(j) not in moving]
    # Which entries were launched before one is told as `_launched_after` tells it, on the boot
    # clock between two stamped on it, else on the wall clock: the highest place of each kind
    # is looked up, in entries sorted once, not looked for in all of them for every one moved.
    on_boot = boot_now is not None
    by_age = _highest_places(
        (-since(j.submitted_at, j.submitted_boot, now, boot_now), j.order)
        for j in waiting
        if on_boot and j.submitted_boot is not None
    )
    by_wall = _highest_places(
        (j.submitted_at, j.order) for j in waiting if not on_boot or j.submitted_boot is None
    )
    by_wall_all = _highest_places((j.submitted_at, j.order) for j in waiting)
    behind = -1
    for job in moved:
        if on_boot and job.submitted_boot is not None:
            age = since(job.submitted_at, job.submitted_boot, now, boot_now)
            before = max(by_age(-age), by_wall(job.submitted_at))
        else:
            before = by_wall_all(job.submitted_at)
        place = max(behind, before) + 1
        while place in taken:
            place += 1
        job.order, behind = place, place
        data.next_order = max(data.next_order, place + 1)


def _highest_places(entries_by: Iterable[tuple[float, int]]) -> Callable[[float], int]:
    """For (key, place) pairs: the highest place of those whose key is at most the one asked
    (-1 where none is)."""
    pairs = sorted(entries_by)
    keys = [key for key, _ in pairs]
    highest = list(itertools.accumulate((place for _, place in pairs), max))

    def up_to(key: float) -> int:
        count = bisect.bisect_right(keys, key)
        return highest[count - 1] if count else -1

    return up_to


def _launched_after(j: Job, mine: Job, age: float, now: float, boot_now: float | None) -> bool:
    """Was `j` launched after `mine`, launched `age` seconds ago? Told on one clock: the boot
    clock where both were stamped on it, else the wall clock."""
    if None not in (j.submitted_boot, mine.submitted_boot, boot_now):
        return since(j.submitted_at, j.submitted_boot, now, boot_now) < age
    return j.submitted_at > mine.submitted_at


def _note_health(data: LedgerData, snapshot: MachineSnapshot, now: float, said: _Said) -> None:
    """Record which GPUs answered in this reading, saying which were lost, came back or added."""
    for event in data.book.note_health(snapshot, busy_gpus(data), now):
        kind = event.pop("kind")
        said.append((kind, event))


# --- reading without a change -------------------------------------------------------------


def would_tidy(
    data: LedgerData, snapshot: MachineSnapshot | None, now: float, directory: Path
) -> bool:
    """Would a transaction change `data` (read without the lock from the ledger in `directory`)
    before anything else: reap an entry, drop a forged one, or note a GPU's health?"""
    for job in data.jobs:
        if not data.mine(job):
            continue
        if elsewhere(job):
            if not lives_elsewhere(directory, job):
                return True
        elif of_an_earlier_boot(job.boot):
            return True
        elif proc.is_alive(job.pid, job.start_time):
            if entry_owner_mismatch(job) is not None:
                return True
        elif job.orphaned_at is None or not command_lives(job, directory):
            return True
    if any(r.targets(j) for r in _cancels_for_me(data) for j in data.jobs if j.state == WAITING):
        return True
    if _yielding_to_a_started_job(data):
        return True
    return snapshot is not None and data.book.health_would_change(snapshot, busy_gpus(data), now)


def tidy(ledger: Ledger, snapshot: MachineSnapshot | None, now: float | None = None) -> LedgerData:
    """Reap and note the GPUs' health, as any transaction would; return the ledger as it is then."""
    with _change(ledger) as (data, said):
        if snapshot is not None:
            _note_health(data, snapshot, time.time() if now is None else now, said)
    return data


def reap(ledger: Ledger) -> list[str]:
    """Take out the entries whose process is gone; return their ids."""
    with _change(ledger) as (_, said):
        pass
    return [fields["job"] for kind, fields in said if kind == "reap"]


# --- entering the queue ---------------------------------------------------------------------


def submit(
    ledger: Ledger,
    job: Job,
    after: Sequence[str],
    after_ok: Sequence[str],
    state_dir: Path,
    logged_command: list[str],
) -> Job:
    """Put `job` in the queue, unless its user already has as many entries as one may.

    `after`/`after_ok` are `--after` references (ids, names, batches) resolved here, against the
    ledger and the history in `state_dir`. `logged_command`: the command as the event log keeps
    it (see history_commands). Raises StateError at the cap, UsageError for a reference that
    names no job, AlreadyQueued when the job has a `once` key that one of its user's entries
    already has: looked for in the same transaction as the write, so of submissions racing
    with one key exactly one is queued.
    """
    # Should the entry not get into the file, its lock stands for nothing.
    with (
        alive.given_up(ledger.directory, job.id, on_error=True),
        _change(ledger) as (data, said),
    ):
        if job.once is not None:
            twin = next((j for j in data.jobs if j.uid == job.uid and j.once == job.once), None)
            if twin is not None:
                label = twin.id if twin.name is None else f"{twin.id} ({twin.name})"
                raise AlreadyQueued(
                    f"--once {job.once}: job {label} with this key is already {twin.state}; "
                    "nothing was queued",
                    hint="see `gpuwait status`",
                )
        mine = sum(1 for j in data.jobs if j.uid == job.uid)
        if mine >= MAX_ENTRIES_PER_UID:
            raise StateError(
                f"you already have {mine} gpuwait jobs in the ledger, the most one user may",
                hint="wait for some to finish",
            )
        met: dict[str, list[str]] = {}
        for option, refs in (("--after", after), ("--after-ok", after_ok)):
            try:
                met[option] = _unmet(
                    resolve_references(refs, data, state_dir), data, ok=option == "--after-ok"
                )
            except ValueError as exc:
                # Named as given: the option a script passed is the one to look at.
                raise UsageError(
                    f"{option}: {exc}", hint="see `gpuwait status` and `gpuwait log`"
                ) from None
        entry = copy_job(job)._replace(
            after=met["--after"],
            after_ok=met["--after-ok"],
            order=data.next_order,
            boot=proc.boot_id(),
            kuid=userns.outer(job.uid),
            submitted_boot=proc.boot_clock() if job.submitted_boot is None else job.submitted_boot,
        )
        # Locked before the entry is in the file, so no reader elsewhere ever finds it unlocked.
        # In a shared ledger too, where it tells this user's gpuwait which of their jobs live
        # without an entry once their file was started afresh (`_entries_to_come_back`); but
        # no pid namespace is recorded there: other users' entries count only as far as the
        # kernel shows their processes, so every member needs the host's pids (--pid=host).
        if alive.hold(ledger.directory, job.id, ledger.listed_names()) and not ledger.shared:
            entry.pidns = pidns.current()
        data.next_order += 1
        data.jobs.append(entry)
        said.append(
            (
                "submit",
                {
                    "job": job.id,
                    "name": job.name,
                    "batch": job.batch,
                    "priority": job.priority,
                    "command": logged_command,
                },
            )
        )
    return copy_job(entry)


def _unmet(ids: list[str], data: LedgerData, ok: bool = False) -> list[str]:
    """The dependencies among `ids` that are not met yet: a job that ended meets `--after`, and
    `--after-ok` if it succeeded (one that failed stays, and fails the job at its first plan).
    A batch names its ended jobs too, and after a sweep of a thousand an entry listing them
    all would be more than a read accepts. ValueError past that, even so, and for `--after-ok`
    naming another user's job: how it ends is written in its user's file alone, which nobody
    else's plan reads, so it could never be met."""
    live = data.referred(ids)
    unmet = []
    for dep in ids:
        theirs = live.get(dep) if ok else None
        if theirs is not None and not data.mine(theirs):
            from gpuwait.core.text import printable  # only such a mistake needs it

            raise ValueError(
                f"job {printable(dep, 16)} is uid {theirs.uid}'s, and only its user learns how "
                "it ends; --after waits for it to end, however it ends"
            )
        done = None if dep in live or not ok else data.book.outcome(dep)
        if dep in live or (ok and (done is None or not done.succeeded)):
            unmet.append(dep)
    if len(unmet) > MAX_DEPENDENCIES:
        raise ValueError(
            f"it names {len(unmet)} jobs that have not ended, more than the "
            f"{MAX_DEPENDENCIES} one job may wait for"
        )
    return unmet


def refuse_a_jobs_process(data: LedgerData, pid: int) -> None:
    """UsageError where process `pid` already belongs to a job in `data` (for `adopt`): is
    its gpuwait, its command, one it published, or runs below them now (started since it
    last published its pids; an adopted process's entry keeps those of its adoption)."""
    for other in data.jobs:
        if elsewhere(other):
            continue  # its pids are another namespace's
        # Another user's entry claims only processes of theirs (or below their gpuwait).
        among = {pid, other.pid, *([other.child_pid] if other.child_pid is not None else [])}
        other = other if data.mine(other) else their_own_processes(other, among)
        if pid in (other.pid, other.child_pid) or pid in other.pids or _below(other, pid):
            raise UsageError(
                f"process {pid} already belongs to gpuwait job {other.id}",
                hint="see `gpuwait status`",
            )


def _below(job: Job, pid: int) -> bool:
    """Does process `pid` run below `job`'s gpuwait or command, where they are still the
    processes it named (a pid reused since is someone else's)?"""
    heads = [job.pid] if proc.is_alive(job.pid, job.start_time) else []
    if job.child_pid is not None and proc.is_alive(job.child_pid, job.child_start_time):
        heads.append(job.child_pid)
    return bool(heads) and pid in proc.process_tree(heads)


def jobs_processes(data: LedgerData, tree: Collection[int]) -> set[int]:
    """The processes among `tree` that gpuwait jobs in `data` run (their gpuwait, their
    command and what it started): a process adopted with them below it (a shell that runs a
    job, a notebook's kernel that started one) is not to reserve their memory a second time."""
    found: set[int] = set()
    for other in data.jobs:
        if elsewhere(other):
            continue
        other = other if data.mine(other) else their_own_processes(other, set(tree))
        heads = [p for p in (other.pid, other.child_pid) if p is not None and p in tree]
        found |= set(proc.process_tree(heads)) if heads else set()
        found |= set(other.pids) & set(tree)
    return found


def adopt(
    ledger: Ledger,
    job: Job,
    gpus: Sequence[GpuSnapshot] = (),
    limits: UserLimits | None = None,
) -> Job:
    """Put `job`, a running process started without gpuwait, in the ledger as a running job.

    Its entry names the process itself as its gpuwait and its command, so the reaping of every
    transaction takes it out (and records its run in the history) once it has ended. Raises
    UsageError when the process already belongs to a job, ImpossibleRequest where reserving
    more than it uses would take its user over their VRAM limit (`limits`, on `gpus`: it
    cannot wait to be under it, as a job does), StateError at the cap.
    """
    with _change(ledger) as (data, said):
        refuse_a_jobs_process(data, job.pid)
        over = adoption_over_limit(data, job, gpus, limits)
        if over is not None:
            raise ImpossibleRequest(
                f"process {job.pid} with {format_size(job.reserved_in_all())} reserved would "
                f"go over {over}",
                hint="reserve less (--vram), or adopt it without --vram: what it uses counts "
                "whatever the limit; the limit is the site's",
            )
        mine = sum(1 for j in data.jobs if j.uid == job.uid)
        if mine >= MAX_ENTRIES_PER_UID:
            raise StateError(
                f"uid {job.uid} already has {mine} gpuwait jobs in the ledger, the most one "
                "user may",
                hint="wait for some to finish",
            )
        entry = copy_job(job)._replace(
            order=data.next_order, boot=proc.boot_id(), kuid=userns.outer(job.uid)
        )
        data.next_order += 1
        data.jobs.append(entry)
        data.book.note_admitted(entry.gpu_uuids)
        said.append(
            (
                "adopt",
                {
                    "job": entry.id,
                    "name": entry.name,
                    "pid": entry.pid,
                    "gpus": list(entry.gpu_uuids),
                    "reserved_bytes": entry.reserved_bytes,
                },
            )
        )
    return copy_job(entry)


# --- admission ------------------------------------------------------------------------------


class Admitted(Record, frozen=True):
    """A job that may start: its entry as admitted, and its GPUs in the entry's order."""

    job: Job
    #: The GPUs, as last read (or as the ledger last saw them where the reading lacks one).
    gpus: tuple[GpuSnapshot, ...]
    #: Found in the ledger, not planned by this process (another waiter's plan, or an edit).
    found: bool = False

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        return tuple(self.job.gpu_uuids)

    @property
    def reserved_bytes(self) -> int:
        return self.job.reserved_bytes


class Cancelled(Record, frozen=True):
    """`gpuwait cancel` took this job out of the queue: its owner, or root (`by_uid`)."""

    by_uid: int | None = None


class DependencyFailed(Record, frozen=True):
    """An `--after-ok` dependency did not succeed, so this job can never start."""

    message: str


Attempt = Admitted | WaitReason | Cancelled | DependencyFailed | None


def _gpus_of(
    uuids: Sequence[str], snapshot: MachineSnapshot, data: LedgerData
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


def found_admission(mine: Job, snapshot: MachineSnapshot, data: LedgerData) -> Admitted:
    """The running entry `mine`, admitted by a plan other than its own process's."""
    return Admitted(copy_job(mine), _gpus_of(mine.gpu_uuids, snapshot, data), found=True)


def _admit_all(
    data: LedgerData,
    decided: Plan,
    snapshot: MachineSnapshot,
    said: _Said,
    claims: Sequence[Claim],
) -> None:
    """Mark every job the plan admits as running, on its GPUs (`claims`: those it was
    planned with)."""
    now, boot_now = time.time(), proc.boot_clock()
    slept = proc.slept(boot_now)
    index = {g.uuid: g.index for g in snapshot.gpus}
    for entry in data.jobs:
        uuids = decided.admitted.get(entry.id)
        if uuids is None:
            continue
        if not data.mine(entry):
            # Another user's: their own gpuwait starts it, told by the wake-up summary.
            data.starting.add(entry.id)
            continue
        _drop_requests(data, entry.id)
        entry.state = RUNNING
        # What it stepped aside for is behind it: queued again (a retry), it waits for no one;
        # and it queues no more, so its own priority is the one it runs at (whom it yields to).
        entry.yield_to, entry.boost = None, 0
        entry.gpu_uuids = list(uuids)
        entry.reserved_bytes = decided.reserved[entry.id]
        entry.reserved_by_gpu = dict(decided.reserved_by_gpu.get(entry.id, {}))
        # Another running job's memory listed with no figure is that job's, not a stranger's.
        entry.unlisted_at_start = {
            g.uuid: unlisted_of_strangers(g, claims) for g in snapshot.gpus if g.uuid in uuids
        }
        entry.started_at = entry.updated_at = entry.unlisted_started_at = now
        entry.started_boot, entry.started_slept = boot_now, slept
        entry.held_gpus = []
        if entry.pick == "round-robin":
            data.rr_cursor = index[uuids[-1]]
        data.book.note_admitted(uuids)
        said.append(
            (
                "admit",
                {
                    "job": entry.id,
                    "name": entry.name,
                    "gpus": list(uuids),
                    "reserved_bytes": entry.reserved_bytes,
                    **reserved_by_gpu_field(entry),
                    "waited": round(
                        since(entry.submitted_at, entry.submitted_boot, now, boot_now), 3
                    ),
                    "backfill": list(decided.backfill.get(entry.id, ())),
                },
            )
        )


def reserved_by_gpu_field(job: Job) -> dict[str, list[int]]:
    """An event's `reserved_by_gpu_bytes` (what `job` reserves on each of its GPUs, in their
    order) where that differs between them; nothing where `reserved_bytes` says it all."""
    each = [job.reserved_on(u) for u in job.gpu_uuids]
    return {"reserved_by_gpu_bytes": each} if len(set(each)) > 1 else {}


def cancellation(data: LedgerData, job_id: str) -> Cancelled | None:
    """How `gpuwait cancel` took job `job_id` out of the queue, if it did (the entry gone, its
    outcome in the book). A read without the lock tells as well as one with it: nothing puts
    a cancelled entry back."""
    if data.find(job_id) is not None:
        return None
    done = data.book.outcome(job_id)
    return Cancelled(done.by_uid) if done is not None and done.outcome == CANCELLED else None


def admit(
    ledger: Ledger,
    job: Job,
    snapshot: MachineSnapshot,
    safety: float,
    conditions: Conditions = NO_CONDITIONS,
    fair: FairShare = NO_FAIR_SHARE,
) -> tuple[Job, Attempt]:
    """Plan for the whole queue and admit every waiter that fits; say what became of `job`.

    Also records the GPUs' health, settles `job`'s dependencies (it leaves the queue if an
    `--after-ok` one failed) and keeps the head's hold. Returns `job` as the ledger now has it.
    """
    with _change(ledger) as (data, said):
        now, boot_now = time.time(), proc.boot_clock()
        mine = data.find(job.id)
        if mine is None:
            cancelled = cancellation(data, job.id)
            if cancelled is not None:
                return job, cancelled
            mine = _entry(data, job)
        if mine.state == RUNNING:
            return copy_job(mine), found_admission(mine, snapshot, data)
        _note_health(data, snapshot, now, said)
        held = held_for_entries(ledger.directory, data, mine, now, boot_now, ledger.listed_names())
        if held is None:
            # A dependency the book tells failed is told at once, whatever file is unusable.
            failure = failed_dependency(mine, data)
            held = None if failure is not None else held_for_unread(data, mine)
        if held is not None:
            return copy_job(mine), held
        failure = settle_dependencies(mine, data)
        if failure is not None:
            data.remove(job.id)
            data.book.note_finished(
                Finished(job.id, DEPENDENCY_FAILED, now, name=job.name, batch=job.batch)
            )
            said.append(("leave", {"job": job.id, "outcome": DEPENDENCY_FAILED}))
            return copy_job(mine), DependencyFailed(failure)
        # Where other users plan from the same queue: the site's order, and budgets that
        # follow the site's at the least.
        if ledger.shared:
            fair = fair.in_shared_ledger()
        claims, budgets = planned_claims(
            data, snapshot.gpus, fair, now, safety, conditions, boot_now
        )
        for entry in data.jobs:
            if entry.id in budgets and data.mine(entry):
                entry.wait_budget = budgets[entry.id]
        decided = plan_ledger(data, snapshot.gpus, claims, safety, conditions, fair)
        record_hold(data, decided.hold)
        _admit_all(data, decided, snapshot, said, claims)
        waiting = {j.id for j in data.jobs if j.state == WAITING}
        data.plan_order = [job_id for job_id in decided.order if job_id in waiting]
        updated = copy_job(mine)
        if job.id in decided.admitted:
            return updated, Admitted(updated, _gpus_of(mine.gpu_uuids, snapshot, data))
        return updated, decided.waiting.get(job.id)


def held_for_entries(
    directory: Path,
    data: LedgerData,
    mine: Job,
    now: float,
    boot_now: float | None,
    listed: list[str] | None = None,
) -> WaitReason | None:
    """Why the waiter `mine` waits, where jobs of its user are still to put back entries the
    damage of the ledger in `directory` lost (nobody is admitted meanwhile); None where none
    is. Told by a read without the lock as well as under it: a plan in the grace needs
    neither the lock nor the whole queue's plan to learn it. `listed`: the names in a shared
    `directory`, where the caller listed it already (else those the read of `data` listed)."""
    if listed is None:
        listed = data.listed
    try:
        lost = _entries_to_come_back(directory, data, now, boot_now, listed)
    except OSError as exc:
        # Not to be told now (no file descriptor left): held as if one did, until the grace
        # is over, as for an entry that never comes back; nobody admitted into its room.
        recovered = _recovered(data, now, boot_now)
        how = "started afresh" if recovered is None or recovered[1] else "repaired"
        return _held_whatever_room(
            mine,
            data,
            f"the ledger was {how} after damage, and which jobs of yours still have to put "
            f"their entries back cannot be told ({exc.strerror or exc})",
            until=_grace_ends(data, now, boot_now),
        )
    return _waiting_for_entries(mine, data, lost, now, boot_now) if lost else None


def held_for_unread(data: LedgerData, mine: Job) -> WaitReason | None:
    """Why the waiter `mine` waits where another member's file of a shared ledger could not be
    read while a gpuwait of theirs runs (`LedgerData.unread`): their jobs' reservations are
    not known, and nobody is admitted into them until their gpuwait writes the file again, or
    it has been left so for UNREAD_GRACE (then the reason lapses, on the boot clock, to the
    hundredth of a second: the first file's so to lapse, the waiter then planning again); or
    where it was started afresh after damage lately (`LedgerData.recovered`), until their
    jobs' entries are back (at most RECOVERY_GRACE). None where no such file is."""
    held = unread_hold(data)
    return None if held is None else _held_whatever_room(mine, data, held[0], until=held[1])


def unread_hold(data: LedgerData) -> tuple[str, float | None] | None:
    """Why nobody is admitted now for another member's file (`held_for_unread`), and until
    when on the boot clock (None: not known); None where no such file is."""
    if data.unread:
        uid, why = min(data.unread.items())
        until = None
        boot_now = proc.boot_clock()
        if data.unread_until and boot_now is not None:
            until = round(boot_now + min(data.unread_until.values()) - time.time(), 2)
        return (
            f"the ledger file of uid {uid}, whose gpuwait or job runs, cannot be used ({why}); the "
            "room their jobs hold is not known until it is written again",
            until,
        )
    if data.recovered:
        # Started afresh by their gpuwait: their live jobs' entries come back as each one's
        # gpuwait puts it back, as this user's own after damage (RECOVERY_GRACE).
        uid, ends = min(data.recovered.items())
        return (
            f"the ledger file of uid {uid}, whose gpuwait or job runs, was started afresh after "
            "damage; the room their jobs hold is not known until they have put their entries "
            f"back (at most {RECOVERY_GRACE:.0f} s)",
            ends,
        )
    return None


def _held_whatever_room(
    mine: Job,
    data: LedgerData,
    why: str,
    until: float | None = None,
    awaited: tuple[str, ...] = (),
) -> WaitReason:
    """Why the waiter `mine` waits, held whatever room there is (`why`): no best GPU, none
    ahead; `until` and `awaited` as WaitReason has them."""
    needed = describe_need(mine.memory_request(), mine.gpus)
    return WaitReason(
        needed=needed,
        best_gpu_index=None,
        best_room=0,
        running=sum(j.state == RUNNING for j in data.jobs),
        ahead=0,
        blocked=f"waiting for {needed}: {why}",
        until=until,
        awaited=awaited,
    )


def _entries_to_come_back(
    directory: Path,
    data: LedgerData,
    now: float,
    boot_now: float | None,
    listed: list[str] | None = None,
) -> list[str]:
    """The jobs (their ids) of this user that live without an entry in a ledger started
    afresh, or whose entries were dropped as damaged, less than RECOVERY_GRACE ago (on the boot
    clock where the ledger has a stamp of it: see `since`): their reservations are unknown
    until their gpuwait puts them back, so nobody may be admitted into them meanwhile."""
    recovered = _recovered(data, now, boot_now)
    if recovered is None:
        return []
    mine = {j.id for j in data.jobs if data.mine(j)}
    # A job that has left the queue (its outcome in the book) holds its lock a moment longer,
    # until its gpuwait removes the file: the waiter its release woke plans in that moment, and
    # nobody would wake it again once the lock is gone. No entry of it is to come back.
    ended = {f.id for f in data.book.finished}
    # Locks taken before the ledger began (or was repaired). A file's time lags the clock by up
    # to a tick, never leads it, so every such lock is older than that moment; one taken just
    # after may look older too, and costs a waiter only the moment until its job's entry is
    # written. Counted from a tenth of a second earlier instead, a job started just before the
    # damage was not waited for, and the next launch was admitted into its reservation.
    return alive.unlisted(directory, mine | ended, recovered[0], listed)


def _recovered(data: LedgerData, now: float, boot_now: float | None) -> tuple[float, bool] | None:
    """(when, whether it was started afresh rather than repaired) of the ledger's latest
    recovery from damage less than RECOVERY_GRACE ago; None where there was none."""
    moments = [(data.created_at, data.created_boot, True)]
    if data.repaired_at is not None:
        moments.append((data.repaired_at, data.repaired_boot, False))
    recent = [
        (wall, afresh)
        for wall, boot, afresh in moments
        if 0 <= since(wall, boot, now, boot_now) < RECOVERY_GRACE
    ]
    return max(recent) if recent else None


def _waiting_for_entries(
    mine: Job, data: LedgerData, lost: list[str], now: float, boot_now: float | None
) -> WaitReason:
    jobs = (
        "1 job of yours still running or waiting has to put its entry"
        if len(lost) == 1
        else (f"{len(lost)} jobs of yours still running or waiting have to put their entries")
    )
    recovered = _recovered(data, now, boot_now)
    how = "started afresh" if recovered is None or recovered[1] else "repaired"
    return _held_whatever_room(
        mine,
        data,
        f"the ledger was {how} after damage; {jobs} back",
        until=_grace_ends(data, now, boot_now),
        awaited=tuple(lost),
    )


def _grace_ends(data: LedgerData, now: float, boot_now: float | None) -> float | None:
    """When (on the boot clock) the grace of the ledger's latest recovery is over, to the
    hundredth of a second: the same at every plan meanwhile. None: no recovery is that recent
    (or the boot clock is not known)."""
    if boot_now is None:
        return None
    left = [
        RECOVERY_GRACE - elapsed
        for wall, boot in (
            (data.created_at, data.created_boot),
            (data.repaired_at, data.repaired_boot),
        )
        if wall is not None and 0 <= (elapsed := since(wall, boot, now, boot_now)) < RECOVERY_GRACE
    ]
    return round(boot_now + max(left), 2) if left else None


def confirm_admission(
    ledger: Ledger,
    job_id: str,
    asked: Job,
    snapshot: MachineSnapshot,
    holds: Callable[[LedgerData, Job], bool],
) -> Admitted | None:
    """Under the lock: keep an admission found in a shared ledger if `holds(data, entry)`, else
    undo it (the job, as it `asked`, waits on) and say so in the ledger's warnings."""
    with _change(ledger) as (data, _):
        mine = data.find(job_id)
        if mine is None or mine.state != RUNNING:
            return None
        if holds(data, mine):
            return found_admission(mine, snapshot, data)
        ledger.warnings.append(
            f"ledger {ledger.path}: ignored an admission of job {job_id} that no plan made "
            "(its GPUs have no room for it, or the entry is not this process's); waiting on"
        )
        if mine.uid == asked.uid and mine.pid == asked.pid:
            _queued_again(mine, time.time())
            # It waits on in the place it had: the admission took away what it stepped aside
            # for (`_admit_all`), and it has not run.
            mine.boost = max(mine.boost, asked.boost)
            yielded = (
                data.referred([asked.yield_to]).get(asked.yield_to) if asked.yield_to else None
            )
            if yielded is not None and yielded.state == WAITING:
                mine.yield_to = data.reference(yielded)
    return None


# --- running --------------------------------------------------------------------------------


def started(ledger: Ledger, job: Job, child_pid: int, held_by: Sequence[str] = ()) -> Job:
    """The admitted job's command runs as `child_pid`, its budget held as `held_by` says
    (gpuwait.core.budget)."""
    child_start = proc.start_time(child_pid)
    with _change(ledger) as (data, said):
        mine = _entry(data, job)
        mine.child_pid = child_pid
        mine.child_start_time = child_start
        mine.pids = [child_pid]
        mine.held_by = list(held_by)
        said.append(("start", {"job": job.id, "name": job.name, "pid": child_pid}))
    return copy_job(mine)


def publish_usage(
    ledger: Ledger,
    job: Job,
    usage: dict[str, int],
    pids: list[int],
    margin: float = DEFAULT_MARGIN,
) -> Job:
    """What the running job's process tree uses now, and which processes it has.

    Use past the reservation by more than `margin` is remembered in the entry (for `status`
    and the history) and said once in the event log, with its likely cause.
    """
    with _change(ledger) as (data, said):
        mine = _entry(data, job)
        if mine.child_pid is None and job.child_pid is not None:
            # Its start could not be recorded (`started` failed): recorded now, so that an
            # entry whose gpuwait is gone is kept for its command, not reaped under it.
            mine.child_pid, mine.child_start_time = job.child_pid, job.child_start_time
            mine.held_by = list(job.held_by)
            said.append(("start", {"job": job.id, "name": job.name, "pid": job.child_pid}))
        mine.observed = dict(usage)
        mine.pids = list(pids)
        mine.updated_at = time.time()
        for uuid, used in usage.items():
            health = data.book.health.get(uuid)
            reserved = mine.reserved_on(uuid)
            if 0 < reserved < used and used > mine.grown.get(uuid, 0):
                mine.grown[uuid] = used
            found = overuse(reserved, used, health.total_bytes if health else 0, margin)
            if found is None or used <= mine.overuse_bytes:
                continue
            if mine.overuse_since is None:
                mine.overuse_since = mine.updated_at
                said.append(
                    (
                        "over-reservation",
                        {
                            "job": mine.id,
                            "name": mine.name,
                            "gpu": uuid,
                            "reserved_bytes": reserved,
                            "used_bytes": used,
                            "cause": found.cause(),
                            "advice": found.advice(),
                        },
                    )
                )
            mine.overuse_bytes, mine.overuse_total_bytes = used, found.total_bytes
            mine.overuse_gpu = uuid
    return copy_job(mine)


def note_health(ledger: Ledger, snapshot: MachineSnapshot) -> None:
    """A GPU stopped or started answering: record it (and say so) now, waiters or not."""
    with _change(ledger) as (data, said):
        _note_health(data, snapshot, time.time(), said)


# --- cooperative pausing --------------------------------------------------------------------


def request_pause(
    ledger: Ledger,
    waiter_id: str,
    choose: Callable[[LedgerData, Job], PauseChoice | None],
    now: float,
    boot_now: float | None = None,
    grace_max: float = DEFAULT_GRACE_MAX,
) -> tuple[str, ...]:
    """Mark the running jobs that `choose` picks for the waiting job `waiter_id` as asked to step
    aside; return their ids. Nothing is asked while one of this waiter's requests is pending: a
    job it asked that ignores the request past its grace (or past the waiter's `grace_max`) is
    left alone, and others may be asked."""
    with _change(ledger) as (data, said):
        mine = data.find(waiter_id)
        if mine is None or mine.state != WAITING:
            return ()
        if any(
            # A --freezable job marked as acted on could not be frozen: it runs on.
            not (j.freezable and j.pause_signalled_at is not None)
            and _pending(j, now, boot_now, grace_max)
            for j in data.jobs
            if j.state == RUNNING and j.pause_requested_by == waiter_id
        ):
            return ()
        choice = choose(data, mine)
        if choice is None:
            return ()
        for victim_id in choice.victims:
            victim = data.find(victim_id)
            if victim is not None:
                # Written in the asker's own file; the victim's gpuwait takes it as a mark
                # only while its asker waits with a higher priority (entries.mark_pause_requests).
                data.requests.append(
                    entries.Request.to(
                        victim,
                        entries.PAUSE,
                        now,
                        mine.uid if data.me is None else data.me,
                        waiter_id,
                        boot_now,
                    )
                )
        entries.mark_pause_requests(data, now, boot_now)
        said.append(
            (
                "pause-request",
                {"job": waiter_id, "victims": list(choice.victims), "gpu": choice.gpu_uuid},
            )
        )
        return choice.victims


def _pending(job: Job, now: float, boot_now: float | None, grace_max: float) -> bool:
    """Whether `job` may still obey the request to step aside (core.pausing.still_pending),
    timed on the boot clock where its stamps allow, so that no step of the wall clock ends its
    grace early or late."""
    requested, signalled, at = pause_stamps(job, now, boot_now)
    return still_pending(requested, signalled, job.grace_seconds, job.grace_kill, at, grace_max)


def pause_signalled(
    ledger: Ledger,
    job_id: str,
    now: float,
    pids: Sequence[int],
    boot_now: float | None = None,
) -> None:
    """The job asked to step aside was sent its checkpoint signal at `now` (and `boot_now`, on
    the boot clock)."""
    with _change(ledger) as (data, said):
        mine = data.find(job_id)
        if mine is not None:
            mine.pause_signalled_at, mine.pause_signalled_boot = now, boot_now
        said.append(("pause-signal", {"job": job_id, "pids": list(pids)}))


def grace_killed(ledger: Ledger, job_id: str) -> None:
    """The job did not step aside within its grace and was sent TERM (`--grace-kill`): nothing
    in the ledger changes, its end does that."""
    events.emit(ledger.directory, "pause-grace-kill", job=job_id)


def step_aside(
    ledger: Ledger,
    job: Job,
    run_seconds: float,
    charge_usage: tuple[float, float | None] | None = None,
) -> Job:
    """The job checkpointed on request: it queues again, in its original place, at least as high
    as whom it made room for, and behind that job until it has started. `charge_usage`, as for
    `finish`: the run's VRAM-seconds, which its user used whatever the job does next."""
    with _change(ledger) as (data, said):
        mine = _entry(data, job)
        if charge_usage is not None:
            charge(data, job.uid, charge_usage[0], time.time(), charge_usage[1])
        requester = data.find(mine.pause_requested_by) if mine.pause_requested_by else None
        mine.boost = max(mine.boost, requester.priority if requester else 0)
        mine.yield_to = data.reference(requester) if requester else None
        _started_since(data, mine)
        _queued_again(mine, time.time())
        # Its checkpoint keeps the run's work, but not its load: resuming loads again.
        mine.done_seconds += max(0.0, run_seconds - (mine.load_seconds or 0.0))
        mine.pauses += 1
        said.append(
            (
                "paused",
                {"job": job.id, "pauses": mine.pauses, "ran_seconds": round(run_seconds, 3)},
            )
        )
    return copy_job(mine)


def _started_since(data: LedgerData, mine: Job) -> None:
    """`mine`, running, queues again: the jobs that stepped aside for it have seen it start, and
    wait for it no longer. Kept, the wait would begin anew, for ever where `mine` steps aside for
    one of them (an idle job asked by its own user's waiter, `idle_action = pause`): each would
    wait for the other to start. Another user's entries are that user's gpuwait's to write."""
    for other in data.jobs:
        if other.yield_to == mine.id and data.mine(other):
            other.yield_to = None


def _yielding_to_a_started_job(data: LedgerData) -> list[Job]:
    """This user's waiters that stepped aside for another user's job which has started since:
    they wait for it no longer (`_started_since`, which that user's gpuwait cannot do for
    them). Kept, they would wait for it again once it queued again (stepped aside in turn, or
    retried after running out of memory), their room idle meanwhile."""
    yielding = [j for j in data.jobs if j.state == WAITING and j.yield_to and data.mine(j)]
    if not yielding:
        return []
    index = data.by_plain_id()
    return [
        j
        for j in yielding
        if (asker := data.as_kept_in(j, index).get(j.yield_to or "")) is not None
        and asker.state == RUNNING
    ]


def _queued_again(mine: Job, now: float) -> None:
    """A running job whose command has ended queues again (it stepped aside, or it is retried):
    nothing of the run it had is left on it, nor the request that made it step aside."""
    mine.state = WAITING
    mine.gpu_uuids, mine.reserved_bytes, mine.observed = [], 0, {}
    mine.reserved_by_gpu, mine.unlisted_at_start, mine.unlisted_started_at = {}, {}, None
    mine.pids, mine.child_pid, mine.child_start_time, mine.started_at = [], None, None, None
    mine.started_boot = mine.started_slept = None
    mine.held_gpus = []
    mine.pause_requested_at = mine.pause_requested_by = mine.pause_signalled_at = None
    mine.pause_requested_boot = mine.pause_signalled_boot = None
    # What kept the run inside its reservation, and what it used past it, were that run's.
    mine.held_by = []
    mine.overuse_since, mine.overuse_bytes, mine.overuse_total_bytes = None, 0, 0
    mine.overuse_gpu = None
    mine.grown = {}
    mine.updated_at = now


# --- freezing -------------------------------------------------------------------------------


def freeze(ledger: Ledger, job: Job, pids: Sequence[int], now: float) -> Job:
    """The job asked to step aside was frozen: its device memory is in host memory and its
    processes are stopped. It waits, as a job that stepped aside does (in its original place, at
    least as high as whom it made room for, behind that job until it has started), but pinned to
    the GPUs it had, where alone its memory can come back; its command stays."""
    with _change(ledger) as (data, said):
        mine = _entry(data, job)
        requester = data.find(mine.pause_requested_by) if mine.pause_requested_by else None
        gpus = list(mine.gpu_uuids)
        mine.boost = max(mine.boost, requester.priority if requester else 0)
        mine.yield_to = data.reference(requester) if requester else None
        _started_since(data, mine)
        mine.state = WAITING
        # Its memory comes back as it was: the run's work is all kept.
        mine.done_seconds += run_time(mine, now, proc.boot_clock())
        mine.frozen_at, mine.frozen_gpus = now, gpus
        mine.gpu_uuids, mine.reserved_bytes, mine.observed = [], 0, {}
        mine.reserved_by_gpu = {}
        mine.held_gpus, mine.started_at, mine.started_boot = [], None, None
        mine.started_slept = None
        mine.freezes += 1
        mine.pause_requested_at = mine.pause_requested_by = mine.pause_signalled_at = None
        mine.pause_requested_boot = mine.pause_signalled_boot = None
        mine.updated_at = now
        said.append(("freeze", {"job": job.id, "pids": list(pids), "gpus": gpus}))
    return copy_job(mine)


def freeze_failed(
    ledger: Ledger, job_id: str, error: str, now: float, boot_now: float | None = None
) -> None:
    """Freezing the job failed and it runs on; its asker is told (the request was acted on) and
    waits for it to end, as for a --pausable job left alone."""
    with _change(ledger) as (data, said):
        mine = data.find(job_id)
        if mine is not None:
            mine.pause_signalled_at, mine.pause_signalled_boot = now, boot_now
        said.append(("freeze-failed", {"job": job_id, "error": error}))


def thaw(ledger: Ledger, job: Job, now: float) -> Job:
    """The frozen job, admitted again on its GPUs, has its memory back and runs on."""
    with _change(ledger) as (data, said):
        mine = _entry(data, job)
        frozen_since = mine.frozen_at
        mine.frozen_at, mine.frozen_gpus = None, []
        mine.updated_at = now
        frozen_seconds = round(now - frozen_since, 3) if frozen_since is not None else None
        said.append(("thaw", {"job": job.id, "frozen_seconds": frozen_seconds}))
    return copy_job(mine)


def thaw_failed(ledger: Ledger, job_id: str, error: str) -> None:
    """Thawing the admitted job failed; it is tried again. Nothing in the ledger changes: the job
    keeps its reservation, where its memory is to come back."""
    events.emit(ledger.directory, "thaw-failed", job=job_id, error=error)


# --- leaving --------------------------------------------------------------------------------


def finish(
    ledger: Ledger,
    job: Job,
    outcome: str,
    *,
    exit_status: int | None = None,
    signal: int | None = None,
    run_seconds: float | None = None,
    charge_usage: tuple[float, float | None] | None = None,
    paused: tuple[int, float] | None = None,
    oom: str | None = None,
) -> None:
    """Take the job out of the queue, recording how it ended (and where it ran, if it did).

    `charge_usage`: (VRAM-seconds, fair-share half-life) added to the user's usage after a run.
    `paused`: a --pausable job's pauses and the seconds it spent stepped aside.
    `oom`: how a run that ran out of GPU memory did (gpuwait.core.budget: own limit, card full).
    """
    # Out of the ledger (or left for a reaper, should the write fail): its lock stands for
    # nothing any more.
    read: _Words = []
    with alive.given_up(ledger.directory, job.id), _change(ledger, read) as (data, said):
        mine = data.remove(job.id)
        _drop_requests(data, job.id)
        listed = {j.id for j in data.jobs if data.mine(j)}
        alive.sweep(ledger.directory, listed)
        # Its own word, if any, goes once its removal is written (below); so do those of the
        # entries reaped here, or are set aside as evidence: none is lost should this
        # transaction not be written.
        _sweep_words(ledger, job.history_dir, listed | {job.id}, {path for path, _ in read})
        # Taken out already, its outcome noted (a Ctrl-C came just after its release took it
        # out, and the room was given back again): that outcome stands, its run charged once.
        if mine is not None or data.book.outcome(job.id) is None:
            # The ledger's word: another waiter's plan may have admitted it meanwhile.
            ran_on = mine.gpu_uuids if mine is not None and mine.state == RUNNING else []
            now = time.time()
            done, fields = _run_ended(
                job,
                outcome,
                ran_on,
                now,
                exit_status,
                signal,
                run_seconds,
                paused,
                oom,
                None if mine is None else _cancelled_by(data, mine),
            )
            data.book.note_finished(done, ran_on)
            if charge_usage is not None:
                charge(data, job.uid, charge_usage[0], now, charge_usage[1])
            said.append(("finish" if ran_on else "leave", fields))
    # A word this process left of how it ended (leave_word, before a thread of a program that
    # lives on took the entry out once the lock was free) tells nobody anything any more.
    path = _word_path(job)
    if path is not None:
        _take_words([(path, True)])


def _run_ended(
    job: Job,
    outcome: str,
    ran_on: list[str],
    now: float,
    exit_status: int | None,
    signal: int | None,
    run_seconds: float | None,
    paused: tuple[int, float] | None,
    oom: str | None,
    cancelled_by: int | None = None,
) -> tuple[Finished, dict[str, Any]]:
    """How a run of `job` ended: for the book, and the fields of its `finish` event.
    `cancelled_by`: who cancelled it while it ran (its entry's `cancelled_by`): a run that
    then did not succeed (ended by the TERM sent, or lost) was cancelled."""
    if cancelled_by is not None and outcome in (FAILED, LOST):
        outcome, oom = CANCELLED, None
    done = Finished(
        id=job.id,
        outcome=outcome,
        finished_at=now,
        name=job.name,
        batch=job.batch,
        exit_status=exit_status,
        signal=signal,
        by_uid=cancelled_by if outcome == CANCELLED else None,
        oom=oom if outcome == FAILED else None,
    )
    fields: dict[str, Any] = {
        "job": job.id,
        "name": job.name,
        "outcome": outcome,
        "exit_status": exit_status,
        "signal": signal,
        "gpus": ran_on,
        "run_seconds": None if run_seconds is None else round(run_seconds, 3),
    }
    if paused is not None:
        fields["pauses"], fields["paused_seconds"] = paused[0], round(paused[1], 3)
    if oom is not None:
        fields["oom"] = oom
        fields["reserved_bytes"] = job.reserved_bytes
        fields.update(reserved_by_gpu_field(job))
    return done, fields


def retry(
    ledger: Ledger,
    job: Job,
    request: dict[str, Any],
    *,
    exit_status: int | None = None,
    signal: int | None = None,
    run_seconds: float | None = None,
    charge_usage: tuple[float, float | None] | None = None,
    paused: tuple[int, float] | None = None,
    oom: str | None = None,
    size_source: str | None = None,
) -> Job | None:
    """The job's run ran out of GPU memory and it queues again (--retry-oom), asking for
    `request` (which `size_source` says where it came from, as the job's wait line does): the
    same entry, in its place, so whoever waits for it (--after, --after-ok, its
    batch) waits for the retry's end. The run is logged and counted as a `finish` with its
    out-of-memory cause; the job's outcome is recorded only once it has ended for good.
    Arguments as for `finish`. None, and nothing changed, where the job was cancelled while
    it ran (`cancel`, as its run ran out): it is never run again, and is finished instead."""
    with _change(ledger) as (data, said):
        mine = _entry(data, job)
        if _cancelled_by(data, mine) is not None:
            return None
        ran_on = list(mine.gpu_uuids) if mine.state == RUNNING else []
        now = time.time()
        attempt, fields = _run_ended(
            job, FAILED, ran_on, now, exit_status, signal, run_seconds, paused, oom
        )
        data.book.note_run(attempt, ran_on)
        if charge_usage is not None:
            charge(data, job.uid, charge_usage[0], now, charge_usage[1])
        _started_since(data, mine)
        _queued_again(mine, now)
        if not mine.pausable:
            # Its command starts anew: only a --pausable job's goes on from a checkpoint (what
            # a frozen job had done was in the memory of the run that ran out).
            mine.done_seconds = 0.0
        mine.request = dict(request)
        mine.size_source = size_source
        said.append(("finish", {**fields, "retry": True}))
    return copy_job(mine)


def _holds_room_itself(job: Job, ledger_dir: Path, shared: bool) -> bool:
    """Is the process `job` names, which runs no gpuwait, a program holding room for itself
    from Python (gpuwait.api)? It holds the job's liveness lock; in a shared ledger, where a
    lock may not have been taken (alive.hold), it may instead run with the command line its
    entry keeps (as the other members' plans prove it) and, admitted, be recorded as its own
    command."""
    if alive.opened_by(ledger_dir, job.uid, job.id, job.pid, job.kuid):
        return True
    return (
        shared
        and security.runs_as_kept(job.pid, job.command)
        and (
            job.state != RUNNING
            or (job.child_pid, job.child_start_time) == (job.pid, job.start_time)
        )
    )


def _control_refusal(job: Job, uid: int, ledger_dir: Path, shared: bool) -> str | None:
    """Why `uid` may not cancel `job` (in a `shared` ledger, or a private one); None when
    they may."""
    if elsewhere(job):
        if uid != 0 and not userns.same_user(uid, job.uid, job.kuid):
            return f"job {job.id} belongs to uid {job.uid}; you can only control your own jobs"
        if job.state == RUNNING:
            # Its pids are another pid namespace's: signalled from here, they would reach
            # somebody else's process, or none.
            return (
                f"job {job.id} runs in another pid namespace (a container without --pid=host); "
                "cancel it from there"
            )
        return None  # a waiter: taken out of the queue, it sees so and exits 7
    if job.orphaned_at is None:
        refusal = control_refusal(job, uid, lambda: _holds_room_itself(job, ledger_dir, shared))
        # An adopted process of the caller's: gpuwait did not start it and never signals it,
        # whatever its command line says (a program named gpuwait_demo.py runs no gpuwait).
        adopted = job.adopted_history is not None
        if adopted and control_refusal(job, uid, lambda: True) is None:
            return (
                f"it is process {job.pid}, adopted with `gpuwait adopt`, and gpuwait "
                f"signals only processes it started: stop it as it was started (kill {job.pid})"
            )
        return refusal
    return orphan_control_refusal(
        job, job.child_pid, job.child_start_time, uid, _holds_lock(job, ledger_dir)
    )


class Cancellation(Record):
    """What `cancel` did with each job it was asked about."""

    #: Waiting jobs taken out of the queue (their gpuwait exits 7).
    cancelled: list[Job]
    #: Running jobs sent TERM (their gpuwait passes it on and ends as the command does).
    stopped: list[Job]
    #: Jobs the caller may not control, with the reason.
    refused: list[tuple[Job, str]]
    #: References that named no waiting or running job.
    unmatched: list[str]
    #: Names (or `--batch NAME`) that named none of the caller's jobs but jobs of several other
    #: users, with those jobs: nothing of theirs is cancelled, as which was meant is not known.
    ambiguous: list[tuple[str, list[Job]]] = field(default_factory=list)
    #: References among `unmatched` that name a job of the caller's that has ended (the last
    #: of that id or name its book keeps), with how it ended.
    ended: list[tuple[str, Finished]] = field(default_factory=list)


def _referred(data: LedgerData, job_id: str | None, matches: list[Job]) -> list[Job] | None:
    """Which of `matches` (the jobs whose id is `job_id`, or that have a name or batch) a
    cancel means: a job's id names that job; a name, the caller's own jobs of that name where
    they have any (another user may give theirs the same one), else another user's; None where
    that would be jobs of several users (root's cancel could not tell which student's was
    meant)."""
    if any(j.id == job_id for j in matches):
        return [j for j in matches if j.id == job_id]
    own = [j for j in matches if data.mine(j)]
    if own or len({machine_user(j) for j in matches}) < 2:
        return own or matches
    return None


def cancel(ledger: Ledger, refs: Sequence[str], batch: str | None, uid: int) -> Cancellation:
    """Cancel the jobs named by `refs` (ids or names) and `batch`, as the user `uid`.

    Only a job's owner (or root) may, and only when the entry names that owner's own gpuwait
    process: a forged entry must never make this signal someone else's process.
    """
    result = Cancellation([], [], [], [])
    with _change(ledger) as (data, said):
        chosen: list[Job] = []
        # Each reference as the user wrote it, the id it may be, and the jobs it names.
        asked: list[tuple[str, str | None, list[Job]]] = [
            (ref, ref, [j for j in data.jobs if ref in (j.id, j.name)]) for ref in refs
        ]
        if batch is not None:
            asked.append((f"--batch {batch}", None, [j for j in data.jobs if j.batch == batch]))
        for ref, job_id, matches in asked:
            meant = _referred(data, job_id, matches)
            if not matches:
                result.unmatched.append(ref)
                over = [f for f in data.book.finished if ref in (f.id, f.name)]
                if over and job_id is not None:
                    result.ended.append((ref, over[-1]))
            elif meant is None:
                result.ambiguous.append((ref, matches))
            else:
                chosen.extend(j for j in meant if j not in chosen)
        for job in chosen:
            refusal = _control_refusal(job, uid, ledger.directory, data.me is not None)
            if refusal is not None:
                result.refused.append((job, refusal))
            elif job.state == RUNNING:
                # The TERM ends its command: it leaves cancelled, not failed (`finish`). Another
                # user's entry (root's cancel) is theirs to write: asked in this user's file.
                if data.mine(job):
                    job.cancelled_by = uid
                else:
                    data.requests.append(entries.Request.to(job, entries.CANCEL, time.time(), uid))
                result.stopped.append(job)
            elif not data.mine(job):
                # Another user's file, which only they write (root is the one who gets here):
                # ask, in this user's own file; their gpuwait takes the job out and exits 7.
                data.requests.append(entries.Request.to(job, entries.CANCEL, time.time(), uid))
                data.jobs.remove(job)
                result.cancelled.append(job)
            else:
                data.remove(job.id)
                data.book.note_finished(
                    Finished(
                        job.id, CANCELLED, time.time(), name=job.name, batch=job.batch, by_uid=uid
                    )
                )
                result.cancelled.append(job)
            said.append(
                (
                    "cancel",
                    {
                        "job": job.id,
                        "name": job.name,
                        "state": job.state,
                        "by_uid": uid,
                        "refused": refusal is not None,
                        "why": refusal,
                    },
                )
            )
    for job in result.stopped:
        # Its gpuwait forwards TERM to the command and ends the way the command does; an
        # orphan's command is told directly, and its entry goes when the command has ended.
        target = job.pid if job.orphaned_at is None or job.child_pid is None else job.child_pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, SIGTERM)
        # A job suspended with Ctrl-Z would take the TERM only once continued, and keep its GPU
        # memory until then (bash's `kill %1` continues a stopped job the same way).
        for pid in sorted(proc.process_tree([target])):
            if proc.stopped(pid, None):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, SIGCONT)
    return result
