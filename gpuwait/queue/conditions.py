"""Between the ledger and the pure policy: entries as claims, dependencies, holds, and the facts
the plan needs.

The policy sees claims and conditions only; this module derives them from ledger entries (a job
blocked by an unfinished `--after` dependency), from /proc (process names for the ignore list)
and from several GPU readings over time (utilization for `--max-util`). The changes it works
out (dependencies met, the plan's hold kept in the head's entry so that it sticks to its GPUs
from one plan to the next) are made on a transaction's data by gpuwait.queue.lifecycle.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path

from gpuwait.core.lookahead import plan_queue, with_wait_budgets
from gpuwait.core.policy import (
    Claim,
    Conditions,
    FairShare,
    Hold,
    Plan,
    UserLimits,
    user_holdings,
    whole_card_room,
)
from gpuwait.core.sizes import MemoryRequest, sizes_on_gpus
from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot
from gpuwait.gpu import with_names
from gpuwait.history.record import RunOutcome
from gpuwait.history.store import batch_outcomes, find_outcome, latest_outcomes
from gpuwait.linux import pidns, proc, security, userns
from gpuwait.queue.bookkeeping import FAILED, OK, Finished
from gpuwait.queue.entries import RUNNING, WAITING, Job, LedgerData, elsewhere, run_time, since
from gpuwait.queue.fairness import NO_FAIR_SHARE, user_usage

#: Readings of utilization averaged for `--max-util`, and how many are needed before trusting it.
UTIL_WINDOW = 5
UTIL_MIN_SAMPLES = 3


def _label(job_id: str, name: str | None) -> str:
    return f"job {job_id} ({name})" if name else f"job {job_id}"


def dependency_blocker(
    job: Job, data: LedgerData, index: Mapping[str, list[tuple[int, Job]]] | None = None
) -> str | None:
    """Why `job` must still wait for its dependencies, or None when none is unfinished.

    An `--after-ok` dependency that ended without success blocks for good: the job's own
    gpuwait notices and gives up (exit 6), and no plan admits it meanwhile. A job that stepped
    aside waits for the job it made room for to start, but not while that one's gpuwait is
    stopped (Ctrl-Z): passed over, it starts nothing, and the room would stay idle. Both are
    read as the job's own user keeps them (`LedgerData.reference`), whoever plans, or as a
    gpuwait of theirs from before kept them (`LedgerData.as_kept_in`), looked up in `index`
    (`LedgerData.by_plain_id`), which a plan of the whole queue makes once.
    """
    # Only the entries it names are looked for: a plan asks this of every entry, and a look
    # through the whole ledger for each (a sweep's jobs each --after its preparation) took
    # seconds a plan.
    live = data.as_kept_in(job, index)
    stepped_aside_for = live.get(job.yield_to) if job.yield_to else None
    if (
        stepped_aside_for is not None
        and stepped_aside_for.state != RUNNING
        and not _stopped(stepped_aside_for)
    ):
        return f"stepped aside for job {stepped_aside_for.id}; resumes once it has started"
    for dep in job.after_ok:
        done = data.book.outcome(dep) if dep not in live else None
        if dep not in live and (done is None or not done.succeeded):
            return f"job {dep} did not succeed; giving up (--after-ok)"
    pending = [d for d in dict.fromkeys([*job.after, *job.after_ok]) if d in live]
    if not pending:
        return None
    first = live[pending[0]]
    more = f" and {len(pending) - 1} more" if len(pending) > 1 else ""
    how = " successfully" if pending[0] in job.after_ok else ""
    return f"waiting for {_label(first.id, first.name)}{more} to finish{how}"


#: Why a waiter whose gpuwait is stopped waits.
STOPPED = "stopped (Ctrl-Z, SIGSTOP): passed over until continued, keeping its place"


def _stopped(job: Job) -> bool:
    """Is `job` a waiter whose gpuwait is stopped (Ctrl-Z, SIGSTOP)?"""
    return job.state != RUNNING and gpuwait_stopped(job)


def gpuwait_stopped(job: Job) -> bool:
    """Is `job`'s gpuwait (a process of this pid namespace) stopped (Ctrl-Z, SIGSTOP)?"""
    return not elsewhere(job) and proc.stopped(job.pid, job.start_time)


