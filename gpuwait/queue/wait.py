"""The one waiting loop: sleep until something concerns this job, then plan for the whole queue.

Waking up fast after a release matters (a job that ends should be followed by the next one within
milliseconds), while every waiter reading NVML and re-planning on every change would swamp a
machine with a hundred of them. So:
- every plan is made for the whole queue, and admits every waiter that fits (not only the one
  that plans); the others find themselves admitted in the ledger and start;
- waiters sleep until a change concerns them, a signal arrives, or it is time to read the GPUs
  again: in a private ledger the writer signals just those waiters; in a shared one `wake.json`
  is watched (inotify, see gpuwait.linux.inotify); with `wake = poll` it is stat-polled every `poll_interval`.
  On a change each reads only that small summary (see gpuwait.queue.wake). After a release, the first
  waiter in the queue plans;
- the GPUs are re-read every `nvml_interval` (with jitter) to notice processes outside gpuwait
  coming and going, by whichever waiter's timer fires first: the others skip their turn.
Every admission is decided under the ledger lock with a fresh snapshot, so two plans never both
hand out the same room (gpuwait.queue.lifecycle.admit). The same transaction records which GPUs
the queue's head holds and notes GPUs that stopped or started answering. While a plan would
change nothing, it is made from a lock-free read and the lock is not taken at all.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

from gpuwait.core.devices import MIG_MODE_HINT, in_mig_mode_words
from gpuwait.core.errors import (
    DEFAULT_GPU_ERROR_TIMEOUT,
    BackendUnavailable,
    GpuwaitError,
    ImpossibleRequest,
    StateShortage,
)
from gpuwait.core.pausing import PauseRules
from gpuwait.core.policy import (
    OVER_LIMIT,
    Conditions,
    FairShare,
    WaitReason,
    admission_fits,
    describe_need,
    impossible_reason,
)
from gpuwait.core.record import Record
from gpuwait.core.sizes import format_duration, format_setting_duration
from gpuwait.core.snapshot import MachineSnapshot
from gpuwait.linux import alive, proc, signals, turnstile
from gpuwait.queue import lifecycle, wake
from gpuwait.queue.conditions import (
    UtilizationWindow,
    as_counted,
    claim_of,
    failed_dependency,
    name_processes,
    plan_conditions,
    plan_ledger,
    planned_claims,
    unpublished_pids,
)
from gpuwait.queue.entries import RUNNING, WAITING, Job, LedgerData, elsewhere
from gpuwait.queue.fairness import NO_FAIR_SHARE
from gpuwait.queue.ledger import Ledger
from gpuwait.queue.lifecycle import Admitted, Attempt, Cancelled, DependencyFailed
from gpuwait.queue.stuck import Surroundings, stuck_behind

if TYPE_CHECKING:
    from gpuwait.gpu.backend import Backend
    from gpuwait.queue.idle import IdleWatch

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
#: How long after a reason lapses by itself (`WaitReason.until`) the waiter plans again.
LAPSE_MARGIN = 0.02
#: While held for entries lost with a damaged ledger (`WaitReason.awaited`), how often the
#: waiter looks at the summaries for them put back (an older gpuwait puts its entry back
#: without counting it as a release, and signals nobody), and at their jobs' locks for those
#: that ended without putting theirs back, which nobody counts as a release either.
RECOVERY_LOOK = 0.25
#: In a shared ledger, how long another member's job may wait on while this waiter's plan
#: starts it now, before the two plans are taken to disagree (`Disagreement`). A member whose
#: plan agrees is told at once (the plan that first starts the job says so in the summary,
#: under the lock) and starts its job once its gpuwait has read the GPUs and planned, whatever
#: its `nvml_interval`; on a loaded machine that took 5 s and more. Fifteen seconds make a slow
#: member's start no disagreement, and end a true one in seconds, not in the hours a wait
#: budget takes.
DISAGREE_AFTER = 15.0
#: Retries after a failed reading of the GPUs: the first after this many seconds, doubling up to
#: GPU_RETRY_MAX, so a driver hiccup costs a moment and a lasting failure little.
GPU_RETRY_FIRST = 0.5
GPU_RETRY_MAX = 10.0


class WaitPolicy(Record, frozen=True):
    """How a job waits: the settings the waiting loop reads, as plain values."""

    safety: float
    #: How often the wake summary is stat-polled where nobody signals this waiter.
    poll_interval: float
    #: How often the GPUs are read again when nothing in the ledger changed.
    nvml_interval: float
    ignore_processes: frozenset[str] = frozenset()
    #: Be woken by the writer (private ledger) or inotify (shared), rather than polling.
    use_inotify: bool = True
    fair: FairShare = NO_FAIR_SHARE
    #: None: this waiter never asks running jobs to step aside.
    pause_rules: PauseRules | None = None
    #: How long the GPU readings may keep failing before the waiter gives up (exit 4).
    gpu_error_timeout: float = DEFAULT_GPU_ERROR_TIMEOUT
    #: `idle_action = pause`: the user's own idle pausable jobs are asked to step aside for
    #: this waiter whatever their priority. None: idleness changes nothing.
    idle: IdleWatch | None = None
    #: The fairness policy as the config files say now, asked at every look for room: an
    #: administrator's change of the site's limits or order reaches the jobs that already
    #: wait. None: `fair` for the whole wait.
    current_fair: Callable[[], FairShare] | None = None


#: What to do about GPUs that do not answer past gpu_error_timeout.
NO_GPU_ANSWERS_HINT = (
    "check the GPUs (nvidia-smi; a lost GPU needs a reset or a reboot), then run the command again"
)


def no_gpu_answers(snapshot: MachineSnapshot) -> BackendUnavailable | None:
    """A reading in which not one GPU answered (the driver gone from under it, every card
    lost) as the failed reading it is, retried as one up to gpu_error_timeout; else None."""
    if snapshot.gpus or not snapshot.unanswered:
        return None
    first = snapshot.warnings[0].removesuffix("; skipped") if snapshot.warnings else ""
    return BackendUnavailable(f"no GPU answers: {first}", hint=NO_GPU_ANSWERS_HINT)


def own_gpus_silent(job: Job, snapshot: MachineSnapshot) -> BackendUnavailable | None:
    """A reading in which too few of the GPUs `job` may use answered (`--devices 1`, or
    CUDA_VISIBLE_DEVICES, naming a GPU that fell off the bus; `--gpus 2` on two GPUs, one of
    them lost; `--gpus 2 --gpu-name A100` with one of two A100s lost, another card answering)
    as a failed reading, retried up to gpu_error_timeout: it could otherwise wait for ever for
    a card that needs a reset."""
    if not snapshot.unanswered:
        return None
    requirements = job.requirements_for_policy()
    mine = [
        g
        for g in snapshot.gpus
        if (job.candidates is None or g.uuid in job.candidates) and requirements.mismatch(g) is None
    ]
    if len(mine) >= job.gpus:
        return None
    which = ", ".join(str(i) for i in snapshot.unanswered)
    return BackendUnavailable(
        f"GPU {which} did not answer, and without it the GPUs this job may use cannot hold it",
        hint=NO_GPU_ANSWERS_HINT,
    )


def gone_into_mig_mode(job: Job, snapshot: MachineSnapshot) -> ImpossibleRequest | None:
    """A reading in which too few of the GPUs `job` may use are left to it, GPUs it may use
    being in MIG mode (an administrator switched them while it waited): it would wait for
    ever, where a launch then is refused at once. Run after `own_gpus_silent`: a GPU that
    did not answer may yet be one of them."""
    requirements = job.requirements_for_policy()
    mig = [
        index
        for index, uuid in snapshot.in_mig_mode
        if job.candidates is None or uuid in job.candidates
    ]
    if not mig or snapshot.unanswered:
        return None
    mine = [
        g
        for g in snapshot.gpus
        if (job.candidates is None or g.uuid in job.candidates) and requirements.mismatch(g) is None
    ]
    if len(mine) >= job.gpus:
        return None
    return ImpossibleRequest(
        f"no GPU left that this job may use: {in_mig_mode_words(mig)} now, and gpuwait places jobs "
        "on whole GPUs only",
        hint=MIG_MODE_HINT,
    )


def utilization_unread(job: Job, snapshot: MachineSnapshot) -> BackendUnavailable | None:
    """A reading in which too few of the GPUs `job` may use told their utilization (an NVML
    error other than "not supported") while `--max-util` waits on it, as a failed reading,
    retried up to gpu_error_timeout: a GPU whose every reading fails never passes the cap,
    and the job waited for ever."""
    if job.requirements.get("max_util_pct") is None:
        return None
    mine = [g for g in snapshot.gpus if job.candidates is None or g.uuid in job.candidates]
    failing = [g for g in mine if g.utilization_failed]
    if not failing or len(mine) - len(failing) >= job.gpus:
        return None
    which = ", ".join(f"GPU {g.index}" for g in failing)
    return BackendUnavailable(
        f"the utilization of {which} cannot be read, and --max-util waits on it",
        hint="check the GPUs (nvidia-smi -q -d UTILIZATION), or run without --max-util",
    )


class GpuRetry:
    """Failed readings of the GPUs, retried with back-off until `timeout` seconds of failure.

    A reading that fails once (a transient NVML error, a simulation file caught half-saved) must
    not end the queue: every waiter would exit at once. The clock is monotonic.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.since: float | None = None
        self.delay = GPU_RETRY_FIRST

    def failed(self, exc: GpuwaitError) -> float:
        """Note a failure; return the seconds until the next try. Raises `exc` (with how long
        it lasted) once failures have lasted longer than the timeout."""
        now = time.monotonic()
        if self.since is None:
            self.since, self.delay = now, GPU_RETRY_FIRST
        else:
            self.delay = min(GPU_RETRY_MAX, self.delay * 2)
        lasted = now - self.since
        if lasted >= self.timeout:
            raise self.given_up(exc, lasted) from exc
        return min(self.delay, max(0.0, self.since + self.timeout - now))

    def given_up(self, exc: GpuwaitError, lasted: float) -> GpuwaitError:
        return BackendUnavailable(
            f"{exc.message} (failing for {format_duration(lasted)}, longer than "
            f"gpu_error_timeout = {format_setting_duration(self.timeout)})",
            hint=exc.hint,
        )

    def succeeded(self) -> None:
        self.since = None


