"""The scheduling policy: pure functions over snapshots and ledger claims.

No I/O, no clock, no NVML: everything it needs is passed in, so it can be property-tested.

Per GPU:
    usable    = total * safety
    external  = device used - memory observed for gpuwait jobs on that GPU   (never below 0)
    committed = sum over running jobs of max(reserved, observed, grown)
    room      = usable - external - committed

A job that has not allocated yet still holds its reservation; a job that grew past it counts at
its real size, and at the most it grew to for as long as it runs (memory it let go of, it takes
again: a waiter started into it would run out); and nothing is counted twice, because what a job really uses is taken out of
`external` before `committed` adds it back.

The queue (`plan`): waiters are looked at in queue order (priority, then submission). One that
fits starts at once. The first one that does not fit, the head, holds the GPU(s) on which it
could start soonest, so a big job is never starved by a stream of small ones. A later waiter may
start on a held GPU (backfill) only where that cannot delay the head's expected start: when it is
expected to end before then, or when it fits in the memory the head will leave spare at that
time. Both need run times: when the head's start cannot be told (a job it waits for has no
estimate), nothing is backfilled onto its GPUs, and a waiter with no estimate of its own is
never backfilled onto them, not even into the spare. Either may use the GPUs that are not held.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType

from gpuwait.core.estimate import DEFAULT_MARGIN
from gpuwait.core.overuse import overuse
from gpuwait.core.record import Record
from gpuwait.core.sizes import MemoryRequest, format_duration, format_size
from gpuwait.core.snapshot import COMPUTE_PROHIBITED, GpuSnapshot
from gpuwait.core.text import columns, cut

PICK_STRATEGIES = (
    "best-fit",
    "most-free",
    "round-robin",
    "least-loaded",
    "weighted",
    "adaptive-throughput",
)

#: An exclusive job takes a GPU only where at most this fraction is used by non-gpuwait processes
#: (a desktop or a driver reservation), so "a whole GPU" still means one that is free in practice.
EXCLUSIVE_MAX_EXTERNAL = 0.05

_NEVER = math.inf

#: What a waiter asking for whole GPUs waits for, as its wait line says it.
WHOLE_GPU = "a whole GPU"


class Requirements(Record, frozen=True):
    """What a GPU must be for a job, beyond room: `--min-total-vram`, `--gpu-name` and co."""

    min_total_bytes: int | None = None
    #: Case-insensitive glob (`*A100*`); without wildcards, a substring of the name.
    name_pattern: str | None = None
    min_compute_capability: tuple[int, int] | None = None
    #: Admit only where recent utilization (a mean of several readings) is below this percent.
    max_util_pct: float | None = None

    def mismatch(self, gpu: GpuSnapshot) -> str | None:
        """Why `gpu` can never serve this job, or None. Utilization is not judged here."""
        if self.min_total_bytes is not None and gpu.total_bytes < self.min_total_bytes:
            return f"GPU{gpu.index} has {format_size(gpu.total_bytes)} in all"
        if self.name_pattern is not None and not name_matches(self.name_pattern, gpu.name):
            return f"GPU{gpu.index} is a {gpu.name}"
        if self.min_compute_capability is not None:
            if gpu.compute_capability is None:
                return f"GPU{gpu.index} does not report its compute capability"
            if gpu.compute_capability < self.min_compute_capability:
                major, minor = gpu.compute_capability
                return f"GPU{gpu.index} has compute capability {major}.{minor}"
        return None

    def describe(self) -> str:
        parts = []
        if self.min_total_bytes is not None:
            parts.append(f"at least {format_size(self.min_total_bytes)} in all")
        if self.name_pattern is not None:
            parts.append(f"a name matching {self.name_pattern!r}")
        if self.min_compute_capability is not None:
            major, minor = self.min_compute_capability
            parts.append(f"compute capability {major}.{minor} or more")
        if self.max_util_pct is not None:
            parts.append(f"utilization under {self.max_util_pct:g}%")
        return ", ".join(parts)


def name_matches(pattern: str, name: str) -> bool:
    """`--gpu-name`: a glob when it has wildcards, else a substring; case does not matter."""
    pattern, name = pattern.lower(), name.lower()
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern in name


def reserved_on(reserved_bytes: int, reserved_by_gpu: Mapping[str, int], uuid: str) -> int:
    """Bytes a job reserves on the GPU `uuid`: its per-card figure where it has one that is
    less, else `reserved_bytes` (its largest card's). The one rule for the plan, the ledger's
    jobs and the run record."""
    return min(reserved_bytes, reserved_by_gpu.get(uuid, reserved_bytes))


class Claim(Record, frozen=True):
    """A ledger entry, as the policy sees it."""

    job_id: str
    running: bool
    priority: int
    #: Submission sequence number; earlier submissions have lower numbers.
    order: int
    #: Per-GPU request; None means exclusive use of whole GPUs.
    request: MemoryRequest | None
    gpus_wanted: int = 1
    #: UUIDs this job may use; None means any GPU.
    candidates: frozenset[str] | None = None
    pick: str = "best-fit"
    gpu_uuids: tuple[str, ...] = ()
    #: Bytes reserved on each GPU in `gpu_uuids` (running jobs only): on the largest of them
    #: where `reserved_by_gpu` says otherwise for some.
    reserved_bytes: int = 0
    #: Bytes reserved on particular GPUs (UUID -> bytes) where less than `reserved_bytes`: a
    #: gang on cards of different sizes needs a share of each card (`--vram 50%`), or each card
    #: whole, and reserves that on each.
    reserved_by_gpu: Mapping[str, int] = MappingProxyType({})
    #: Bytes the job's process tree was last seen using, per GPU UUID.
    observed: Mapping[str, int] = MappingProxyType({})
    #: Bytes the job's process tree was seen using past its reservation in this run, at the
    #: most, per GPU UUID: it holds that much from then on.
    grown: Mapping[str, int] = MappingProxyType({})
    #: Per GPU UUID, the memory no process's figure accounted for there when it was admitted
    #: (`unlisted_bytes`), before its command started: never its own. Empty where unknown.
    unlisted_at_start: Mapping[str, int] = MappingProxyType({})
    #: The job's processes: they are gpuwait's load, not foreign processes.
    pids: frozenset[int] = frozenset()
    requirements: Requirements = Requirements()
    #: Why the job may not start yet whatever the room (an unfinished dependency), or None.
    blocked: str | None = None
    #: Expected seconds until it ends: a waiter's whole run, a running job's remainder.
    #: None: unknown (no history).
    expected_seconds: float | None = None
    #: Expected run time on particular GPUs (UUID -> seconds), for adaptive-throughput.
    expected_by_gpu: Mapping[str, float] = MappingProxyType({})
    #: Seconds a running job has run so far (its earlier runs' work included, where it
    #: stepped aside or was frozen).
    ran: float = 0.0
    #: GPUs this waiter held as the queue's head at the last plan; holds stick to their GPUs.
    held: tuple[str, ...] = ()
    #: Per-GPU weights (UUID -> weight, default 1) for the weighted strategy.
    weights: Mapping[str, float] = MappingProxyType({})
    #: The user the job belongs to (per-user limits).
    uid: int = -1
    #: The user's fair-share usage (decayed VRAM-time); lower goes first within a priority.
    usage: float = 0.0
    #: GPUs taken first where the claim fits (`--prefer`); the others only where none of
    #: them fits. Empty: no preference.
    prefer: frozenset[str] = frozenset()
    #: Seconds this waiter has waited since it was submitted (lookahead order only).
    waited: float = 0.0
    #: Its wait budget: once `waited` reaches it, the lookahead order puts it first with the
    #: urgent jobs (no starvation). None: not set yet (see `lookahead.with_wait_budgets`).
    due: float | None = None
    #: Its owner's safety factor (running jobs): a GPU it runs on is filled no further than
    #: that, by anyone. None: the planner's own alone.
    safety: float | None = None
    #: Its owner's own safety where a plan believes `safety` at no less (another user's, below
    #: the site's): it starts no fuller than this all the same. None: `safety` is its own.
    own_safety: float | None = None

    @property
    def exclusive(self) -> bool:
        return self.request is None

    def reserved_on(self, uuid: str) -> int:
        """Bytes this running claim reserves on the GPU `uuid`."""
        return reserved_on(self.reserved_bytes, self.reserved_by_gpu, uuid)

    def holds_on(self, uuid: str) -> int:
        """What it counts for on the GPU `uuid`: its reservation there, or what it uses there
        or used there at the most past it, where that is more."""
        return max(self.reserved_on(uuid), self.observed.get(uuid, 0), self.grown.get(uuid, 0))

    def limit_on(self, uuid: str) -> int:
        """What this running claim counts for against its user's VRAM limit on the GPU `uuid`
        (`limit_count`)."""
        return limit_count(self.reserved_on(uuid), self.holds_on(uuid))

    def sort_key(self) -> tuple[int, float, int]:
        """Queue order: higher priority first, then the user with less usage, then earlier
        submission (so one user's own jobs always keep their order)."""
        return (-self.priority, self.usage, self.order)


def limit_count(reserved: int, holds: int) -> int:
    """What a running job that reserves `reserved` bytes on a GPU and holds `holds` there (its
    `holds_on`: its reservation, or what it uses or grew to past it) counts for against its
    user's VRAM limit: what it holds, so that a job that reserves 2 GiB and uses 20 does not
    leave its user room for 18 more; but a job a little over its reservation, within the
    margin that makes no overuse (core.overuse: a CUDA context, a caching allocator), counts
    at its reservation, so that a limit set tightly is not missed by a few hundred MiB. The
    margin is the default one, whatever the job's owner set: every gpuwait counts alike."""
    return reserved if overuse(reserved, holds, 0, DEFAULT_MARGIN) is None else holds


class UserLimits(Record, frozen=True):
    """What one user may hold at once, over all GPUs (None: no limit)."""

    max_gpus: int | None = None
    max_vram: int | None = None

    def refusal(self, held_gpus: int, held_vram: int, gpus: int, vram: int) -> str | None:
        """Why a job taking `gpus` GPUs and `vram` bytes in all would break a limit; or None."""
        if self.max_gpus is not None and held_gpus + gpus > self.max_gpus:
            return f"your per-user limit of {self.max_gpus} GPUs ({held_gpus} held)"
        if self.max_vram is not None and held_vram + vram > self.max_vram:
            return (
                f"your per-user limit of {format_size(self.max_vram)} "
                f"({format_size(held_vram)} held)"
            )
        return None


class Lookahead(Record, frozen=True):
    """How the lookahead order is found: the search's bounds, and the no-starvation rule."""

    #: Local-search steps (swaps and moves of one job) tried per decision, at most. Each
    #: decision starts from the best order of the one before, so the search goes on from one
    #: decision to the next.
    steps: int = 30
    #: Stop searching once this many milliseconds have gone (with a clock passed in).
    budget_ms: float = 25.0
    #: Seeds the search, so the same inputs give the same plan.
    seed: int = 0
    #: A waiter is planned with the urgent jobs once it has waited this many times what the
    #: in-order plan expects from its submission to its end (its wait there plus its run
    #: time)... Plans count keeping a waiter past it as worse than any other, so the budget
    #: shapes every plan, not only the rare waiter that reaches it: at 5 instead of 10 the
    #: benchmark's mixed queue ended about 1 % later and priority 1's p95 wait was 3 s
    #: longer, for a longest wait 1 s shorter (docs/benchmarks.md).
    max_wait_factor: float = 10.0
    #: ...or this many seconds, whichever is less (None: no absolute cap).
    max_wait: float | None = None


class FairShare(Record, frozen=True):
    """The fairness policy in force: usage half-life (None: off), per-user limits, and the
    queue's order (None: in order, `queue_order = fifo`; else lookahead, see core/lookahead)."""

    half_life: float | None = None
    limits: UserLimits | None = None
    order: Lookahead | None = None
    #: The wait budgets' settings of the site (its config file, else the defaults).
    site_order: Lookahead | None = None
    #: The site's order is strict (`queue_order = fifo` in its config file).
    site_in_order: bool = False
    #: The site's safety (its config file, else the default): another user's job keeps the
    #: GPUs it runs on filled no further than its own safety, but never less full than this.
    #: Believed down to any value, a job of 1 GiB with its owner's safety at 0.05 would keep
    #: a whole card from everyone else while it ran. None: no floor.
    site_safety: float | None = None
    #: The user set no safety of their own (on the command line, in the environment or their
    #: file): theirs is the site's, `site_safety`, and follows it as the site file changes.
    safety_from_site: bool = False
    #: Other members' waiting jobs left out of this waiter's plans: strict order, which every
    #: member's gpuwait plans alike, has started them for a while and they never started
    #: (`gpuwait.queue.wait.Disagreement`). Their room would otherwise go to nobody for good.
    passed_over: frozenset[str] = frozenset()

    def in_strict_order(self) -> FairShare:
        """The policy with the queue in strict order (`queue_order = fifo`), in a shared ledger
        too (`in_shared_ledger` keeps it so)."""
        return self._replace(order=None, site_in_order=True)

    def in_shared_ledger(self) -> FairShare:
        """The policy for a ledger shared with other users. Its queue is in the site's order:
        each member's gpuwait starts only that member's jobs, so two orders would each wait for
        the job the other starts first, and leave the room to nobody. A user's own settings may
        give their jobs longer wait budgets than the site's, never shorter ones (which would
        put their jobs first in every member's plan)."""
        if self.site_in_order:
            return self._replace(order=None)
        if self.site_order is None:
            return self
        own, site = self.order or self.site_order, self.site_order
        capped = None not in (own.max_wait, site.max_wait)
        order = own._replace(
            max_wait_factor=max(own.max_wait_factor, site.max_wait_factor),
            max_wait=max(own.max_wait or 0.0, site.max_wait or 0.0) if capped else None,
        )
        return self._replace(order=order)


class Conditions(Record, frozen=True):
    """Facts about the GPUs besides memory, read by the caller and passed in as data."""

    #: Mean of recent utilization readings per GPU UUID. None: the GPU does not report it (such
    #: a GPU passes a utilization cap); absent: not measured often enough yet (it does not pass).
    utilization: Mapping[str, float | None] = MappingProxyType({})
    #: Process names (/proc/PID/comm) that never count as load: desktops, display servers.
    ignore_processes: frozenset[str] = frozenset()


NO_CONDITIONS = Conditions()


class GpuRoom(Record, frozen=True):
    """What one GPU can still take, and why."""

    gpu: GpuSnapshot
    usable: int
    external: int
    committed: int
    running_jobs: int
    exclusive_held: bool
    #: Processes that are neither gpuwait jobs nor on the ignore list.
    foreign: int = 0
    #: Memory of processes on the ignore list (part of `external`).
    ignored_bytes: int = 0
    #: Processes on the ignore list: no load, but each holds a CUDA context all the same.
    ignored_count: int = 0

    @property
    def room(self) -> int:
        return self.usable - self.external - self.committed

    @property
    def load(self) -> int:
        """Processes that count as work on this GPU: gpuwait jobs and foreign processes."""
        return self.running_jobs + self.foreign


class WaitReason(Record, frozen=True):
    """Why a waiting job is not admitted now."""

    needed: str
    best_gpu_index: int | None
    best_room: int
    running: int
    ahead: int
    #: A dependency that has not finished; the job waits for it whatever the room.
    blocked: str | None = None
    #: What the queue's head does to this job (or, for the head, what it holds).
    note: str | None = None
    #: Set when the job fits but its user is at a per-user limit.
    limit: str | None = None
    #: What became of this waiter's request that running jobs step aside (cooperative pausing).
    pause: str | None = None
    #: The GPUs could not be read at the last try (the waiter retries): why.
    gpu_error: str | None = None
    #: The ledger could not be read or written at the last try, for want of file descriptors
    #: or memory (the waiter retries): why.
    ledger_error: str | None = None
    #: Where the size asked for came from, for a request made without --vram (the history).
    source: str | None = None
    #: For a gang: the place of `best_gpu_index` among the GPUs by room (2: the second best),
    #: the one that keeps it waiting; 1 for a job of one GPU.
    best_rank: int = 1
    #: When this reason lapses by itself, whatever else happens (on the boot clock): the end of
    #: a recovery's grace, which nobody signals. None: it lasts until something changes.
    until: float | None = None
    #: In a recovery's grace: the jobs (their ids) whose entries it waits for, lost with the
    #: damage. The waiter plans once every one of them is listed again.
    awaited: tuple[str, ...] = ()

    def describe(self, width: int | None = None, *, hooked: bool = False) -> str:
        """Why the job waits, in full; with `width`, the fullest wording that fits: what it waits
        for comes first, then where it stands and how many are ahead, then the rest (but for why
        no GPU is usable, which goes last). Still too long, it is cut short (with '…') rather
        than wrapped. `hooked`: a line a shell hook runs, which has no gpuwait option to give:
        it asks for less with GPUWAIT_DEFAULT_VRAM, not --vram."""
        variants = self._variants(hooked)
        if width is None:
            return variants[0]
        # In a terminal's columns: two for a Chinese character (in a path, say), none for a
        # combining accent.
        for text in variants:
            if columns(text) <= width:
                return text
        shortest = variants[-1]
        return cut(shortest, width - 1) + "…" if width > 0 else ""

    def _variants(self, hooked: bool = False) -> list[str]:
        """The wordings, fullest first, each dropping the least important part left."""
        full_counts = f" ({self.running} running, {self.ahead} ahead of you)"
        counts = f" ({self.running} running, {self.ahead} ahead)"
        ahead = f" ({self.ahead} ahead)"
        head = f"waiting for {self.needed}"
        sourced = f"{head} ({self.source})" if self.source else head
        for what, why in (
            ("GPU readings failing", self.gpu_error),
            ("ledger unavailable", self.ledger_error),
        ):
            if why is None:
                continue
            failing = f"{sourced}: {what}, retrying"
            detail = f"{failing} ({why})"
            return [
                detail + full_counts,
                detail + counts,
                failing + counts,
                failing,
                f"{head}: {what}",
                head,
            ]
        if self.limit is not None:
            limited = f"{head}: {self.limit}"
            return [f"{sourced}: {self.limit} ({self.running} running)", limited, head]
        if self.blocked is not None:
            return [self.blocked + full_counts, self.blocked + counts, self.blocked]
        if self.best_gpu_index is None:
            where = "no usable GPU right now"
        else:
            rank = "best" if self.best_rank == 1 else f"{_ordinal(self.best_rank)} best"
            where = f"{rank} GPU{self.best_gpu_index} has {format_size(max(0, self.best_room))}"
        notes = [text for text in (self.note, self.pause) if text]
        # A whole GPU asked for without --vram is default_vram's (no estimate asks for one): how
        # to ask for less is what to do next, kept once the room and the notes are dropped.
        defaulted = self.source is not None and WHOLE_GPU in self.needed
        ask = "GPUWAIT_DEFAULT_VRAM" if hooked else "--vram"
        if defaulted:
            notes.insert(0, f"{ask}{'=' if hooked else ' '}SIZE asks for less")
        variants = [f"{sourced}: {where}" + "".join(f"; {n}" for n in notes) + full_counts]
        # Drop the notes from the last (the pause, then the head's note), then where the size
        # came from, then the counts.
        for kept in range(len(notes), -1, -1):
            variants.append(
                f"{sourced}: {where}" + "".join(f"; {n}" for n in notes[:kept]) + counts
            )
        if self.best_gpu_index is None and self.note:
            # Why no GPU is usable (every card too busy, shut, gone) is what to change: kept in
            # place of "no usable GPU right now" before anything else goes, and cut short
            # (describe) rather than dropped where even that is too long.
            why = f"{head}: {self.note}"
            return [*variants[:-1], why + counts, why + ahead, why]
        if defaulted:
            told, short = f"{sourced}: {notes[0]}", f"{head} (default_vram)"
            # The variable names the setting: there "(default_vram)" goes before it does.
            tight = [f"{head}: {ask} asks for less"] if hooked else []
            return [
                *variants[:-1],
                told + counts,
                told + ahead,
                told,
                f"{short}: {ask} asks for less" + ahead,
                f"{short}: {ask} asks for less",
                *tight,
                f"{head if hooked else short}: give {ask}",
            ]
        said = f"{head}: {where}"
        variants += [said + counts, said + ahead, said, head + ahead, head]
        return variants


def _ordinal(n: int) -> str:
    """2nd, 3rd, 4th, 11th, 22nd."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class Hold(Record, frozen=True):
    """GPUs kept for the head of the queue until it fits there."""

    job_id: str
    gpu_uuids: tuple[str, ...]
    #: Expected seconds until the head fits there; None: unknown (a job there has no estimate).
    start_in: float | None
    #: Per held GPU, bytes still free at the head's expected start once it has taken its share
    #: (jobs with a run-time estimate placed there now may use them however long they run); 0
    #: when the start is unknown.
    spare: Mapping[str, int] = MappingProxyType({})

    def has_estimate(self, claim: Claim, uuid: str) -> bool:
        """Does `claim` have a run-time estimate on `uuid`? A job with no history is never
        backfilled ahead of a held head, not even into the room the head leaves spare."""
        return claim.expected_by_gpu.get(uuid, claim.expected_seconds) is not None

    def ends_in_time(self, claim: Claim, uuid: str) -> bool:
        """Is `claim` expected to end on `uuid` before the head could start there?"""
        expected = claim.expected_by_gpu.get(uuid, claim.expected_seconds)
        return self.start_in is not None and expected is not None and expected <= self.start_in


class Plan(Record, frozen=True):
    """Which waiting jobs may start now, on which GPUs (in PCI order), and why the rest wait."""

    admitted: Mapping[str, tuple[str, ...]]
    reserved: Mapping[str, int]
    waiting: Mapping[str, WaitReason]
    next_cursor: int
    hold: Hold | None = None
    #: Admitted jobs placed on held GPUs (backfill): job -> those GPUs.
    backfill: Mapping[str, tuple[str, ...]] = MappingProxyType({})
    #: The waiters' order the lookahead plan was laid out in (job ids), for the next plan to
    #: search on from; empty for the in-order policy.
    order: tuple[str, ...] = ()
    #: Seconds from now until each waiter is planned to start (None: not known), from the
    #: lookahead plan's layout, the one its wait lines come from; empty for the in-order
    #: policy (whose starts `estimate_starts` replays).
    starts: Mapping[str, float | None] = MappingProxyType({})
    #: Per admitted job, the GPUs where it reserves less than `reserved` (its largest card's
    #: need), and how much: on cards of different sizes a share of each, or each whole.
    reserved_by_gpu: Mapping[str, Mapping[str, int]] = MappingProxyType({})


def gpu_rooms(
    gpus: Sequence[GpuSnapshot],
    claims: Iterable[Claim],
    safety: float,
    ignore_processes: frozenset[str] = frozenset(),
) -> dict[str, GpuRoom]:
    """Room per GPU UUID, given the running claims."""
    claims = list(claims)
    running = [c for c in claims if c.running]
    ours = frozenset().union(*(c.pids for c in claims))
    rooms: dict[str, GpuRoom] = {}
    for gpu in gpus:
        on_gpu = [c for c in running if gpu.uuid in c.gpu_uuids]
        # A card that takes one process at a time is its running job's alone.
        alone = any(c.exclusive for c in on_gpu) or (gpu.one_process_only and bool(on_gpu))
        observed = sum(max(0, c.observed.get(gpu.uuid, 0)) for c in on_gpu)
        committed = sum(c.holds_on(gpu.uuid) for c in on_gpu)
        # A running job's process on a GPU it was not given (CUDA_VISIBLE_DEVICES set again in
        # it) is no job's there: a card that takes one process at a time is that process's.
        here = frozenset().union(*(c.pids for c in on_gpu))
        astray = frozenset().union(*(c.pids for c in running)) - here
        others = [p for p in gpu.processes if p.pid not in ours or p.pid in astray]
        ignored = [p for p in others if p.name is not None and p.name in ignore_processes]
        # The most careful of the users whose jobs run there decides how full it gets: a user
        # with a laxer safety of their own fills it no further than theirs.
        strictest = min([safety, *(c.safety for c in on_gpu if c.safety is not None)])
        rooms[gpu.uuid] = GpuRoom(
            gpu=gpu,
            usable=int(gpu.total_bytes * strictest),
            external=max(0, gpu.used_bytes - observed - _unfigured_own(gpu, on_gpu)),
            committed=committed,
            running_jobs=len(on_gpu),
            exclusive_held=alone,
            foreign=len(others) - len(ignored),
            ignored_bytes=sum(p.used_bytes or 0 for p in ignored),
            ignored_count=len(ignored),
        )
    return rooms


def unlisted_bytes(gpu: GpuSnapshot) -> int:
    """The card's used memory that no process's figure accounts for: processes listed with no
    figure (usedGpuMemory N/A), those the driver does not list (graphics, WSL's Windows
    programs, other containers'), and the driver's own."""
    return max(0, gpu.used_bytes - sum(p.used_bytes or 0 for p in gpu.processes))


def unlisted_of_strangers(gpu: GpuSnapshot, claims: Iterable[Claim]) -> int:
    """`unlisted_bytes` of `gpu` but for what the running jobs of `claims` listed there with
    no figure hold of it (`_unfigured_own`): what a job admitted now finds there that is
    never its own, nor any other job's."""
    on_gpu = [c for c in claims if c.running and gpu.uuid in c.gpu_uuids]
    return max(0, unlisted_bytes(gpu) - _unfigured_own(gpu, on_gpu))


def _unfigured_own(gpu: GpuSnapshot, on_gpu: Sequence[Claim]) -> int:
    """Memory of the running jobs `on_gpu` that the driver lists there with no figure
    (usedGpuMemory N/A, as in many containers): what no listed figure accounts for beyond
    the most that none did when any of them was admitted, up to what those jobs reserved
    there beyond what they were seen using. Their reservations already count it; as external
    memory too, a job would count twice and keep the rest of the card from others as long as
    it ran. What was already there at their admission is someone else's (a program the driver
    lists no process for), and stays taken while they ramp up: what came between the first
    admission and a later one too. Only where every process listed
    without a figure is such a job's, each admitted knowing that figure: else whose the
    memory is cannot be told, and it all counts as taken."""
    unfigured = {p.pid for p in gpu.processes if p.used_bytes is None}
    if not unfigured:
        return 0
    owners = [c for c in on_gpu if unfigured & c.pids]
    if unfigured - frozenset().union(*(c.pids for c in owners)):
        return 0
    if any(gpu.uuid not in c.unlisted_at_start for c in owners):
        return 0
    headroom = sum(
        max(0, c.reserved_on(gpu.uuid) - max(0, c.observed.get(gpu.uuid, 0))) for c in owners
    )
    before = max(c.unlisted_at_start[gpu.uuid] for c in owners)
    return max(0, min(headroom, unlisted_bytes(gpu) - before))


def room_for(claim: Claim, room: GpuRoom) -> GpuRoom:
    """`room` as `claim` may fill it: no further than its own safety either, where that is
    stricter than the plan's. Whoever plans, a job is started into no more than it allows
    itself, so every member's plan of a shared ledger starts it where its own plan would."""
    own = claim.safety if claim.own_safety is None else claim.own_safety
    if own is None:
        return room
    usable = int(room.gpu.total_bytes * own)
    return room if usable >= room.usable else room._replace(usable=usable)


def prohibited(gpu: GpuSnapshot) -> bool:
    """The card's compute mode is PROHIBITED: no CUDA process may use it, whatever its room."""
    return gpu.compute_mode == COMPUTE_PROHIBITED


#: How a reason ends that names cards in prohibited compute mode (see `_prohibited_note`).
PROHIBITED_NOTE = " compute mode is prohibited"


def _prohibited_note(gpus: Iterable[GpuSnapshot]) -> str:
    """`GPU0's, GPU2's compute mode is prohibited`."""
    return ", ".join(f"GPU{g.index}'s" for g in gpus) + PROHIBITED_NOTE


def static_ok(claim: Claim, gpu: GpuSnapshot) -> bool:
    if claim.candidates is not None and gpu.uuid not in claim.candidates:
        return False
    return not prohibited(gpu) and claim.requirements.mismatch(gpu) is None


def util_ok(claim: Claim, uuid: str, conditions: Conditions) -> bool:
    cap = claim.requirements.max_util_pct
    if cap is None:
        return True
    if uuid not in conditions.utilization:
        return False
    recent = conditions.utilization[uuid]
    return recent is None or recent < cap


def idle_enough(room: GpuRoom) -> bool:
    """No process outside gpuwait (the ignore list aside) uses the GPU to speak of. The
    driver's own memory is no process's: on a small card it alone can pass the share."""
    outside = room.external - room.ignored_bytes - room.gpu.driver_bytes
    return outside <= room.gpu.total_bytes * EXCLUSIVE_MAX_EXTERNAL


def held_outside(room: GpuRoom) -> bool:
    """A card that takes one process at a time (`GpuSnapshot.one_process_only`) is held by a
    process that is no gpuwait job's, the ignore list's included: no job can start there. Where
    the driver lists no process (none there, or it cannot list them: a vGPU, a container),
    memory used outside gpuwait tells; a list that failed this time tells nothing, and the
    card counts as held until a reading lists who is there."""
    if not room.gpu.one_process_only:
        return False
    if room.foreign or room.ignored_count:
        return True
    if room.gpu.processes_failed:
        return True  # who is there could not be read this time: not taken for nobody
    if room.gpu.per_process and room.gpu.processes:
        return False  # the driver lists who is there: gpuwait's jobs alone
    return not idle_enough(room)


def unread_holder(room: GpuRoom) -> bool:
    """`held_outside` only because the card's process list failed this time: no process
    outside gpuwait is known to be there."""
    return (
        held_outside(room)
        and room.gpu.processes_failed
        and not (room.foreign or room.ignored_count or room.exclusive_held)
    )


def closed(room: GpuRoom) -> bool:
    """No job may start on this card now, whatever memory is free: a job has it to itself
    (a whole GPU, or any job on a card that takes one process at a time), a process outside
    gpuwait holds a card that takes one process at a time, or the card runs no CUDA work."""
    return room.exclusive_held or held_outside(room) or prohibited(room.gpu)


def need_on(claim: Claim, room: GpuRoom, conditions: Conditions = NO_CONDITIONS) -> int | None:
    """Bytes `claim` needs on this GPU, or None if it cannot go there now at all."""
    if not static_ok(claim, room.gpu) or not util_ok(claim, room.gpu.uuid, conditions):
        return None
    if closed(room):
        return None
    if claim.request is None:
        if room.running_jobs or not idle_enough(room):
            return None
        return max(1, room.room)
    return claim.request.on(room.gpu.total_bytes)


def admission_fits(
    claim: Claim,
    gpu_uuids: Sequence[str],
    reserved_bytes: int,
    others: Iterable[Claim],
    gpus: Sequence[GpuSnapshot],
    safety: float,
    ignore_processes: frozenset[str] = frozenset(),
) -> bool:
    """Whether an admission of `claim` onto `gpu_uuids` that this process did not plan (found
    in a shared ledger, which any member can write) is one the GPUs allow now.

    `claim` is the job as it asked (not as the ledger says), `others` every other entry. The
    room is what a plan would see without this job, so an admission another waiter's plan made
    passes, while one written into the file onto a GPU without room does not.
    """
    if len(set(gpu_uuids)) != claim.gpus_wanted or len(gpu_uuids) != claim.gpus_wanted:
        return False
    # Utilization caps are judged over a window of readings, which the planner had.
    claim = claim._replace(requirements=claim.requirements._replace(max_util_pct=None))
    rooms = gpu_rooms(gpus, others, safety, ignore_processes)
    for uuid in gpu_uuids:
        room = rooms.get(uuid)
        if room is not None:
            room = room_for(claim, room)
        need = None if room is None else need_on(claim, room)
        if room is None or need is None or need > room.room:
            return False
        if claim.request is not None and reserved_bytes < need:
            return False
    return True


#: How `impossible_reason` begins where a per-user limit alone refuses the request.
OVER_LIMIT = "the request"
#: ...where no GPU is a candidate (`--devices`, CUDA_VISIBLE_DEVICES) or takes CUDA work.
NO_CANDIDATE = "no candidate GPU"
#: ...where no candidate GPU is what `--gpu-name` and co. ask for.
NO_MATCH = "no GPU has "
#: ...where fewer GPUs are there (or match) than a gang asks for, whatever their room.
TOO_FEW = " GPUs wanted but only "


def impossible_reason(
    claim: Claim, gpus: Sequence[GpuSnapshot], safety: float, limits: UserLimits | None = None
) -> str | None:
    """Why `claim` can never be admitted on these GPUs, even when they are idle; None if it can."""
    candidates = [g for g in gpus if claim.candidates is None or g.uuid in claim.candidates]
    if not candidates:
        return NO_CANDIDATE
    closed_ones = [g for g in candidates if prohibited(g)]
    candidates = [g for g in candidates if not prohibited(g)]
    if not candidates:
        return f"{NO_CANDIDATE} takes CUDA work: {_prohibited_note(closed_ones)}"
    matching = [g for g in candidates if claim.requirements.mismatch(g) is None]
    # Cards shut for now that meet what it asks: named as what would help.
    closed_matching = [g for g in closed_ones if claim.requirements.mismatch(g) is None]
    why = f"; {_prohibited_note(closed_matching)}" if closed_matching else ""
    if not matching:
        first = claim.requirements.mismatch(candidates[0])
        return f"{NO_MATCH}{claim.requirements.describe()} ({first}){why}"
    if len(matching) < claim.gpus_wanted:
        which = "can be used" if len(matching) == len(candidates) else "match"
        return f"{claim.gpus_wanted}{TOO_FEW}{len(matching)} {which}{why}"
    if limits is not None:
        least = cheapest([limit_charge(claim, g, safety) for g in matching], claim.gpus_wanted)
        refusal = limits.refusal(0, 0, claim.gpus_wanted, least)
        if refusal is not None:
            asked = f"{claim.gpus_wanted} GPUs, " if claim.gpus_wanted > 1 else ""
            return (
                f"{OVER_LIMIT} ({asked}{format_size(least)} in all)"
                f" exceeds {refusal.replace('your ', '', 1)}"
            )
    if claim.request is None:
        return None
    request = claim.request

    def holds(g: GpuSnapshot) -> bool:
        # The room the plan ever gives on an idle card: what the driver keeps for itself is
        # never free, so a request past it would wait for ever.
        return request.on(g.total_bytes) <= whole_card_room(g, safety)

    fitting = [g for g in matching if holds(g)]
    if len(fitting) >= claim.gpus_wanted:
        return None
    # Cards shut for now that would hold it: the refusal names them, as what would help.
    shut = [g for g in closed_matching if holds(g)]
    why = f"; {_prohibited_note(shut)}" if shut else ""
    if fitting:
        # Some cards could hold it, only not as many as the gang wants.
        named = ", ".join(f"GPU{g.index} ({format_size(g.total_bytes)})" for g in fitting)
        only = f"only {len(fitting)} can" if len(fitting) > 1 else "only 1 can"
        return (
            f"{claim.gpus_wanted} GPUs wanted with {request.describe()} each, but {only}"
            f" ever hold that at safety {safety:g}: {named}{why}"
        )
    largest = max(matching, key=lambda g: (whole_card_room(g, safety), -g.index))
    # A share (`50% of a GPU`) is one of each GPU already.
    per_gpu = "" if request.fraction is not None else " per GPU"
    kept = largest.driver_bytes
    driver = f", the driver keeps {format_size(kept)} for itself" if kept else ""
    return (
        f"{request.describe()}{per_gpu} can never fit: the largest candidate, "
        f"GPU{largest.index} ({format_size(largest.total_bytes)}), offers at most "
        f"{format_size(whole_card_room(largest, safety))} at safety {safety:g}{driver}{why}"
    )


def fits_beside(
    claim: Claim, gpus: Sequence[GpuSnapshot], safety: float, staying: Sequence[Claim]
) -> bool:
    """Whether `claim` could be admitted once everything has ended but `staying`: running
    claims that end only after it (the job whose command started it, the jobs of its pipeline
    joined to it by pipes). Outside memory is left out, as it may yet be freed."""
    rooms = gpu_rooms(gpus, staying, safety)
    fitting = 0
    for gpu in gpus:
        room = rooms[gpu.uuid]
        if not static_ok(claim, gpu) or room.exclusive_held:
            continue
        if claim.request is None:
            fitting += room.running_jobs == 0
        else:
            fitting += claim.request.on(gpu.total_bytes) <= room.usable - room.committed
    return fitting >= claim.gpus_wanted


_Fit = tuple[GpuRoom, int]


def order_for_pick(fitting: list[_Fit], claim: Claim, cursor: int, gpu_count: int) -> list[_Fit]:
    """The fitting GPUs, most preferred first: its --prefer GPUs, then by its strategy."""

    def best_fit(rn: _Fit) -> tuple[int, int]:
        # The GPU left with the least room, so large holes stay open for large jobs.
        return (rn[0].room - rn[1], rn[0].gpu.index)

    key: Callable[[_Fit], tuple[float, ...]] = best_fit
    if claim.pick == "most-free":
        key = lambda rn: (-rn[0].room, rn[0].gpu.index)  # noqa: E731
    elif claim.pick == "round-robin":
        span = max(gpu_count, 1 + max(r.gpu.index for r, _ in fitting))
        key = lambda rn: ((rn[0].gpu.index - cursor - 1) % span, rn[0].gpu.index)  # noqa: E731
    elif claim.pick == "least-loaded":
        key = lambda rn: (rn[0].load, -(rn[0].room - rn[1]), rn[0].gpu.index)  # noqa: E731
    elif claim.pick == "weighted":
        key = lambda rn: (  # noqa: E731
            (rn[0].load + 1) / claim.weights.get(rn[0].gpu.uuid, 1.0),
            *best_fit(rn),
        )
    elif claim.pick == "adaptive-throughput" and any(
        r.gpu.uuid in claim.expected_by_gpu for r, _ in fitting
    ):
        key = lambda rn: (claim.expected_by_gpu.get(rn[0].gpu.uuid, _NEVER), *best_fit(rn))  # noqa: E731
    ordered = sorted(fitting, key=key)
    if claim.prefer:
        # Preferred GPUs first, each group in the strategy's order: a preferred GPU that fits
        # is taken, and the others only fill what the preferred ones cannot.
        ordered.sort(key=lambda rn: rn[0].gpu.uuid not in claim.prefer)
    return ordered


def _fit_time(claim: Claim, room: GpuRoom, on_gpu: Sequence[Claim]) -> float | None:
    """Seconds until `claim` would fit on this GPU if nothing else started there.

    Running jobs end at their expected times (inf when unknown). None: never, because memory
    outside gpuwait leaves too little even with every gpuwait job gone.
    """
    uuid = room.gpu.uuid
    ends = sorted(
        (
            _NEVER if c.expected_seconds is None else max(0.0, c.expected_seconds),
            c.holds_on(uuid),
            c.exclusive,
        )
        for c in on_gpu
    )
    if claim.request is None:
        if not idle_enough(room):
            return None
        return max((end for end, _, _ in ends), default=0.0)
    need = claim.request.on(room.gpu.total_bytes)
    if need > room.usable - room.external:
        return None
    if room.gpu.one_process_only:
        # One process at a time: once every job there has ended, and never while a process
        # outside gpuwait holds it (nobody knows when that one ends).
        return None if held_outside(room) else max((end for end, _, _ in ends), default=0.0)
    # Until every exclusive job there has ended, nobody else may start.
    after = max((end for end, _, exclusive in ends if exclusive), default=0.0)
    free = room.room
    if free >= need:
        return after
    for end, size, _ in ends:
        free += size
        if free >= need:
            return max(end, after)
    return _NEVER


def _hold_for(
    claim: Claim, rooms: Mapping[str, GpuRoom], running: Sequence[Claim], conditions: Conditions
) -> Hold | None:
    """The GPUs the head keeps: where it can start soonest; the held ones unless others are sooner."""
    times: dict[str, tuple[GpuRoom, float]] = {}
    for uuid, room in rooms.items():
        room = room_for(claim, room)
        if not static_ok(claim, room.gpu) or not util_ok(claim, uuid, conditions):
            continue
        when = _fit_time(claim, room, [c for c in running if uuid in c.gpu_uuids])
        if when is not None:
            times[uuid] = (room, when)
    wanted = claim.gpus_wanted
    if len(times) < wanted:
        return None
    ranked = sorted(times.values(), key=lambda rt: (rt[1], -rt[0].room, rt[0].gpu.index))
    chosen = [room for room, _ in ranked[:wanted]]
    start = max(when for _, when in ranked[:wanted])
    if len(claim.held) == wanted and all(u in times for u in claim.held):
        held_start = max(times[u][1] for u in claim.held)
        # A hold moves only to GPUs where the head is expected to start strictly sooner, so
        # the room it gathered is not handed away for nothing.
        if not start < held_start:
            chosen, start = [times[u][0] for u in claim.held], held_start
    chosen.sort(key=lambda r: r.gpu.index)
    spare = {}
    for room in chosen:
        uuid = room.gpu.uuid
        if claim.request is None or start == _NEVER or room.gpu.one_process_only:
            # An exclusive head needs the whole card, as does any head on a card that takes
            # one process at a time; an unknown start, all of them.
            spare[uuid] = 0
            continue
        # Room at the start: what jobs expected to end by then free (unknown ends never do).
        freed = sum(
            c.holds_on(uuid)
            for c in running
            if uuid in c.gpu_uuids
            and c.expected_seconds is not None
            and max(0.0, c.expected_seconds) <= start
        )
        need = claim.request.on(room.gpu.total_bytes)
        spare[uuid] = max(0, room.room + freed - need)
    return Hold(
        job_id=claim.job_id,
        gpu_uuids=tuple(r.gpu.uuid for r in chosen),
        start_in=None if start == _NEVER else start,
        spare=spare,
    )


def plan(
    gpus: Sequence[GpuSnapshot],
    claims: Sequence[Claim],
    safety: float,
    cursor: int = -1,
    conditions: Conditions = NO_CONDITIONS,
    limits: UserLimits | None = None,
) -> Plan:
    """Admit waiting claims in queue order while they fit; the first that does not fit holds.

    Earlier waiters are placed first and their room is taken before later ones are looked at, so a
    later waiter never jumps an earlier one that fits the same GPU. Behind the head, a waiter may
    start on GPUs the head does not hold, or on a held one if it is expected to end before the
    head could start there. A waiter whose user is at a per-user limit does not block those
    behind it.
    """
    claims = within_vram_limit(claims, gpus, safety, limits)
    held_by_user = user_holdings(claims) if limits is not None else {}
    rooms = gpu_rooms(gpus, claims, safety, conditions.ignore_processes)
    # What their user holds keeps these from starting now: none of them is the head, which
    # would hold GPUs for a job that cannot take them.
    over = over_limit(claims, rooms, conditions, limits, held_by_user)
    running = [c for c in claims if c.running]
    running_total = len(running)
    waiting = sorted((c for c in claims if not c.running), key=Claim.sort_key)
    admitted: dict[str, tuple[str, ...]] = {}
    reserved: dict[str, int] = {}
    reasons: dict[str, WaitReason] = {}
    backfill: dict[str, tuple[str, ...]] = {}
    reserved_by_gpu: dict[str, dict[str, int]] = {}
    hold: Hold | None = None
    spare: dict[str, int] = {}
    for position, claim in enumerate(waiting):
        if claim.blocked is not None:
            reasons[claim.job_id] = wait_reason(claim, rooms, running_total, position, conditions)
            continue
        if claim.job_id in over:
            reason = wait_reason(claim, rooms, running_total, position, conditions)
            reasons[claim.job_id] = reason._replace(limit=over[claim.job_id])
            continue
        fitting: list[_Fit] = []
        for room in (room_for(claim, r) for r in rooms.values()):
            need = need_on(claim, room, conditions)
            if need is not None and need <= room.room:
                fitting.append((room, need))
        allowed = fitting
        if hold is not None:
            allowed = [
                (r, n)
                for r, n in fitting
                if r.gpu.uuid not in hold.gpu_uuids
                or (n <= spare[r.gpu.uuid] and hold.has_estimate(claim, r.gpu.uuid))
                or hold.ends_in_time(claim, r.gpu.uuid)
            ]
        if len(allowed) >= claim.gpus_wanted and allowed:
            chosen = order_for_pick(allowed, claim, cursor, len(gpus))[: claim.gpus_wanted]
            chosen.sort(key=lambda rn: rn[0].gpu.index)
            refusal = take(claim, chosen, rooms, limits, held_by_user)
            if refusal is not None:
                reason = wait_reason(claim, rooms, running_total, position, conditions)
                reasons[claim.job_id] = reason._replace(limit=refusal)
                continue
            uuids = tuple(r.gpu.uuid for r, _ in chosen)
            admitted[claim.job_id] = uuids
            reserved[claim.job_id] = max(need for _, need in chosen)
            less = less_on(chosen)
            if less:
                reserved_by_gpu[claim.job_id] = less
            on_held = tuple(u for u in uuids if hold is not None and u in hold.gpu_uuids)
            if hold is not None and on_held:
                backfill[claim.job_id] = on_held
                for room, need in chosen:
                    # What may outlive the head's start comes out of its spare.
                    if room.gpu.uuid in on_held and not hold.ends_in_time(claim, room.gpu.uuid):
                        spare[room.gpu.uuid] = max(0, spare[room.gpu.uuid] - need)
            # Its end frees room the head may be waiting for.
            running.append(
                claim._replace(
                    running=True,
                    gpu_uuids=uuids,
                    reserved_bytes=reserved[claim.job_id],
                    reserved_by_gpu=less,
                )
            )
            if claim.pick == "round-robin":
                cursor = chosen[-1][0].gpu.index
            continue
        note = None
        if hold is None:
            hold = _hold_for(claim, rooms, running, conditions)
            if hold is not None:
                spare = dict(hold.spare)
                note = _held_note(hold, rooms)
        elif len(fitting) >= claim.gpus_wanted:
            note = _backfill_note(claim, hold, rooms)
        reasons[claim.job_id] = wait_reason(claim, rooms, running_total, position, conditions, note)
    return Plan(
        admitted=admitted,
        reserved=reserved,
        waiting=reasons,
        next_cursor=cursor,
        hold=hold,
        backfill=backfill,
        reserved_by_gpu=reserved_by_gpu,
    )


def take(
    claim: Claim,
    chosen: Sequence[_Fit],
    rooms: dict[str, GpuRoom],
    limits: UserLimits | None,
    held_by_user: dict[int, tuple[int, int]],
) -> str | None:
    """Admit `claim` onto `chosen` (room, need) in `rooms` and its user's holdings; or, where
    that would break its user's limits, change nothing and say which."""
    if limits is not None:
        gpus_held, vram_held = held_by_user.get(claim.uid, (0, 0))
        vram = sum(need for _, need in chosen)
        refusal = limits.refusal(gpus_held, vram_held, len(chosen), vram)
        if refusal is not None:
            return refusal
        held_by_user[claim.uid] = (gpus_held + len(chosen), vram_held + vram)
    for chosen_room, need in chosen:
        # As the plan has it (`chosen` may see it as the claim itself may fill it: room_for).
        room = rooms[chosen_room.gpu.uuid]
        rooms[room.gpu.uuid] = room._replace(
            # Running there from now on, it keeps the card no fuller than its own safety, as
            # the next plan's rooms will (gpu_rooms): for the rest of this plan too.
            usable=room.usable
            if claim.safety is None
            else min(room.usable, int(room.gpu.total_bytes * claim.safety)),
            committed=room.committed + need,
            running_jobs=room.running_jobs + 1,
            exclusive_held=room.exclusive_held or claim.exclusive or room.gpu.one_process_only,
        )
    return None


def less_on(chosen: Sequence[_Fit]) -> dict[str, int]:
    """Of the GPUs an admission takes (room, need), those where it needs less than on the one
    it needs most, and how much: they are reserved at that, not at the most."""
    most = max(need for _, need in chosen)
    return {room.gpu.uuid: need for room, need in chosen if need < most}


def whole_card_room(gpu: GpuSnapshot, safety: float) -> int:
    """The most one job ever has on `gpu`: its `safety` share of the card, less what the
    driver keeps for itself. The one rule for a whole GPU's charge and a thaw's request."""
    return int(gpu.total_bytes * safety) - gpu.driver_bytes


def limit_charge(claim: Claim, gpu: GpuSnapshot, safety: float) -> int:
    """The most `claim` counts against its user's VRAM limit on `gpu`, per GPU: its request,
    or for a whole GPU all the room the card has when nothing else uses it."""
    if claim.request is not None:
        return claim.request.on(gpu.total_bytes)
    return max(1, whole_card_room(gpu, safety))


def cheapest(charges: Sequence[int], count: int) -> int:
    """The least that `count` of `charges` (one per card) come to together."""
    return sum(sorted(charges)[:count])


def within_vram_limit(
    claims: Sequence[Claim], gpus: Sequence[GpuSnapshot], safety: float, limits: UserLimits | None
) -> list[Claim]:
    """`claims` with each waiter kept off the GPUs where it alone would go over its user's VRAM
    limit (a whole GPU of 80 GiB where the limit is 40), so that a plan never places it on a
    card it may not take while one it may take is there. A waiter no GPU keeps within the limit
    is left as it is: the limit refuses it wherever it goes, and says so."""
    if limits is None or limits.max_vram is None:
        return list(claims)
    kept: list[Claim] = []
    for claim in claims:
        if not claim.running:
            charges = {
                g.uuid: limit_charge(claim, g, safety)
                for g in gpus
                if claim.candidates is None or g.uuid in claim.candidates
            }
            # A card is within the limit where it and the cheapest others a gang needs are.
            within = frozenset(
                uuid
                for uuid, charge in charges.items()
                if charge
                + cheapest([c for u, c in charges.items() if u != uuid], claim.gpus_wanted - 1)
                <= limits.max_vram
            )
            if within and within != claim.candidates:
                claim = claim._replace(candidates=within)
        kept.append(claim)
    return kept


def over_limit(
    claims: Sequence[Claim],
    rooms: Mapping[str, GpuRoom],
    conditions: Conditions,
    limits: UserLimits | None,
    held_by_user: Mapping[int, tuple[int, int]],
) -> dict[str, str]:
    """The waiters that what their user's running jobs hold keeps from starting now, whatever
    else starts (job id -> the limit's words): even their smallest need goes over."""
    if limits is None:
        return {}
    found: dict[str, str] = {}
    for claim in claims:
        if claim.running or claim.blocked is not None:
            continue
        needs = [
            need
            for room in rooms.values()
            if (need := need_on(claim, room, conditions)) is not None
        ]
        if not needs:
            continue
        gpus_held, vram_held = held_by_user.get(claim.uid, (0, 0))
        wanted = claim.gpus_wanted
        refusal = limits.refusal(gpus_held, vram_held, wanted, cheapest(needs, wanted))
        if refusal is not None:
            found[claim.job_id] = refusal
    return found


def user_holdings(claims: Iterable[Claim]) -> dict[int, tuple[int, int]]:
    """(GPUs, bytes over all of them) that each user's running jobs hold, as their limits count
    them (`limit_count`)."""
    held: dict[int, tuple[int, int]] = {}
    for c in claims:
        if c.running:
            gpus, vram = held.get(c.uid, (0, 0))
            held[c.uid] = (gpus + len(c.gpu_uuids), vram + sum(map(c.limit_on, c.gpu_uuids)))
    return held


def _gpu_list(hold: Hold, rooms: Mapping[str, GpuRoom]) -> str:
    return ",".join(f"GPU{rooms[u].gpu.index}" for u in hold.gpu_uuids)


def describe_need(request: MemoryRequest | None, gpus_wanted: int) -> str:
    """What a waiter asks for, as its wait line says it: `8.0 GiB`, `a whole GPU`,
    `2 GPUs with 8.0 GiB each`."""
    needed = WHOLE_GPU if request is None else request.describe()
    return f"{gpus_wanted} GPUs with {needed} each" if gpus_wanted > 1 else needed


def _due(start_in: float) -> str:
    """`in 3m05s`; a head that would fit already but for jobs still running past their expected
    end (its start "now" by the estimates) is `overdue`, not `in 0ms`."""
    return "overdue" if start_in <= 0 else f"in {format_duration(start_in)}"


def _held_note(hold: Hold, rooms: Mapping[str, GpuRoom]) -> str:
    when = "" if hold.start_in is None else f", expected {_due(hold.start_in)}"
    return f"first in line, {_gpu_list(hold, rooms)} held for it{when}"


def _backfill_note(claim: Claim, hold: Hold, rooms: Mapping[str, GpuRoom]) -> str:
    held = f"{_gpu_list(hold, rooms)} held for job {hold.job_id}"
    if hold.start_in is None:
        return f"{held}, whose start cannot be estimated"
    when = (
        "no run-time estimate"
        if claim.expected_seconds is None
        else "would not end before it can start"
    )
    due = "whose start is overdue" if hold.start_in <= 0 else f"due {_due(hold.start_in)}"
    return f"{held}, {due} ({when})"


def wait_reason(
    claim: Claim,
    rooms: Mapping[str, GpuRoom],
    running: int,
    ahead: int,
    conditions: Conditions,
    note: str | None = None,
) -> WaitReason:
    candidates = [room_for(claim, r) for r in rooms.values() if static_ok(claim, r.gpu)]
    usable = [r for r in candidates if util_ok(claim, r.gpu.uuid, conditions)]
    wanted = claim.gpus_wanted
    if len(candidates) >= wanted > len(usable) and note is None:
        cap = f"{claim.requirements.max_util_pct:g}%"
        if any(r.gpu.uuid not in conditions.utilization for r in candidates if r not in usable):
            # A GPU with too few readings yet is not known to be busy: say what is going on.
            note = f"measuring utilization for the {cap} cap (a few readings)"
        elif not usable:
            note = f"every candidate is busier than {cap} utilization"
        else:
            note = (
                f"only {len(usable)} of {len(candidates)} candidates under {cap} utilization,"
                f" {wanted} wanted"
            )
    shut = [
        r.gpu
        for r in rooms.values()
        if prohibited(r.gpu) and (claim.candidates is None or r.gpu.uuid in claim.candidates)
    ]
    if shut and len(candidates) < wanted and note is None:
        # Switched to PROHIBITED while it waited: no room helps until that changes back.
        note = _prohibited_note(shut)
    if 0 < len(candidates) < wanted and note is None:
        # A GPU it could use is gone from the readings (lost, not answering): no room helps.
        verb = "answers" if len(candidates) == 1 else "answer"
        note = f"only {len(candidates)} of the GPUs it may use {verb} now, {wanted} wanted"
    # A card that takes one process at a time and has one offers no room, whatever is free.
    taken = [r for r in usable if r.gpu.one_process_only and closed(r)]
    usable = [r._replace(usable=r.external + r.committed) if r in taken else r for r in usable]
    # A gang waits for its GPUs all at once: the one that keeps it waiting is the `wanted`-th
    # by room, not the roomiest.
    by_room = sorted(usable, key=lambda r: (-r.room, r.gpu.index))
    best = by_room[wanted - 1] if len(by_room) >= wanted else (by_room[-1] if by_room else None)
    rank = by_room.index(best) + 1 if best is not None else 1
    if taken and claim.request is not None:
        # Held only as the driver's list of its processes failed: nobody may be there, and
        # "one is there" would send the user looking for a process that is not.
        unread = [r for r in taken if unread_holder(r)]
        for group, there in (
            ([r for r in taken if r not in unread], "one is there"),
            (unread, "the driver's list of its processes fails (read again at each reading)"),
        ):
            if not group:
                continue
            names = ",".join(f"GPU{r.gpu.index}" for r in group)
            busy = f"{names} {'runs' if len(group) == 1 else 'run'} one process at a time"
            busy += f" (compute mode exclusive-process), and {there}"
            note = busy if note is None else f"{busy}; {note}"
    if claim.request is None and best is not None:
        # Free memory alone does not tell why a whole GPU is refused: say what it takes.
        whole = (
            "a whole GPU needs no other gpuwait job on it and at most"
            f" {EXCLUSIVE_MAX_EXTERNAL:.0%} of its memory used outside gpuwait"
        )
        note = whole if note is None else f"{whole}; {note}"
    return WaitReason(
        needed=describe_need(claim.request, claim.gpus_wanted),
        best_gpu_index=best.gpu.index if best else None,
        best_room=best.room if best else 0,
        running=running,
        ahead=ahead,
        blocked=claim.blocked,
        note=note,
        best_rank=rank,
    )


def estimate_starts(
    gpus: Sequence[GpuSnapshot],
    claims: Sequence[Claim],
    safety: float,
    cursor: int = -1,
    conditions: Conditions = NO_CONDITIONS,
    max_steps: int = 10_000,
    limits: UserLimits | None = None,
) -> dict[str, float | None]:
    """Seconds from now until each waiter is expected to start, replaying the queue forward.

    Running jobs end at their expected times and each waiter runs for its expected time; the plan
    is made again at every end. None: not before some job with no estimate ends (or a
    dependency is met), so no time can be given.
    """
    rooms = gpu_rooms(gpus, claims, safety, conditions.ignore_processes)
    # From here on gpuwait jobs are described by their reservations and what they hold past
    # them (as grown), so that one ending takes all its memory with it, and its user's limit
    # counts it as now (limit_count); foreign memory stays as it is.
    ours = frozenset().union(*(c.pids for c in claims))
    bare = [
        g._replace(
            used_bytes=rooms[g.uuid].external,
            processes=tuple(p for p in g.processes if p.pid not in ours),
        )
        for g in gpus
    ]
    current: list[Claim] = []
    for c in claims:
        if c.running:
            sizes = {u: c.holds_on(u) for u in c.gpu_uuids}
            current.append(
                c._replace(
                    grown={u: n for u, n in sizes.items() if n > c.reserved_on(u)},
                    observed={},
                    pids=frozenset(),
                )
            )
        else:
            current.append(c._replace(pids=frozenset()))
    starts: dict[str, float | None] = {c.job_id: None for c in claims if not c.running}
    now = 0.0
    for _ in range(max_steps):
        decided = plan(bare, current, safety, cursor, conditions, limits)
        cursor = decided.next_cursor
        after: list[Claim] = []
        for c in current:
            if c.job_id in decided.admitted:
                starts[c.job_id] = now
                uuids = decided.admitted[c.job_id]
                expected = max(
                    (
                        c.expected_by_gpu.get(
                            u, _NEVER if c.expected_seconds is None else c.expected_seconds
                        )
                        for u in uuids
                    ),
                    default=c.expected_seconds,
                )
                c = c._replace(
                    running=True,
                    gpu_uuids=uuids,
                    reserved_bytes=decided.reserved[c.job_id],
                    reserved_by_gpu=decided.reserved_by_gpu.get(c.job_id, {}),
                    expected_seconds=None if expected == _NEVER else expected,
                )
            elif decided.hold is not None and c.job_id == decided.hold.job_id:
                c = c._replace(held=decided.hold.gpu_uuids)
            after.append(c)
        ends = [c.expected_seconds for c in after if c.running and c.expected_seconds is not None]
        if not any(not c.running for c in after) or not ends:
            break
        step = max(0.0, min(ends))
        now += step
        current = []
        for c in after:
            if c.running and c.expected_seconds is not None:
                left = c.expected_seconds - step
                if left <= 1e-9:
                    continue
                c = c._replace(expected_seconds=left)
            current.append(c)
    return starts