def _blocker(job: Job, data: LedgerData, index: Mapping[str, list[tuple[int, Job]]]) -> str | None:
    """Why the plan must pass `job` over: an unfinished dependency, or, for a waiter, its
    gpuwait stopped (Ctrl-Z, SIGSTOP): admitted, it would keep room it cannot start in for as
    long as it stays stopped, from everyone behind it. Continued, it plans again, in its place."""
    if _stopped(job):
        return STOPPED
    return dependency_blocker(job, data, index)


def settle_dependencies(job: Job, data: LedgerData) -> str | None:
    """Drop the dependencies that are met; say why `job` can never start if one failed.

    How a dependency ended is in the book, else (more than its last FINISHED_KEPT outcomes
    ago: a sweep of hundreds ending while this job's gpuwait was kept from the ledger) at the
    end of the history of the job's user, where it is looked up as for `--after` itself."""
    live = data.referred([*job.after, *job.after_ok])
    older: dict[str, RunOutcome] | None = None  # the history's, read once if at all
    for dep in list(job.after_ok):
        if dep in live:
            continue
        done = data.book.outcome(dep)
        if done is None and job.history_dir is not None:
            if older is None:
                wanted = [d for d in job.after_ok if d not in live and data.book.outcome(d) is None]
                older = latest_outcomes(Path(job.history_dir), wanted=wanted)
            done = _finished(older[dep]) if dep in older else None
        if done is None:
            return f"job {dep} left no record of how it ended; --after-ok cannot be met"
        if not done.succeeded:
            return _cannot_be_met(done)
        job.after_ok.remove(dep)
    job.after = [d for d in job.after if d in live]
    return None


def failed_dependency(job: Job, data: LedgerData) -> str | None:
    """Why `job` can never start, where the book tells that one of its `--after-ok`
    dependencies failed (whatever is not known yet of the others); None where it tells none.
    Changes nothing."""
    live = data.referred(job.after_ok)
    for dep in job.after_ok:
        done = None if dep in live else data.book.outcome(dep)
        if done is not None and not done.succeeded:
            return _cannot_be_met(done)
    return None


def _cannot_be_met(done: Finished) -> str:
    return f"{_label(done.id, done.name)} {done.describe()}; --after-ok cannot be met"


def busy_gpus(data: LedgerData) -> frozenset[str]:
    """UUIDs of the GPUs running jobs are on."""
    return frozenset(u for j in data.jobs if j.state == RUNNING for u in j.gpu_uuids)


def record_hold(data: LedgerData, hold: Hold | None) -> None:
    """Keep the head's GPUs in its entry (and nobody else's), so the hold sticks. Another
    user's head keeps its hold in its own file, written by its own gpuwait."""
    for job in data.jobs:
        wanted = list(hold.gpu_uuids) if hold is not None and job.id == hold.job_id else []
        if data.mine(job) and job.state != RUNNING and job.held_gpus != wanted:
            job.held_gpus = wanted


def name_processes(snapshot: MachineSnapshot) -> MachineSnapshot:
    """The snapshot with each GPU process's command name filled in from /proc."""
    return snapshot._replace(gpus=tuple(with_names(g) for g in snapshot.gpus))


class UtilizationWindow:
    """The last few utilization readings per GPU; their mean is what `--max-util` compares."""

    def __init__(self, size: int = UTIL_WINDOW) -> None:
        self._readings: dict[str, deque[int | None]] = {}
        self._size = size

    def add(self, snapshot: MachineSnapshot) -> None:
        for gpu in snapshot.gpus:
            if gpu.utilization_failed:
                # A failed reading says nothing: the earlier ones stand (with none, the GPU
                # does not pass a cap yet), where taken as "does not report" it would pass.
                continue
            window = self._readings.setdefault(gpu.uuid, deque(maxlen=self._size))
            window.append(gpu.utilization_pct)

    def needs_more(self) -> bool:
        """True while some GPU that reports utilization has too few readings to judge."""
        return any(len(w) < UTIL_MIN_SAMPLES and w[-1] is not None for w in self._readings.values())

    def means(self, minimum: int = UTIL_MIN_SAMPLES) -> dict[str, float | None]:
        """Mean per GPU over the window; None where the GPU does not report utilization."""
        means: dict[str, float | None] = {}
        for uuid, window in self._readings.items():
            if window[-1] is None:
                means[uuid] = None
                continue
            known = [r for r in window if r is not None]
            if len(known) >= minimum:
                means[uuid] = sum(known) / len(known)
        return means