class ShortageRetry(GpuRetry):
    """A ledger that cannot be read or written for want of file descriptors or memory
    (StateShortage), retried as a failed reading is, until `timeout` (lock_timeout) seconds of
    failure: another program short of them for a moment must not end every waiter (exit 5)."""

    def given_up(self, exc: GpuwaitError, lasted: float) -> GpuwaitError:
        return StateShortage(
            f"{exc.message} (for {format_duration(lasted)}, longer than "
            f"lock_timeout = {format_setting_duration(self.timeout)})",
            hint=exc.hint,
        )


class TimedOut(Record, frozen=True):
    reason: WaitReason | None


class Interrupted(Record, frozen=True):
    signum: int


class Stuck(Record, frozen=True):
    """Waiting behind running jobs that end only after this one (gpuwait.queue.stuck)."""

    reason: str


WaitOutcome = Admitted | TimedOut | Interrupted | Cancelled | DependencyFailed | Stuck


class Disagreement:
    """Whether this waiter's plan and another member's disagree, in a shared ledger.

    Each member's gpuwait starts only that member's jobs, so every member must come to the same
    plan, and they need not: a busy machine cuts one member's search short (`plan_budget`),
    each member's file keeps the order its own last plan found (`plan_order`), two readings of
    the GPUs are a moment apart. Where this waiter's plan starts another member's job and that
    job waits on, that member's plan starts something else: perhaps this member's job, each
    waiting for the other's, the room left to nobody. Once that has lasted DISAGREE_AFTER, this
    waiter plans in strict order (priority, then submission: no search, nothing of its own, the
    same in every member's gpuwait) until a job starts or ends.

    A job that strict order, too, has started for DISAGREE_AFTER and that still waits has no
    gpuwait that starts it (its entry names a process that waits for nothing, or one that hangs;
    one that is stopped is passed over anyway, `conditions.STOPPED`): it is
    passed over (`passed_over`) for as long as it waits, and the jobs behind it go on.
    """

    def __init__(self) -> None:
        #: Other members' jobs this waiter's plans start now, and since when (monotonic).
        self.since: dict[str, float] = {}
        self.strict = False
        #: The running jobs when it turned strict: strict until they change.
        self.running: frozenset[str] = frozenset()
        #: Other members' jobs that strict order started for DISAGREE_AFTER and that waited on:
        #: left out of this waiter's plans while they wait (`FairShare.passed_over`).
        self.passed_over: frozenset[str] = frozenset()

    def note(self, theirs: frozenset[str], running: frozenset[str], now: float) -> bool:
        """After a plan that starts `theirs` (other members' waiters) now, with `running`
        the ledger's running jobs: whether to plan in strict order from here on."""
        if self.strict and running != self.running:
            self.strict = False  # the queue moved: plans may agree again
        self.since = {job: self.since.get(job, now) for job in theirs}
        late = frozenset(job for job, t in self.since.items() if now - t >= DISAGREE_AFTER)
        if late and self.strict:
            self.passed_over |= late
            self.since = {job: t for job, t in self.since.items() if job not in late}
        elif late:
            self.strict, self.running, self.since = True, running, {}
        return self.strict

    def planned(self, fair: FairShare, waiting: Collection[str]) -> FairShare:
        """`fair` as this waiter plans with it now: in strict order where the plans disagree,
        passing over the jobs passed over that still wait (`waiting`)."""
        self.passed_over = self.passed_over.intersection(waiting)
        if self.strict:
            fair = fair.in_strict_order()
        return fair._replace(passed_over=self.passed_over) if self.passed_over else fair

    @property
    def suspected(self) -> bool:
        """Whether another member's job is to start by this waiter's plan: planning again at
        every reading until it does tells a disagreement within seconds."""
        return bool(self.since)