def plan_conditions(
    window: UtilizationWindow | None, ignore_processes: Iterable[str] = ()
) -> Conditions:
    return Conditions(
        utilization=window.means() if window is not None else {},
        ignore_processes=frozenset(ignore_processes),
    )


def resolve_references(refs: Sequence[str], data: LedgerData, state_dir: Path) -> list[str]:
    """Job ids named by `--after` values: ids or names (`--name`, `--batch`) of jobs waiting,
    running or finished. A name means the user's own jobs of that name where they have any,
    waiting, running or finished (another member of a shared ledger may give theirs the same
    one), else another user's waiting or running ones. Raises ValueError for a reference that
    names none."""
    ids: list[str] = []
    own = [j for j in data.jobs if data.mine(j)]
    for ref in refs:
        found = [j.id for j in own if ref in (j.id, j.name, j.batch)]
        if any(j.batch == ref for j in own):
            # A batch is all its jobs: those that ended too, or --after-ok would not see that
            # one of them failed; one the book no longer names first, so that it is the one
            # a job that needs the batch's success says failed.
            found[:0] = _failed_beyond_book(ref, own, data, state_dir)
            found.extend(f.id for f in data.book.finished if f.batch == ref)
        if not found:
            done = [f for f in data.book.finished if ref in (f.id, f.name, f.batch)]
            if done:
                latest_name = [f for f in done if f.name == ref or f.id == ref]
                # A name given to several runs means its latest; a batch means all of it.
                found = [latest_name[-1].id] if latest_name else [f.id for f in done]
        if not found:
            ran = find_outcome(state_dir, ref)
            if ran is not None:
                left = _finished(ran)
                data.book.note_finished(left)
                found = [left.id]
                # Its id is this user's again: another user's entry that took it is shown
                # with its owner, as entries.combine shows one taking an id in the book.
                for other in data.jobs:
                    if other.id == left.id and not data.mine(other):
                        other.id = f"{other.id}@{other.uid}"
        if not found:
            found = _theirs(ref, data)
        if not found:
            raise ValueError(f"no job, name or batch {ref!r} is waiting, running or finished")
        ids.extend(i for i in found if i not in ids)
    return ids


def _finished(ran: RunOutcome) -> Finished:
    """A run found in the history, as the book keeps how a job left."""
    return Finished(
        id=ran.job_id,
        outcome=OK if ran.exit_status == 0 else FAILED,
        finished_at=ran.ended_at,
        name=ran.name,
        exit_status=ran.exit_status,
        signal=ran.signal,
    )


def _failed_beyond_book(
    batch: str, own: Sequence[Job], data: LedgerData, state_dir: Path
) -> list[str]:
    """A job of `batch`, still in the queue, that failed where the book no longer names it:
    it keeps the last FINISHED_KEPT outcomes, and a sweep of hundreds ends more before its
    last jobs. Its counts of the batch tell one is missing; the history's end names it, a run
    that ended after the earliest of the batch's jobs still queued was submitted (not a run of
    the same batch name days before). Noted in the book, for its dependents' plans."""
    counts = data.book.batches.get(batch)
    named = sum(1 for f in data.book.finished if f.batch == batch and not f.succeeded)
    if counts is None or counts.failed + counts.cancelled <= named:
        return []
    since = min(j.submitted_at for j in own if j.batch == batch)
    known = {f.id for f in data.book.finished}
    for ran in batch_outcomes(state_dir, batch):
        left = _finished(ran)
        if not left.succeeded and left.id not in known and left.finished_at >= since:
            data.book.note_finished(left)
            return [left.id]
    return []


def _theirs(ref: str, data: LedgerData) -> list[str]:
    """The other users' jobs `ref` names, as dependencies keep them (`LedgerData.reference`):
    the one of that `ID@UID`, or of that id; else those of that name or batch. ValueError where
    the id is that of several users' jobs (another member may give an entry of theirs the id of
    anyone's job): which one is meant, the user says with its `ID@UID`."""
    exact = [j for j in data.jobs if data.reference(j) == ref]
    by_id = exact or [j for j in data.jobs if ref in (j.id, data.reference(j).rsplit("@", 1)[0])]
    if len(by_id) > 1:
        from gpuwait.core.text import printable  # only such a reference needs it

        named = ", ".join(printable(data.reference(j), 30) for j in by_id)
        raise ValueError(
            f"{printable(ref, 30)} is the id of several users' jobs ({named}): name one"
        )
    named_so = by_id or [j for j in data.jobs if ref in (j.name, j.batch)]
    return [data.reference(j) for j in named_so]


# --- entries as claims ------------------------------------------------------------------


def _from_elsewhere(job: Job, gpus: Sequence[GpuSnapshot], theirs: set[int]) -> set[int]:
    """NVML's pids of the processes of `job`, an entry of another pid namespace, which names
    them `theirs` by that namespace's pids. NVML's are the host's: only a reader in the host's
    namespace sees those processes, and each tells it its pid in its own namespace. Elsewhere
    none are found: the job's memory counts as used by others, besides its reservation."""
    if job.pidns is None or pidns.in_initial_namespace() is not True:
        return set()
    return {
        process.pid
        for gpu in gpus
        if gpu.uuid in job.gpu_uuids
        for process in gpu.processes
        if pidns.pid_within(process.pid, job.pidns) in theirs
    }


def reserved_less(job: Job, gpus: Sequence[GpuSnapshot]) -> dict[str, int]:
    """The GPUs of `job` (read in `gpus`) where it reserves less than `job.reserved_bytes`
    (its largest card's), and how much (`job.reserved_by_gpu`, never above it): on cards of
    different sizes a share of each card, or each card whole; an adopted process, what it
    used on each."""
    mine = {g.uuid for g in gpus} & set(job.gpu_uuids)
    each = {u: job.reserved_on(u) for u in mine}
    return {u: b for u, b in each.items() if b < job.reserved_bytes}


def reserved_on_each(job: Job, gpus: Sequence[GpuSnapshot]) -> str | None:
    """`12.0 GiB on GPU0, 40.0 GiB on GPU1`: what `job` reserves on each of its GPUs, where
    that differs between them; None where it is `job.reserved_bytes` on every one."""
    less = reserved_less(job, gpus)
    if not less:
        return None
    return sizes_on_gpus(
        (less.get(g.uuid, job.reserved_bytes), f"GPU{g.index}")
        for g in gpus
        if g.uuid in job.gpu_uuids
    )


def thawed_request(job: Job, gpus: Sequence[GpuSnapshot]) -> MemoryRequest | None:
    """What `job` asks for: a frozen job's memory comes back as it was, so one frozen past its
    reservation asks for the most it used there (`Job.grown`), not for its reservation; but no
    more than its card ever gives a job (its safety's share, less what the driver keeps for
    itself, `whole_card_room`), or it would never be thawed."""
    request = job.memory_request()
    if job.frozen_at is None or request is None:
        return request
    held = 0
    for gpu in gpus:
        if gpu.uuid in job.frozen_gpus and gpu.uuid in job.grown:
            most = whole_card_room(gpu, 1.0 if job.safety is None else job.safety)
            held = max(held, min(job.grown[gpu.uuid], most))
    # A share of the card (`--vram 20%`) as the bytes it is on the cards it was frozen on.
    asked = max((request.on(g.total_bytes) for g in gpus if g.uuid in job.frozen_gpus), default=0)
    return MemoryRequest(bytes=held) if held > asked else request


def grown_of(job: Job) -> dict[str, int]:
    """The most `job` used past its reservation on each of its GPUs in this run (`Job.grown`);
    where an older gpuwait runs it, which writes no `grown`, at least the overuse it recorded
    (`overuse_bytes` on `overuse_gpu`, past its margin): room it takes again once let go."""
    grown = {u: b for u, b in job.grown.items() if u in job.gpu_uuids}
    uuid = job.overuse_gpu
    if uuid is not None and uuid in job.gpu_uuids and job.overuse_bytes > grown.get(uuid, 0):
        grown[uuid] = job.overuse_bytes
    return grown