class Unlocked(Record, frozen=True):
    """What a plan from an unlocked read says (`_reason_without_lock`)."""

    #: Why the job still waits; None when the lock is needed.
    reason: WaitReason | None
    #: Other members' waiters the plan starts now (their own gpuwait is to start them).
    theirs: frozenset[str] = frozenset()


def _reason_without_lock(
    data: LedgerData,
    directory: Path,
    job: Job,
    snapshot: MachineSnapshot,
    safety: float,
    conditions: Conditions,
    fair: FairShare = NO_FAIR_SHARE,
) -> Unlocked:
    """Why `job` still waits, judged from an unlocked read of the ledger in `directory` (reason
    None when the lock is needed), and whose jobs the plan starts meanwhile.

    It is needed to admit anyone, to reap a dead entry or drop a forged one, to settle a
    dependency, to record a GPU's health or the head's hold: anything that writes.
    """
    mine = data.find(job.id)
    if mine is None or mine.state == RUNNING:
        return Unlocked(None)
    now, boot_now = time.time(), proc.boot_clock()
    if lifecycle.would_tidy(data, snapshot, now, directory):
        return Unlocked(None)
    lost = lifecycle.held_for_entries(directory, data, mine, now, boot_now)
    if lost is None:
        if failed_dependency(mine, data) is not None:
            return Unlocked(None)  # it leaves the queue
        lost = lifecycle.held_for_unread(data, mine)
    if lost is not None:
        return Unlocked(lost)  # as the transaction would say, before planning anything
    live = data.referred([*mine.after, *mine.after_ok])
    if any(d not in live for d in (*mine.after, *mine.after_ok)):
        return Unlocked(None)
    claims, budgets = planned_claims(data, snapshot.gpus, fair, now, safety, conditions, boot_now)
    if any(data.mine(j) for j in data.jobs if j.id in budgets):
        return Unlocked(None)  # a wait budget to write down
    decided = plan_ledger(data, snapshot.gpus, claims, safety, conditions, fair)
    # Only this user's entries can be changed by this process (another user's waiter that the
    # plan starts is started by its own gpuwait).
    if any(data.mine(j) for j in data.jobs if j.id in decided.admitted):
        return Unlocked(None)
    for entry in data.jobs:
        held = decided.hold.gpu_uuids if decided.hold and entry.id == decided.hold.job_id else ()
        if data.mine(entry) and entry.state != RUNNING and tuple(entry.held_gpus) != tuple(held):
            return Unlocked(None)
    return Unlocked(decided.waiting.get(job.id), frozenset(decided.admitted))