def claim_of(
    job: Job,
    gpus: Sequence[GpuSnapshot],
    now: float | None = None,
    blocked: str | None = None,
    usage: float = 0.0,
    tree: Iterable[int] = (),
    boot_now: float | None = None,
) -> Claim:
    """`job` for the policy, its usage read from the same snapshot as the GPUs.

    `usage` is the owner's fair-share usage (see gpuwait.queue.fairness), which orders waiters
    of one priority between users.

    Taking `observed` from the snapshot (not from the ledger's last published figure) keeps
    `external` and `committed` consistent with each other: nothing is counted twice, and
    nothing allocated since the snapshot can be subtracted from a reading that lacks it.
    A job's expected time is what is left of it at `now` (never below zero): of a running job,
    less the time since its start; of one that resumes, less what its earlier runs did. `tree`:
    more processes of the job's, found since it last published its pids (`unpublished_pids`).
    Durations are measured on the boot clock where the entry and `boot_now` allow
    (entries.since): without `now`, both clocks are read.
    """
    if now is None:
        now, boot_now = time.time(), proc.boot_clock()
    named = {*job.pids} if job.child_pid is None else {*job.pids, job.child_pid}
    pids = _from_elsewhere(job, gpus, named) if elsewhere(job) else {*named, *tree}
    observed = {g.uuid: g.process_bytes(pids) for g in gpus if g.uuid in job.gpu_uuids}
    # Its run time, a suspend of the machine left out, as the history's run times leave it out.
    elapsed = run_time(job, now, boot_now) if job.state == RUNNING else 0.0
    # A job that stepped aside, or was frozen, resumes the work its earlier runs left.
    done = elapsed + job.done_seconds
    expected = None if job.expected_seconds is None else max(0.0, job.expected_seconds - done)
    expected_by_gpu = {u: max(0.0, s - done) for u, s in job.expected_by_gpu.items()}
    return Claim(
        job_id=job.id,
        running=job.state == RUNNING,
        priority=job.effective_priority,
        order=job.order,
        request=thawed_request(job, gpus),
        gpus_wanted=job.gpus,
        # A frozen job's memory can come back only on the GPUs it was frozen on.
        candidates=frozenset(job.frozen_gpus)
        if job.frozen_at is not None
        else frozenset(job.candidates)
        if job.candidates is not None
        else None,
        pick=job.pick,
        gpu_uuids=tuple(job.gpu_uuids),
        reserved_bytes=job.reserved_bytes,
        reserved_by_gpu=reserved_less(job, gpus),
        observed=observed,
        grown=grown_of(job),
        # Written for this run, not an earlier one an older gpuwait started the job again after.
        unlisted_at_start=dict(job.unlisted_at_start)
        if job.unlisted_started_at is not None and job.unlisted_started_at == job.started_at
        else {},
        pids=frozenset(pids),
        requirements=job.requirements_for_policy(),
        blocked=blocked,
        expected_seconds=expected,
        expected_by_gpu=dict(expected_by_gpu),
        # What it has run in all: one past its expected end runs on for a share of that.
        ran=done,
        held=tuple(job.held_gpus),
        weights=dict(job.weights),
        # Per-user limits hold a user of the machine: a rootless container's uid 0 and its
        # user's uid on the host are one (a shared ledger's entries have no `kuid`: each is
        # its file owner's, whatever it says).
        uid=machine_user(job),
        usage=usage,
        prefer=frozenset(job.prefer),
        waited=max(0.0, since(job.submitted_at, job.submitted_boot, now, boot_now)),
        due=job.wait_budget,
        safety=job.safety,
    )


def machine_user(job: Job) -> int:
    """Whose job `job` is, for per-user limits and status's users: its owner as the machine
    knows them, else (a uid this namespace does not map) its uid here."""
    known = userns.known_as(job.uid, job.kuid)
    return job.uid if known is None else known


def uids_by_user(jobs: Iterable[Job]) -> dict[int, set[int]]:
    """The uids (as this namespace knows them) under which each user of the machine
    (`machine_user`) has jobs here: theirs on the host and in their rootless container."""
    found: dict[int, set[int]] = {}
    for job in jobs:
        found.setdefault(machine_user(job), set()).add(job.uid)
    return found