def _stopped_ahead(data: LedgerData, job: Job) -> bool:
    """Is a waiter ahead of `job` in the queue stopped (Ctrl-Z, SIGSTOP), its gpuwait a process
    of this pid namespace?"""
    mine = data.find(job.id)
    if mine is None:
        return False
    place = (-mine.priority, mine.order)
    return any(
        j.state != RUNNING
        and (-j.priority, j.order) < place
        and not elsewhere(j)
        and proc.stopped(j.pid, j.start_time)
        for j in data.jobs
    )


def _admitted_by_another(ledger: Ledger, job: Job, last: MachineSnapshot | None) -> Admitted | None:
    """If another waiter's plan admitted `job`, what it was given.

    The GPUs are described from this waiter's last reading (or the ledger's record of them):
    reading them again would only delay the start.
    """
    data = ledger.read()
    mine = data.find(job.id)
    if mine is None or mine.state != RUNNING:
        return None
    return lifecycle.found_admission(mine, last or MachineSnapshot(backend="", gpus=()), data)


def _confirm_found(
    ledger: Ledger, backend: Backend, asked: Job, policy: WaitPolicy
) -> Admitted | None:
    """An admission found in a shared ledger, checked against fresh readings before it is used.

    Any member of the group can write the shared ledger, so an entry marked running may be an
    edit rather than a plan: one that puts the job (as it asked, `asked`) where the GPUs have no
    room for it is undone, and the job waits on. Another waiter's plan passes the check.
    """
    snapshot = backend.snapshot()
    if policy.ignore_processes:
        snapshot = name_processes(snapshot)

    def holds(data: LedgerData, mine: Job) -> bool:
        """Whether the admission of this job's running entry `mine` holds."""
        if mine.uid != asked.uid or mine.pid != asked.pid:
            return False
        # Counted as the plan that admitted it counted them (see claims_for).
        tree = unpublished_pids(data.jobs, snapshot.gpus)
        others = [
            as_counted(claim_of(j, snapshot.gpus, tree=tree.get(j.id, ())), j)
            for j in data.jobs
            if j is not mine
        ]
        return admission_fits(
            claim_of(asked, snapshot.gpus),
            mine.gpu_uuids,
            mine.reserved_bytes,
            others,
            snapshot.gpus,
            policy.safety,
            policy.ignore_processes,
        )

    # A lock-free read first: it can only count more than is there (entries of dead processes
    # not yet reaped), so an admission that holds on it holds; the lock is taken to undo one.
    data = ledger.read()
    mine = data.find(asked.id)
    if mine is not None and mine.state == RUNNING and holds(data, mine):
        return lifecycle.found_admission(mine, snapshot, data)
    return lifecycle.confirm_admission(ledger, asked.id, asked, snapshot, holds)


#: The notes on the queue order this process has given: each once, however often its job
#: waits again (resumed after stepping aside, retried after running out of memory).
_ORDER_NOTES: set[str] = set()


def _in_shared_ledger(ledger: Ledger, policy: WaitPolicy) -> WaitPolicy:
    """How a job waits in a shared ledger: its queue in the site's order (`in_shared_ledger`),
    and a warning where that is not the user's own."""
    fair = policy.fair.in_shared_ledger()
    if (fair.order is None) != (policy.fair.order is None):
        own, site = ("fifo", "lookahead") if fair.order else ("lookahead", "fifo")
        note = (
            f"queue_order = {own} of yours is not used in the shared ledger {ledger.directory}: "
            f"everyone's queue there is in the site's order, {site}"
        )
        if note not in _ORDER_NOTES:
            _ORDER_NOTES.add(note)
            ledger.warnings.append(note)
    return policy._replace(fair=fair)


def _refuse_over_new_limit(
    job: Job, snapshot: MachineSnapshot, policy: WaitPolicy, safety_changed: bool = False
) -> None:
    """Raise ImpossibleRequest where a per-user limit set while `job` waited is less than it
    asks alone, or the site's safety (`safety_changed`, the user's own being the site's) now
    leaves no card room enough for it: it would wait for ever (at submission, such a request
    is refused at once)."""
    if policy.fair.limits is None and not safety_changed:
        return
    why = impossible_reason(
        claim_of(job, snapshot.gpus), snapshot.gpus, policy.safety, policy.fair.limits
    )
    if why is None:
        return
    if why.startswith(OVER_LIMIT):
        raise ImpossibleRequest(
            f"{why}, set in the site config file while it waited",
            hint="ask for less or for fewer GPUs: the limit is the site's",
        )
    if safety_changed and why.endswith(f"at safety {policy.safety:g}"):
        raise ImpossibleRequest(
            f"{why}, set in the site config file while it waited",
            hint="ask for less, or set a safety of your own (--safety)",
        )


def _jittered(interval: float) -> float:
    """`interval`, give or take a fifth at random: waiters that read together drift apart."""
    import random  # only once a job waits: a launch that fits at once pays nothing for it

    return interval * random.uniform(0.8, 1.2)