def claims_for(
    data: LedgerData,
    gpus: Sequence[GpuSnapshot],
    fair: FairShare,
    now: float,
    boot_now: float | None = None,
) -> list[Claim]:
    """Every entry as a policy claim: its dependency blocker (if any), what is left of its
    expected time at `now` (`boot_now` on the boot clock), and its user's usage when fair
    share is on."""
    usage = {} if fair.half_life is None else user_usage(data, now, fair.half_life, boot_now)
    # One user's usage under all their uids: their jobs keep their order among themselves.
    usage = {
        user: sum(usage.get(uid, 0.0) for uid in uids)
        for user, uids in uids_by_user(data.jobs).items()
    }
    tree = unpublished_pids(data.jobs, gpus)
    on_gpus = {p.pid for g in gpus for p in g.processes}
    index = data.by_plain_id()
    return [
        _safety_believed(
            as_counted(
                claim_of(
                    j if data.mine(j) else their_own_processes(j, on_gpus),
                    gpus,
                    now,
                    blocked=_blocker(j, data, index),
                    usage=usage.get(machine_user(j), 0.0),
                    tree=tree.get(j.id, ()),
                    boot_now=boot_now,
                ),
                j,
            ),
            data.mine(j),
            fair.site_safety,
            j.safety_from_site,
        )
        for j in data.jobs
        if not (j.id in fair.passed_over and j.state == WAITING and not data.mine(j))
    ]


def their_own_processes(job: Job, among: Collection[int]) -> Job:
    """Another user's entry claiming as its job's, of the processes `among` (those that
    matter: on the GPUs, or the one to adopt), only processes of that user's, or (a `sudo` in
    its command) below its gpuwait: a process of someone else's that it names is no load of
    its job. Taken as its, that process would count for no foreign one, and a card that takes
    one process at a time, which it holds, would look free to start a job on (the memory it
    uses still counts, whoever claims it). Only those `among` are looked at: a file may name
    thousands of pids."""
    if elsewhere(job):
        return job  # its pids are another namespace's: told apart by the kernel there
    named = [p for p in (*job.pids, job.child_pid) if p is not None and p in among]
    strangers = {p for p in named if security.command_owner_mismatch(job, p) is not None}
    if not strangers:
        return job
    # Its gpuwait, proven the user's, where it lives; an orphan's command, where it is gone,
    # if that is the user's own (an entry that says so of a process of someone else's, its
    # gpuwait alive all along, would claim that process and all below it).
    orphan = job.orphaned_at is not None
    roots = [job.pid] if not orphan or proc.is_alive(job.pid, job.start_time) else []
    if (
        orphan
        and job.child_pid is not None
        and security.command_owner_mismatch(job, job.child_pid) is None
    ):
        roots.append(job.child_pid)
    strangers -= proc.process_tree(roots)
    return job._replace(
        pids=[p for p in job.pids if p not in strangers],
        child_pid=None if job.child_pid in strangers else job.child_pid,
    )


def adoption_over_limit(
    data: LedgerData, job: Job, gpus: Sequence[GpuSnapshot], limits: UserLimits | None
) -> str | None:
    """Why adopting `job` (a running process, `gpuwait adopt`) with its reservation would take
    its user over their VRAM limit, counted as plans count what a user holds; None where it
    would not, or where it reserves no more than it uses on each of its GPUs: what it uses is
    held whatever the limit, and adopting it only says whose it is."""
    if limits is None or limits.max_vram is None:
        return None
    if all(job.reserved_on(uuid) <= job.observed.get(uuid, 0) for uuid in job.gpu_uuids):
        return None
    claims = claims_for(data, gpus, NO_FAIR_SHARE, time.time(), proc.boot_clock())
    _, held = user_holdings(claims).get(machine_user(job), (0, 0))
    # The GPUs it is on are held already, adopted or not: only its VRAM is asked for.
    return UserLimits(max_vram=limits.max_vram).refusal(0, held, 0, job.reserved_in_all())


def vram_of_user(data: LedgerData, gpus: Sequence[GpuSnapshot], uid: int) -> tuple[int, int]:
    """What the running jobs of the user `uid` (a uid of this namespace) hold over all GPUs as
    their VRAM limit counts it (`Claim.limit_on`), and what they reserve."""
    me = userns.known_as(uid, userns.outer(uid))
    claims = claims_for(data, gpus, NO_FAIR_SHARE, time.time(), proc.boot_clock())
    mine = [c for c in claims if c.running and c.uid == me]
    held = sum(sum(map(c.limit_on, c.gpu_uuids)) for c in mine)
    return held, sum(sum(map(c.reserved_on, c.gpu_uuids)) for c in mine)