def wait_for_admission(
    ledger: Ledger,
    backend: Backend,
    job: Job,
    policy: WaitPolicy,
    *,
    deadline: float | None,
    on_reason: Callable[[WaitReason], None],
    around: Surroundings | None = None,
) -> tuple[Job, WaitOutcome]:
    """Block until `job` is admitted, `deadline` passes, or a signal arrives.

    `deadline` is on the boot clock (proc.boot_clock): a wall clock stepped meanwhile moves
    it neither way, and the time the machine was suspended counts, as it does for
    `timeout(1)`: a laptop woken after the night does not wait on for what was left of a
    `--timeout` when it was closed, nor start the command hours after it.

    Also ends when the job is cancelled, a dependency it needs to succeed fails, or (`around`:
    what ties this process to running jobs) it would wait behind a job that ends only after it.
    Returns the job as the ledger last had it (for an admitted job: as admitted), and the
    outcome.
    """
    state_dir = ledger.directory
    summaries = wake.Summaries(state_dir, bool(ledger.shared))
    #: The policy as given, before the shared ledger's order applies to it.
    given = policy
    if ledger.shared:
        policy = _in_shared_ledger(ledger, policy)
    #: The job as it asked: a shared ledger's entry can be edited by any member of the group.
    asked = job
    #: Each summary's release count as last seen (by its file).
    last_release: dict[str, int] = {}
    #: When a summary held back (one user's, acted on a moment ago) is to be looked at.
    held_back: float | None = None
    next_read = 0.0
    next_own = 0.0
    #: Whether it has looked for room once: a deadline passed before that (`--timeout 0`)
    #: still lets a job that fits at once start.
    tried = False
    reason: WaitReason | None = None
    window = UtilizationWindow()
    wants_utilization = job.requirements.get("max_util_pct") is not None
    watch = None
    #: (monotonic) Until when the watch's wake-ups are left pending: any member can rename
    #: files in a shared ledger directory as fast as a loop goes, each an event.
    watch_quiet_until = 0.0
    # In a private ledger every writer is this user, and signals the waiters a change concerns.
    kicked = policy.use_inotify and not ledger.shared
    queue_length = 1
    last: MachineSnapshot | None = None
    #: (monotonic time to act, the summary's mtime in ns: when the release was written) while
    #: standing in for the first waiter.
    backup: tuple[float, int] | None = None
    #: (monotonic) When the reason it waits for lapses by itself (`WaitReason.until`), which
    #: nobody signals: it plans then.
    lapses: float | None = None
    #: While `lapses` is set: the jobs whose lost entries the waiter is held for
    #: (`WaitReason.awaited`), and those of them a summary has listed since it last planned.
    #: It plans once all are back: with one still missing the plan would hold it all the
    #: same, and a job listed anew that it is not held for (a launch, another waiter's entry
    #: put back) changes nothing for it.
    awaited: frozenset[str] = frozenset()
    back: set[str] = set()
    #: How many of `back` the waiting line has been told of.
    told_back = 0

    disagreement = Disagreement()

    def trusted(admitted: Admitted | None) -> Admitted | None:
        if admitted is None or not admitted.found or not ledger.shared:
            return admitted
        return _confirm_found(ledger, backend, asked, policy)

    def attempt(stamp: bool = True) -> Attempt | Stuck:
        """Read the GPUs, plan; take the lock only if the plan changes anything."""
        nonlocal last, job, kicked, given, policy
        snapshot = last = backend.snapshot()
        fair_now = given.fair if given.current_fair is None else given.current_fair()
        if fair_now != given.fair:
            before = given.safety
            given = given._replace(fair=fair_now)
            if fair_now.safety_from_site and fair_now.site_safety is not None:
                # No safety of the user's own: the site's, as its file says now.
                given = given._replace(safety=fair_now.site_safety)
            policy = _in_shared_ledger(ledger, given) if ledger.shared else given
            _refuse_over_new_limit(job, snapshot, policy, policy.safety != before)
        silent = (
            no_gpu_answers(snapshot)
            or own_gpus_silent(job, snapshot)
            or utilization_unread(job, snapshot)
        )
        if silent is not None:
            with signals.suppress_failures(Exception):
                lifecycle.note_health(ledger, snapshot)  # LOST in `status` meanwhile
            raise silent
        if (split := gone_into_mig_mode(job, snapshot)) is not None:
            raise split
        if policy.ignore_processes:
            snapshot = name_processes(snapshot)
        window.add(snapshot)
        facts = plan_conditions(window, policy.ignore_processes)
        data = ledger.read()
        if kicked and any(elsewhere(j) for j in data.jobs):
            # A writer in another pid namespace cannot signal this waiter: watch the summary.
            kicked = False
        waiting = [j.id for j in data.jobs if j.state == WAITING]
        fair = disagreement.planned(policy.fair, waiting)
        unlocked = _reason_without_lock(
            data, ledger.directory, job, snapshot, policy.safety, facts, fair
        )
        #: Other members' waiters this plan starts that no plan of this waiter's started
        #: before: their gpuwait is told under the lock (the summary lists them as starting),
        #: else it would look only at its next reading of the GPUs, however far off.
        untold = unlocked.theirs - disagreement.since.keys()
        if ledger.shared and unlocked.reason is not None:
            running = frozenset(j.id for j in data.jobs if j.state == RUNNING)
            disagreement.note(unlocked.theirs, running, time.monotonic())
            planned = disagreement.planned(policy.fair, waiting)
            if planned != fair:
                # Strict from now on, or passing a job over: this plan too.
                fair = planned
                unlocked = _reason_without_lock(
                    data, ledger.directory, job, snapshot, policy.safety, facts, fair
                )
        outcome: Attempt = unlocked.reason
        if outcome is None or untold:
            job, outcome = lifecycle.admit(ledger, job, snapshot, policy.safety, facts, fair)
        if stamp:
            wake.note_planned(state_dir)
        if isinstance(outcome, WaitReason) and around is not None and around.tied:
            # A stage of this pipeline started since (or admitted first) may hold the room
            # for good: it waits for this one to read, or write, the pipe between them.
            why = stuck_behind(job, data, snapshot.gpus, policy.safety, around)
            if why is not None:
                return Stuck(why)
        if isinstance(outcome, WaitReason) and policy.pause_rules is not None:
            # Here: a launch that fits at once pays nothing for pausing.
            from gpuwait.queue.pausing import ask_for_room, pause_progress

            idle = frozenset[str]()
            if policy.idle is not None:
                from gpuwait.queue.idle import idle_jobs

                idle = idle_jobs(policy.idle, snapshot, ledger.read(), policy.ignore_processes)
            ask_for_room(
                ledger,
                job,
                snapshot,
                policy.safety,
                policy.pause_rules,
                idle,
                policy.fair.limits,
            )
            # Said on every reading, not only when asking: the waiter must keep seeing why it
            # still waits (a job that does not catch the signal yet, or ignores it).
            pause = pause_progress(
                ledger.read(),
                job.id,
                time.time(),
                proc.boot_clock(),
                policy.pause_rules.grace_max,
            )
            outcome = outcome._replace(pause=pause)
        return outcome

    def admitted(found: Admitted) -> tuple[Job, WaitOutcome]:
        return found.job, found

    def timed_out() -> tuple[Job, WaitOutcome]:
        # Admitted by another waiter's plan at the last moment: then it runs.
        try:
            late = trusted(_admitted_by_another(ledger, job, last))
        except (StateShortage, BackendUnavailable):
            # Its --timeout, not the bound of the shortage or of failing readings (the
            # admission's check needs one): not admitted, as far as known.
            late = None
        return admitted(late) if late is not None else (job, TimedOut(reason))

    retry = GpuRetry(policy.gpu_error_timeout)
    #: A ledger short of file descriptors or memory: for as long as its lock may be waited for.
    shortage = ShortageRetry(
        policy.gpu_error_timeout if ledger.lock_timeout is None else ledger.lock_timeout
    )

    def failing(exc: GpuwaitError, retrying: GpuRetry) -> None:
        """Say on the wait line that readings (of the GPUs, or the ledger) fail, and put the
        next try off by the back-off; raises once they have failed for too long."""
        nonlocal reason, next_read, next_own
        pause = retrying.failed(exc)
        base = reason or WaitReason(
            needed=describe_need(job.memory_request(), job.gpus),
            best_gpu_index=None,
            best_room=0,
            running=0,
            ahead=0,
        )
        if isinstance(exc, StateShortage):
            failed = base._replace(gpu_error=None, ledger_error=exc.message)
        else:
            failed = base._replace(gpu_error=exc.message, ledger_error=None)
        if failed != reason:
            on_reason(failed)
        reason = failed
        next_read = next_own = time.monotonic() + pause

    # A Ctrl-Z that lands while it reads the GPUs or plans stops it there; the SIGCONT that
    # continues it is kept for the next sleep, which says its line again.
    unwatched = signals.watch_continues()
    try:
        while True:
            try:
                if deadline is not None and tried and proc.boot_clock() >= deadline:
                    # Passed while it slept (a suspended machine wakes up): no plan after it.
                    return timed_out()
                now = time.monotonic()
                event = False
                check_admitted = False
                gone = False
                changed, held_back = summaries.changed(now)
                for seen in changed:
                    shown = None if seen is None else seen.shows(job.id, job.uid)
                    if seen is None:
                        event = True
                    elif shown is None:
                        event = gone = True  # cancelled, or the ledger was recovered: look closer
                    elif shown in seen.running:
                        check_admitted = True
                    else:
                        position = seen.waiting.index(shown)
                        before = last_release.get(seen.source)
                        if before is not None and seen.release != before:
                            if position == 0:
                                event = True
                            elif position == 1:
                                backup = (now + BACKUP_DELAY, seen.written_ns)
                        if seen.lacks_any((*job.after, *job.after_ok)):
                            event = True
                        last_release[seen.source] = seen.release
                        queue_length = len(seen.waiting)
                    if lapses is not None and awaited and seen is not None:
                        back.update(i for i in awaited if seen.shows(i, job.uid) is not None)
                        event = event or back >= awaited
                if lapses is not None and awaited and not back >= awaited:
                    # A job that ended before its gpuwait put its entry back (or whose gpuwait
                    # was killed) leaves no entry to take out: nothing counts as a release, and
                    # nobody is woken. Its lock, let go, tells it.
                    missing = set(awaited - back)
                    back.update(missing - alive.still_held(state_dir, missing))
                    event = event or back >= awaited
                if lapses is not None and len(back) > told_back and not event:
                    # One of them is back (or ended), not all: the waiting line says how many
                    # are still to come, as the ledger read without the lock tells.
                    told_back = len(back)
                    held = lifecycle.held_for_entries(
                        state_dir, ledger.read(), job, time.time(), proc.boot_clock()
                    )
                    if held is None:
                        event = True
                    elif reason is not None and held.blocked != reason.blocked:
                        reason = reason._replace(blocked=held.blocked)
                        on_reason(reason)
                if check_admitted:
                    found = _admitted_by_another(ledger, job, last)
                    try:
                        confirmed = trusted(found)
                    except BackendUnavailable as exc:
                        # Checked against a reading that failed: retried as a failed reading
                        # is, the admission looked at again by the next plan (`admit`).
                        failing(exc, retry)
                    else:
                        if confirmed is not None:
                            return admitted(confirmed)
                        if found is not None:
                            job = asked
                            reason = None  # say why it waits again, after the warning
                        event = True
                if lapses is not None and now >= lapses:
                    event, lapses = True, None
                if backup is not None and now >= backup[0]:
                    # Stand in for the first waiter only if nobody planned since the release was
                    # written: a plan made just before it does not count (it saw the room taken),
                    # nor one stamped in the same tick of the file system's clock, which may have
                    # been made before it. A plan stamped after it may have read the queue before
                    # it, and the waiter that made it then been stopped (Ctrl-Z): nobody would
                    # plan until the next reading of the GPUs.
                    event = (
                        event
                        or not wake.planned_since(state_dir, backup[1] + 1)
                        or _stopped_ahead(ledger.read(), job)
                    )
                    backup = None
                if gone:
                    # Cancelled: said by the ledger as read without the lock. A sweep's hundred
                    # waiters cancelled at once would otherwise each read the GPUs and plan the
                    # whole queue under the lock, one after another, only to learn it.
                    cancelled = lifecycle.cancellation(ledger.read(), job.id)
                    if cancelled is not None:
                        return job, cancelled
                act = event
                #: Planned only to tell a disagreement (`Disagreement.suspected`): not said in
                #: plan.stamp, or the member whose job the plan starts, its waiters taking this
                #: plan for their own reading, would not plan to start it.
                checking = False
                failed_now = False
                if not event and now >= next_read:
                    # A timer, not an event: another waiter's recent reading serves for this one,
                    # unless this one's own waiting line is due.
                    recently = time.time_ns() - int(policy.nvml_interval * 0.8e9)
                    # A --max-util waiter still gathering its first readings takes them itself: no
                    # one else's reading goes into its window.
                    act = (
                        now >= next_own
                        or (wants_utilization and window.needs_more())
                        or not wake.planned_since(state_dir, recently)
                    )
                    checking = not act and disagreement.suspected
                    act = act or checking
                    if not act:
                        next_read = now + _jittered(policy.nvml_interval)
                if act:
                    # Releases counted from here on come after this plan's reading: seen next time.
                    last_release = {}
                    back = set()
                    told_back = 0
                    for seen in summaries.current():
                        last_release[seen.source] = seen.release
                        queue_length = len(seen.waiting)
                    tried = True
                    try:
                        outcome = attempt(stamp=not checking)
                        if isinstance(outcome, Admitted):
                            outcome = trusted(outcome)
                            if outcome is None:
                                job = asked
                                reason = None  # say why it waits again, after the warning
                    except BackendUnavailable as exc:
                        failing(exc, retry)
                        failed_now = True
                    else:
                        retry.succeeded()
                        shortage.succeeded()
                        failed_now = False
                if act and not failed_now:
                    if isinstance(outcome, Admitted):
                        return admitted(outcome)
                    if isinstance(outcome, (Cancelled, DependencyFailed, Stuck)):
                        return job, outcome
                    if outcome is not None and outcome != reason:
                        on_reason(outcome)
                    reason = outcome
                    lapses = None
                    awaited = frozenset()
                    if outcome is not None and outcome.until is not None:
                        left = outcome.until - proc.boot_clock()
                        if left > 0:  # a moment after it: the plan then finds it over
                            lapses = time.monotonic() + left + LAPSE_MARGIN
                            awaited = frozenset(outcome.awaited)
                    interval = policy.nvml_interval
                    if wants_utilization and window.needs_more():
                        interval = min(interval, UTIL_SAMPLE_INTERVAL)
                    next_read = time.monotonic() + _jittered(interval)
                    next_own = time.monotonic() + max(
                        OWN_PLAN_INTERVAL, OWN_PLAN_SPACING * queue_length
                    )
                if watch is None and not kicked:
                    # Set up only once the job has to wait: a launch that fits at once pays nothing.
                    from gpuwait.linux.inotify import LedgerWatch

                    watch = LedgerWatch(state_dir if policy.use_inotify else None)
                    continue  # the summary may have changed before the watch began
                watching = watch is not None and watch.active
                wake_at = next_read
                # Woken by the watch a moment ago: the next of its wake-ups is taken once the
                # gap has passed, whatever it was about, so that no member's loop of renames
                # keeps every waiter busy (a summary acted on takes SOURCE_GAP anyway).
                quieted = watching and time.monotonic() < watch_quiet_until
                if quieted:
                    wake_at = min(wake_at, watch_quiet_until)
                for moment in (backup[0] if backup is not None else None, held_back, lapses):
                    if moment is not None:
                        wake_at = min(wake_at, moment)
                if lapses is not None and awaited:
                    wake_at = min(wake_at, time.monotonic() + RECOVERY_LOOK)
                sleep = (
                    max(0.0, wake_at - time.monotonic())
                    if kicked or watching
                    else policy.poll_interval
                )
                if deadline is not None:
                    remaining = deadline - proc.boot_clock()
                    if remaining <= 0:
                        return timed_out()
                    sleep = min(sleep, remaining)
                also = (
                    (watch.wake_signal,) if watch is not None and watching and not quieted else ()
                )
                # Waiting, this launch has had its turn: the next one in the turnstile loads now.
                turnstile.leave()
                info, continued = signals.next_signal_or_stop(
                    sleep, also=also, continues=unwatched is not None
                )
                if continued:
                    # Stopped with Ctrl-Z and continued (`fg`, `bg`): the shell's `Stopped`
                    # and prompt came below the waiting line, which is said again at once, and
                    # the queue, passed over meanwhile, planned afresh.
                    if reason is not None:
                        on_reason(reason)
                    next_read = next_own = time.monotonic()
                    continue
                if info is None:
                    continue
                if info.si_signo == signal.SIGCHLD:
                    # A ledger writer's wake-up (a reserving program's own child that ended is
                    # told to its handler once the wait is over: runner.hold): the summary was
                    # written, whatever its metadata says. In a shared ledger that is the
                    # writer's own, wake.<uid>.json, not wake.json: every summary is read, each
                    # acted on only if what it holds changed.
                    summaries.written(None if ledger.shared else (wake.FILENAME,))
                    continue
                if watch is not None and watching and info.si_signo == watch.wake_signal:
                    summaries.written(watch.drain(wake.EVENT_NAMES))
                    watch_quiet_until = time.monotonic() + wake.SOURCE_GAP
                    continue
                return job, Interrupted(info.si_signo)
            except StateShortage as exc:
                # The ledger could not be read or written for a moment (no file descriptor
                # left, no memory): nothing was decided; tried again as a failed reading is.
                failing(exc, shortage)
    except signals.SignalPending as exc:
        # Given up waiting for the ledger lock, which another process holds: the signal ends
        # the wait as it would have in the sleep above.
        return job, Interrupted(exc.signum)
    finally:
        if watch is not None:
            watch.close()
        if unwatched is not None:
            signals.unwatch_continues(unwatched)