def _safety_believed(
    claim: Claim, mine: bool, floor: float | None, from_site: bool = False
) -> Claim:
    """`claim` with its owner's safety as this user's plan heeds it: the site's (`floor`) as
    its file says now where they set none of their own (`from_site`: a safety raised there
    holds their jobs submitted before as it holds those submitted since); their own as it is,
    another user's no stricter than the site's, which holds everyone alike. Their own still
    keeps their job from starting fuller than it allows (`Claim.own_safety`)."""
    if from_site and floor is not None and claim.safety is not None:
        return claim._replace(safety=floor)
    if mine or floor is None or claim.safety is None or claim.safety >= floor:
        return claim
    return claim._replace(safety=floor, own_safety=claim.safety)


def as_counted(claim: Claim, job: Job) -> Claim:
    """`job`'s claim as plans count it. Where its command has ended (`command_ended`), what its
    processes still hold is counted (observed, or as used by others); the room kept for what it
    had yet to allocate is not: it never will, nor take again what it grew to (`grown`)."""
    if not command_ended(job):
        return claim
    return claim._replace(reserved_bytes=0, reserved_by_gpu={}, grown={})


def command_ended(job: Job) -> bool:
    """A running job whose command has ended while its gpuwait, stopped (`kill -STOP` aimed at
    its pid alone, which cannot be caught), cannot take the entry out for as long as it stays
    so. A gpuwait that runs takes it out within moments, and its reservation counts until
    then, as it always has: the ledger never shows a card given twice."""
    return (
        job.state == RUNNING
        and job.child_pid is not None
        and gpuwait_stopped(job)
        and not proc.is_alive(job.child_pid, job.child_start_time)
    )


#: How many parents up a GPU process is followed to the command of the job that started it.
ANCESTRY_DEPTH = 8


def unpublished_pids(jobs: Iterable[Job], gpus: Sequence[GpuSnapshot]) -> dict[str, set[int]]:
    """GPU processes that no entry names yet, by the running job whose command started them.

    A job publishes its process tree at its next sample (a second or so after it starts), so a
    command that starts its GPU work in a child (`sh -c`, torchrun, make) has memory that no
    entry names until then. Counted as memory outside gpuwait, it would be counted twice (also
    as the job's reservation), and a plan would take a card that can run a large job for one
    that cannot. Only processes of the job's own user are taken: nobody can claim another
    user's memory as part of their reservation.
    """
    roots: dict[int, Job] = {}
    named: set[int] = set()
    for job in jobs:
        if elsewhere(job):
            continue
        named.update(job.pids)
        if job.state == RUNNING and job.child_pid is not None:
            roots[job.child_pid] = job
            named.add(job.child_pid)
    found: dict[str, set[int]] = {}
    if not roots:
        return found
    for gpu in gpus:
        for process in gpu.processes:
            if process.pid in named:
                continue
            pid: int | None = process.pid
            for _ in range(ANCESTRY_DEPTH):
                pid = proc.parent_pid(pid) if pid is not None else None
                if pid is None or pid <= 1:
                    break
                owner = roots.get(pid)
                if owner is not None:
                    if proc.owner_uid(process.pid) == owner.uid:
                        found.setdefault(owner.id, set()).add(process.pid)
                    break
    return found


def planned_claims(
    data: LedgerData,
    gpus: Sequence[GpuSnapshot],
    fair: FairShare,
    now: float,
    safety: float,
    conditions: Conditions,
    boot_now: float | None = None,
) -> tuple[list[Claim], dict[str, float]]:
    """`claims_for`, with the lookahead order's wait budgets given to waiters that have none
    yet (core/lookahead.with_wait_budgets); and those new budgets, by job id, for the ledger."""
    claims = claims_for(data, gpus, fair, now, boot_now)
    if fair.order is None or all(c.running or c.due is not None for c in claims):
        return claims, {}
    budgeted = with_wait_budgets(gpus, claims, safety, fair.order, conditions)
    new = {
        after.job_id: after.due
        for before, after in zip(claims, budgeted, strict=True)
        if before.due is None and after.due is not None
    }
    return budgeted, new


def plan_ledger(
    data: LedgerData,
    gpus: Sequence[GpuSnapshot],
    claims: Sequence[Claim],
    safety: float,
    conditions: Conditions,
    fair: FairShare,
) -> Plan:
    """The plan of the queue in `data` (its `claims`) as a waiter or an admission makes it:
    within the plan budget, searched on from the order the last admission's plan found (the
    ledger's `plan_order`), so that both, given one ledger, make the same plan."""
    return plan_queue(
        gpus, claims, safety, data.rr_cursor, conditions, fair, time.monotonic, data.plan_order
    )
