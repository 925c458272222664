"""The ledger file's format, defined once: its entries (jobs), the per-user usage table, the book
(finished jobs, per-GPU counters, GPU health, batches), and the document that holds them.

Every part is read defensively: each entry is validated field by field and an invalid one is
dropped (the others stay); a damaged book or usage table is dropped whole and started afresh.
Nothing in a ledger may cost unbounded time or memory to read, because in a shared ledger
directory any member of the group can write it: hence the caps below.

Reading and writing the file (locking, the journal, checksums, recovery) is gpuwait.queue.ledger;
changing what an entry says is gpuwait.queue.lifecycle.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gpuwait.core.budget import HELD_BY
from gpuwait.core.pausing import DEFAULT_CHECKPOINT_SIGNAL, DEFAULT_GRACE_SECONDS
from gpuwait.core.policy import Requirements, reserved_on
from gpuwait.core.record import Record, field
from gpuwait.core.sizes import MemoryRequest
from gpuwait.core.text import MAX_TEXT as _MAX_TEXT
from gpuwait.core.text import MAX_TEXTS as _MAX_TEXTS
from gpuwait.core.text import whole_number
from gpuwait.linux import pidns as pid_namespaces
from gpuwait.linux import proc
from gpuwait.queue.bookkeeping import (
    FINISHED_KEPT,
    GPU_LOST,
    GPU_OK,
    OUTCOMES,
    THROUGHPUT_WINDOW,
    BatchCounts,
    Book,
    Finished,
    GpuCounters,
    GpuHealth,
)
from gpuwait.queue.cache import EncodedEntries, ValidatedEntries

#: The ledger's schema. Fields are only ever added within it (readers pass over those they do
#: not know, and write an entry's and the file's back as found: `newer_fields`); a new number
#: is for a change that older versions would misread: they refuse the file while a job of its
#: writer's user lives, and read other users' files as far as they can.
SCHEMA = 1
WAITING = "waiting"
RUNNING = "running"

#: Limits on what a ledger may hold.
MAX_ENTRIES = 8192
MAX_ENTRIES_PER_UID = 1024
MAX_USAGE_USERS = 4096


def requirements_of(stored: Mapping[str, Any]) -> Requirements:
    """A job's capability options (`--gpu-name` and co.) as its entry stores them, for the
    policy."""
    capability = stored.get("min_compute_capability")
    return Requirements(
        min_total_bytes=stored.get("min_total_bytes"),
        name_pattern=stored.get("name_pattern"),
        min_compute_capability=None if capability is None else (capability[0], capability[1]),
        max_util_pct=stored.get("max_util_pct"),
    )


class Job(Record):
    """One ledger entry: a gpuwait process, waiting or running, and what it asked for."""

    id: str
    pid: int
    start_time: int
    uid: int
    command: list[str]
    cwd: str
    #: {"bytes": n} or {"fraction": f}; {} means exclusive use of whole GPUs.
    request: dict[str, float | int]
    gpus: int = 1
    candidates: list[str] | None = None
    pick: str = "best-fit"
    priority: int = 3
    order: int = 0
    state: str = WAITING
    gpu_uuids: list[str] = field(default_factory=list)
    reserved_bytes: int = 0
    #: GPUs where it reserves less than `reserved_bytes` (UUID -> bytes): an adopted process
    #: of several GPUs reserves what it uses on each.
    reserved_by_gpu: dict[str, int] = field(default_factory=dict)
    observed: dict[str, int] = field(default_factory=dict)
    #: Per GPU UUID, the most its process tree was seen using there past its reservation in
    #: this run: room it has shown it takes, which it may take again after letting it go.
    grown: dict[str, int] = field(default_factory=dict)
    #: Per GPU UUID, the memory no process's figure accounted for there when it was admitted
    #: (`policy.unlisted_bytes`), before its command started: someone else's, whatever the
    #: driver lists later without a figure. Empty: admitted by an older version, or adopted.
    unlisted_at_start: dict[str, int] = field(default_factory=dict)
    #: The `started_at` of the run `unlisted_at_start` was written for. An older gpuwait that
    #: starts the job again writes both back as found: figures of an earlier run, whatever
    #: came onto the card since, are not taken for this one's.
    unlisted_started_at: float | None = None
    #: The command's process tree at the last sample; the policy reads their memory from NVML.
    pids: list[int] = field(default_factory=list)
    child_pid: int | None = None
    #: The command's start time (/proc clock ticks), so a reused pid is never taken for it.
    child_start_time: int | None = None
    #: When its gpuwait process was found gone while the command still ran: the entry keeps the
    #: command's room until the command ends too.
    orphaned_at: float | None = None
    submitted_at: float = 0.0
    started_at: float | None = None
    #: The same moments on the boot clock (gpuwait.linux.proc.boot_clock), which every process
    #: of this boot shares and nobody steps: the durations that decide something are measured
    #: there (`since`); the wall-clock stamps above are for people. None: written by an older
    #: version, or not yet; then the wall clock measures.
    submitted_boot: float | None = None
    started_boot: float | None = None
    #: How long the machine had been suspended since it booted when the job started (the boot
    #: clock less the monotonic one): what it has slept since is no run time of the job's.
    started_slept: float | None = None
    updated_at: float = 0.0
    #: `--name` and `--batch`.
    name: str | None = None
    batch: str | None = None
    #: Job ids that must have finished (`--after`), or finished successfully (`--after-ok`).
    after: list[str] = field(default_factory=list)
    after_ok: list[str] = field(default_factory=list)
    #: Capability requests: min_total_bytes, name_pattern, min_compute_capability ([8, 0]),
    #: max_util_pct. Absent keys ask for nothing.
    requirements: dict[str, Any] = field(default_factory=dict)
    #: Expected run time in seconds, from history; None: unknown. Per GPU UUID where known.
    expected_seconds: float | None = None
    expected_by_gpu: dict[str, float] = field(default_factory=dict)
    #: GPUs held for this job while it is the head of the queue.
    held_gpus: list[str] = field(default_factory=list)
    #: Per-GPU weights (UUID -> weight) for the weighted strategy.
    weights: dict[str, float] = field(default_factory=dict)
    #: Cooperative pausing (`--pausable`): the signal asking for a checkpoint, the grace period
    #: and whether to TERM after it, how often the job was paused, and a pending request.
    pausable: bool = False
    checkpoint_signal: str = DEFAULT_CHECKPOINT_SIGNAL
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    grace_kill: bool = False
    pauses: int = 0
    #: Its owner's pause_min_runtime and pause_max at its submission: whoever asks, the job
    #: is not asked to step aside sooner after a start, or more often, than its owner allows.
    pause_min_runtime: float | None = None
    pause_max: int | None = None
    #: Its owner's safety factor at its submission: while it runs, nobody's job is admitted
    #: onto its GPUs past that share of their memory, whatever the admitting user's own safety.
    safety: float | None = None
    #: Its owner set no safety of their own: `safety` is the site's at its submission, and
    #: plans take the site's as its file says now (gpuwait.queue.conditions.claims_for).
    safety_from_site: bool = False
    pause_requested_at: float | None = None
    pause_requested_by: str | None = None
    pause_signalled_at: float | None = None
    #: The request's and the signal's moments on the boot clock (see `started_boot`).
    pause_requested_boot: float | None = None
    pause_signalled_boot: float | None = None
    #: Priority of the job that paused this one: a resumed job queues at least that high, so a
    #: stream of urgent jobs cannot starve it; it waits until that job has started (`yield_to`).
    #: Its place in the queue only: it asks others to step aside at its own `priority`.
    boost: int = 0
    #: That job, as a dependency of this job's user on it is kept (`LedgerData.reference`).
    yield_to: str | None = None
    #: Seconds this command takes to load to its peak (history), the cost of pausing it.
    load_seconds: float | None = None
    #: Seconds of its work its earlier runs did: each run that ended stepping aside (less its
    #: load time, spent again on resuming), and the run it was frozen after. Its expected run
    #: time is a whole run's: what is left of it is that less this.
    done_seconds: float = 0.0
    #: Freezing (`--freezable`, docs/freezing.md): asked to step aside, the job's own gpuwait
    #: moves its device memory to host memory and stops it. A frozen job waits (its memory is
    #: off the card) since `frozen_at`, pinned to the GPUs it had (`frozen_gpus`): its memory
    #: can only come back there. `freezes` counts toward `pause_max`, as pauses do.
    freezable: bool = False
    frozen_at: float | None = None
    frozen_gpus: list[str] = field(default_factory=list)
    freezes: int = 0
    #: Since when the running job uses more than its reservation (gpuwait.core.overuse), the
    #: most it used, and the total of that card.
    overuse_since: float | None = None
    overuse_bytes: int = 0
    overuse_total_bytes: int = 0
    #: The card (UUID) where it used `overuse_bytes`: its reservation there is what it passed.
    #: None: its largest card's, as entries of older versions are read.
    overuse_gpu: str | None = None
    #: How its budget is held once it runs (gpuwait.core.budget.HELD_BY), strongest first.
    held_by: list[str] = field(default_factory=list)
    #: `--once KEY`: no second job of its user with this key is queued while it waits or runs.
    once: str | None = None
    #: `--key`: the name its runs are learned and listed under, carried by the history's
    #: record of a run whose gpuwait died before it could record it.
    key: str | None = None
    #: `--prefer`: GPUs (UUIDs) taken first where the job fits; others only where none does.
    prefer: list[str] = field(default_factory=list)
    #: A process started without gpuwait and adopted (`gpuwait adopt`): the state dir whose
    #: history records its run once it has ended, and how that history keeps command lines.
    #: Its entry names the process itself as its gpuwait and its command.
    adopted_history: str | None = None
    adopted_commands: str = "full"
    #: The state dir whose history records the run of a job whose gpuwait died before it could
    #: (killed with its command, or before it), once its entry is reaped; and how that history
    #: keeps command lines. None: an entry of an older version, whose end is not recorded.
    history_dir: str | None = None
    history_commands: str = "full"
    #: The lookahead order's no-starvation rule (gpuwait.core.lookahead): seconds it may wait
    #: before it is planned first with the urgent jobs; set once, None until then.
    wait_budget: float | None = None
    #: Who cancelled it while it ran (`gpuwait cancel`: its owner, or root): the TERM sent
    #: ends its command, and it leaves cancelled, not failed. Older versions keep it as an
    #: unknown field and count the run failed, as they did.
    cancelled_by: int | None = None
    #: The pid namespace of its gpuwait process (the inode of /proc/self/ns/pid), set when that
    #: process holds the job's liveness lock (gpuwait.linux.alive). A reader in another pid
    #: namespace (containers without --pid=host) cannot look its pids up: the lock tells it
    #: whether the job lives. None: judged by its pids, as entries of older versions are.
    pidns: int | None = None
    #: Its owner's uid as the machine knows it (gpuwait.linux.userns), where its gpuwait ran in
    #: a user namespace: a rootless container's uid 0 is its user's uid outside. Read in a
    #: private ledger only (a shared one's entries are their file's owner's). None: `uid`, as
    #: this namespace knows it, as entries of older versions are.
    kuid: int | None = None
    #: The boot of the machine its entry was written in (gpuwait.linux.proc.boot_id): an entry
    #: of an earlier boot names no process of this one, whoever has its pid and start time now.
    #: None: judged by its pids, as entries of older versions are.
    boot: str | None = None
    #: Whether its dependencies on other users' jobs (`after`, `yield_to`) are known as
    #: `ID@UID` (`LedgerData.reference`): the file says whose each is (`owners`, beside the
    #: plain ids an older gpuwait reads). False: an entry of an older gpuwait's, which kept only
    #: the plain id its view showed (`LedgerData.as_kept_in`).
    owners_kept: bool = True
    #: Where the size it asks for came from, asked for without --vram ("estimated from 3 runs
    #: of this exact command", "no earlier runs of this command: default_vram"), and whether a
    #: shell hook runs it: `status` says its wait as its wait line does. None and False:
    #: sized with --vram, typed, or an entry of an older version.
    size_source: str | None = None
    from_hook: bool = False
    #: What a newer gpuwait wrote in the entry beyond the fields above (they are only ever
    #: added within a schema): written back as found, so that the entry keeps them whoever
    #: of two versions on one ledger changes it.
    newer_fields: dict[str, Any] = field(default_factory=dict)

    def reserved_on(self, uuid: str | None) -> int:
        """Bytes it reserves on the GPU `uuid`: `reserved_by_gpu`'s figure where that is less
        than `reserved_bytes` (its largest card's), else that."""
        if uuid is None:
            return self.reserved_bytes
        return reserved_on(self.reserved_bytes, self.reserved_by_gpu, uuid)

    def reserved_in_all(self) -> int:
        """Bytes it reserves on all its GPUs together."""
        return sum(self.reserved_on(uuid) for uuid in self.gpu_uuids)

    def memory_request(self) -> MemoryRequest | None:
        if "bytes" in self.request:
            return MemoryRequest(bytes=int(self.request["bytes"]))
        if "fraction" in self.request:
            return MemoryRequest(fraction=float(self.request["fraction"]))
        return None

    def requirements_for_policy(self) -> Requirements:
        return requirements_of(self.requirements)

    @property
    def effective_priority(self) -> int:
        """Its priority in the queue: a job that stepped aside keeps that of whom it made room for."""
        return max(self.priority, self.boost)

    @classmethod
    def from_json(cls, raw: Any) -> Job:
        """Validate one entry; raises ValueError naming what is wrong."""
        if not isinstance(raw, dict):
            raise ValueError("entry is not an object")
        values: dict[str, Any] = dict(
            id=_text(raw, "id"),
            pid=_int(raw, "pid", 1, 2**31),
            start_time=_int(raw, "start_time", 0, 2**62),
            uid=_int(raw, "uid", 0, 2**32),
            command=_text_list(raw, "command"),
            cwd=_text(raw, "cwd"),
            request=_request(raw.get("request")),
            gpus=_int(raw, "gpus", 1, 1024),
            candidates=None if raw.get("candidates") is None else _text_list(raw, "candidates"),
            pick=_text(raw, "pick"),
            priority=_int(raw, "priority", 1, 5),
            order=_int(raw, "order", 0, 2**62),
            state=_text(raw, "state"),
            gpu_uuids=_text_list(raw, "gpu_uuids"),
            reserved_bytes=_int(raw, "reserved_bytes", 0, 2**62),
            reserved_by_gpu=_observed(raw.get("reserved_by_gpu"), "reserved_by_gpu"),
            observed=_observed(raw.get("observed")),
            grown=_observed(raw.get("grown"), "grown"),
            unlisted_at_start=_observed(raw.get("unlisted_at_start"), "unlisted_at_start"),
            unlisted_started_at=_lenient_seconds(raw.get("unlisted_started_at")),
            pids=_pid_list(raw.get("pids", [])),
            child_pid=None if raw.get("child_pid") is None else _int(raw, "child_pid", 1, 2**31),
            child_start_time=None
            if raw.get("child_start_time") is None
            else _int(raw, "child_start_time", 0, 2**62),
            orphaned_at=None if raw.get("orphaned_at") is None else _float(raw, "orphaned_at"),
            submitted_at=_float(raw, "submitted_at"),
            started_at=None if raw.get("started_at") is None else _float(raw, "started_at"),
            submitted_boot=_lenient_seconds(raw.get("submitted_boot")),
            started_boot=_lenient_seconds(raw.get("started_boot")),
            started_slept=_lenient_seconds(raw.get("started_slept")),
            updated_at=_float(raw, "updated_at"),
            name=None if raw.get("name") is None else _text(raw, "name"),
            batch=None if raw.get("batch") is None else _text(raw, "batch"),
            after=_text_list(raw, "after") if "after" in raw else [],
            after_ok=_text_list(raw, "after_ok") if "after_ok" in raw else [],
            requirements=_requirements(raw.get("requirements", {})),
            expected_seconds=_seconds(raw.get("expected_seconds")),
            expected_by_gpu=_seconds_by_gpu(raw.get("expected_by_gpu", {})),
            held_gpus=_text_list(raw, "held_gpus") if "held_gpus" in raw else [],
            weights=_seconds_by_gpu(raw.get("weights", {})),
            pausable=raw.get("pausable") is True,
            checkpoint_signal=_text(raw, "checkpoint_signal")
            if "checkpoint_signal" in raw
            else DEFAULT_CHECKPOINT_SIGNAL,
            grace_seconds=_seconds_or(raw.get("grace_seconds"), DEFAULT_GRACE_SECONDS),
            grace_kill=raw.get("grace_kill") is True,
            pauses=_int(raw, "pauses", 0, 10_000) if "pauses" in raw else 0,
            pause_min_runtime=_lenient_seconds(raw.get("pause_min_runtime")),
            pause_max=_lenient_count(raw.get("pause_max")),
            safety=_lenient_fraction(raw.get("safety")),
            safety_from_site=raw.get("safety_from_site") is True,
            pause_requested_at=_seconds(raw.get("pause_requested_at")),
            pause_requested_by=(
                None if raw.get("pause_requested_by") is None else _text(raw, "pause_requested_by")
            ),
            pause_signalled_at=_seconds(raw.get("pause_signalled_at")),
            pause_requested_boot=_lenient_seconds(raw.get("pause_requested_boot")),
            pause_signalled_boot=_lenient_seconds(raw.get("pause_signalled_boot")),
            boost=_int(raw, "boost", 0, 5) if "boost" in raw else 0,
            yield_to=None if raw.get("yield_to") is None else _text(raw, "yield_to"),
            load_seconds=_seconds(raw.get("load_seconds")),
            done_seconds=_lenient_seconds(raw.get("done_seconds")) or 0.0,
            freezable=raw.get("freezable") is True,
            frozen_at=_seconds(raw.get("frozen_at")),
            frozen_gpus=_text_list(raw, "frozen_gpus") if "frozen_gpus" in raw else [],
            freezes=_int(raw, "freezes", 0, 10_000) if "freezes" in raw else 0,
            overuse_since=None
            if raw.get("overuse_since") is None
            else _float(raw, "overuse_since"),
            overuse_bytes=_int(raw, "overuse_bytes", 0, 2**62) if "overuse_bytes" in raw else 0,
            overuse_total_bytes=_int(raw, "overuse_total_bytes", 0, 2**62)
            if "overuse_total_bytes" in raw
            else 0,
            overuse_gpu=_lenient_text(raw.get("overuse_gpu")),
            held_by=_held_by(raw.get("held_by")),
            # Both are read leniently: an entry written without them (or damaged there) keeps
            # its place in the queue, only without the key or the preference.
            once=_lenient_text(raw.get("once")),
            key=_lenient_text(raw.get("key")),
            prefer=_lenient_texts(raw.get("prefer")),
            adopted_history=_lenient_text(raw.get("adopted_history")),
            adopted_commands="hash" if raw.get("adopted_commands") == "hash" else "full",
            history_dir=_lenient_text(raw.get("history_dir")),
            history_commands="hash" if raw.get("history_commands") == "hash" else "full",
            wait_budget=_lenient_seconds(raw.get("wait_budget")),
            cancelled_by=_lenient_uid(raw.get("cancelled_by")),
            pidns=_lenient_inode(raw.get("pidns")),
            kuid=_lenient_uid(raw.get("kuid")),
            boot=_lenient_boot(raw.get("boot")),
            size_source=_lenient_note(raw.get("size_source")),
            from_hook=raw.get("from_hook") is True,
            owners_kept=False,
            newer_fields=_newer_fields(raw, _JOB_KEYS),
        )
        owners = _owners(raw.get("owners"))
        if owners is not None:
            values["owners_kept"] = True
            if owners:
                _as_kept(values, owners)
        if len(values) == len(cls._fields):
            # Every field is set above and each value checked: Record's generic __init__ (a
            # good part of the time this takes, in every read of the ledger) has nothing to add.
            job = object.__new__(cls)
            job.__dict__.update(values)
        else:
            job = cls(**values)
        if job.state not in (WAITING, RUNNING):
            raise ValueError(f"state {job.state!r} is unknown")
        return job

    def to_json(self) -> dict[str, Any]:
        # vars(), not asdict(): the same JSON without asdict's deep copies.
        raw = dict(vars(self))
        newer = raw.pop("newer_fields")
        if raw.pop("owners_kept"):
            raw["owners"] = _as_written(raw)
        return {**newer, **raw} if newer else raw


def _as_written(raw: dict[str, Any]) -> dict[str, int]:
    """Write the dependencies of the entry `raw` (a copy) on other users' jobs (`ID@UID`) by
    their plain ids, as an older gpuwait keeps and reads them (its view shows another member's
    job by its plain id), so that it plans a step of a newer one's as waiting for that job;
    and return whose each is, for a newer gpuwait (`_as_kept`). One whose plain id is another
    dependency's already stays `ID@UID`."""
    refs = [*raw["after"], *raw["after_ok"], *([raw["yield_to"]] if raw["yield_to"] else [])]
    if not any("@" in ref for ref in refs):
        return {}
    owned = {ref: _owner(ref, raw["uid"]) for ref in refs}
    taken = {ref for ref, owner in owned.items() if owner is None}
    owners: dict[str, int] = {}
    written: dict[str, str] = {}
    for ref, owner in owned.items():
        if owner is None:
            continue
        plain = ref.removesuffix(f"@{owner}")
        as_written = ref if plain in taken or plain in owned else plain
        taken.add(as_written)
        owners[as_written], written[ref] = owner, as_written
    if written:
        raw["after"] = [written.get(ref, ref) for ref in raw["after"]]
        raw["after_ok"] = [written.get(ref, ref) for ref in raw["after_ok"]]
        raw["yield_to"] = written.get(raw["yield_to"], raw["yield_to"])
    return owners


def _owner(ref: str, uid: int) -> int | None:
    """The uid of another user than `uid` whose job the dependency `ref` names (`ID@UID`)."""
    _, at, owner = ref.rpartition("@")
    number = whole_number(owner) if at else None
    return None if number == uid else number


def _owners(value: Any) -> dict[str, int] | None:
    """An entry's `owners` (`_as_written`); None where it has none (an older gpuwait's), or
    it is damaged: its dependencies are then read as an older gpuwait kept them."""
    if (
        not isinstance(value, dict)
        or len(value) > 3 * _MAX_TEXTS
        or not all(type(v) is int and 0 <= v < 2**32 for v in value.values())
    ):
        return None
    return value


def _as_kept(values: dict[str, Any], owners: dict[str, int]) -> None:
    """The dependencies of an entry read (`values`) as this version keeps them (`ID@UID` for
    another user's job), from the plain ids written beside whose each is (`_as_written`)."""

    def kept(ref: str) -> str:
        owner = owners.get(ref)
        if owner is None:
            return ref
        return ref if ref.endswith(f"@{owner}") else f"{ref}@{owner}"

    values["after"] = [kept(ref) for ref in values["after"]]
    values["after_ok"] = [kept(ref) for ref in values["after_ok"]]
    if values["yield_to"] is not None:
        values["yield_to"] = kept(values["yield_to"])


def _newer_fields(raw: dict[str, Any], known: frozenset[str]) -> dict[str, Any]:
    """What an object of the ledger holds beyond the `known` fields: a newer gpuwait's."""
    if raw.keys() <= known:
        return {}
    return {key: value for key, value in raw.items() if key not in known}


def _lenient_seconds(value: Any) -> float | None:
    """A duration read leniently: a damaged one is as if never set (it is set again)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 <= value < 1e12 else None


def _lenient_fraction(value: Any) -> float | None:
    """A share in (0, 1] read leniently: anything else is as if never set."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 < value <= 1 else None


def _lenient_count(value: Any) -> int | None:
    """A count read leniently: a damaged one is as if never set."""
    return value if type(value) is int and 0 <= value <= 10_000 else None


def since(wall: float | None, boot: float | None, now: float, boot_now: float | None) -> float:
    """Seconds from a moment stamped `wall` (and `boot`, on the boot clock) to `now` (and
    `boot_now`): on the boot clock where both are known, so that no step of the wall clock
    changes what it decides; else on the wall clock (an entry of an older version, or a caller
    that passed a wall clock only). 0 for a moment never stamped. A boot stamp later than
    `boot_now` was taken on another boot clock (an earlier boot, another time namespace): the
    wall clock measures then."""
    if _on_this_clock(boot, boot_now):
        assert boot is not None and boot_now is not None
        return boot_now - boot
    return 0.0 if wall is None else now - wall


def run_time(job: Job, now: float, boot_now: float | None) -> float:
    """How long the running `job` has run since it (last) started: the time since then (see
    `since`) less what of it the machine was suspended, when its command did not run either,
    as the run times that the history learns leave it out. 0 for a job not started."""
    if job.started_at is None:
        return 0.0
    elapsed = max(0.0, since(job.started_at, job.started_boot, now, boot_now))
    if job.started_slept is None or not _on_this_clock(job.started_boot, boot_now):
        return elapsed
    assert boot_now is not None
    return max(0.0, elapsed - max(0.0, proc.slept(boot_now) - job.started_slept))


def charged_run_time(job: Job, now: float, boot_now: float | None) -> float:
    """How long the running `job` has held its reservation so far, as its user is charged for
    it once it ends: its run time (`run_time`) and `run_before_freezing`."""
    return run_time(job, now, boot_now) + run_before_freezing(job)


def run_before_freezing(job: Job) -> float:
    """What a --freezable job ran before it was last frozen (`done_seconds`), charged to nobody
    yet: its run since the thaw is timed from then on. (A --pausable job's earlier runs were
    charged as each stepped aside.)"""
    return job.done_seconds if job.freezable else 0.0


def _on_this_clock(boot: float | None, boot_now: float | None) -> bool:
    """Is `boot` a stamp of the boot clock that reads `boot_now` (not a later one, which was
    taken on another: an earlier boot, another time namespace)?"""
    return boot is not None and boot_now is not None and boot <= boot_now


def pause_stamps(
    job: Job, now: float, boot_now: float | None
) -> tuple[float | None, float | None, float]:
    """`job`'s pause request and checkpoint signal moments, and now, on one clock: the boot
    clock where every one of them has a boot stamp of this clock (see `since`), else the wall
    clock."""
    if _on_this_clock(job.pause_requested_boot, boot_now) and (
        job.pause_signalled_at is None or _on_this_clock(job.pause_signalled_boot, boot_now)
    ):
        assert boot_now is not None
        return job.pause_requested_boot, job.pause_signalled_boot, boot_now
    return job.pause_requested_at, job.pause_signalled_at, now


def protected(job: Job, now: float, boot_now: float | None = None) -> bool:
    """Whether `job` may not be asked to step aside now by its owner's own rules: it started
    (or resumed) less than its pause_min_runtime ago, or stepped aside pause_max times."""
    ran = run_time(job, now, boot_now)
    return (job.pause_min_runtime is not None and ran < job.pause_min_runtime) or (
        job.pause_max is not None and job.pauses + job.freezes >= job.pause_max
    )


def elsewhere(job: Job) -> bool:
    """Was `job`'s entry written in another pid namespace than this process's (a container
    without --pid=host)? Its pids then name no process here, or somebody else's: they must not
    be looked up, signalled or matched with NVML's, and its lock tells whether it lives."""
    here = pid_namespaces.current()
    return job.pidns is not None and here is not None and job.pidns != here


def _lenient_uid(value: Any) -> int | None:
    """A uid read leniently: a damaged one is as if never set."""
    return value if type(value) is int and 0 <= value < 2**32 else None


def _lenient_boot(value: Any) -> str | None:
    """A boot id read leniently: a damaged one is as if never set."""
    return value if isinstance(value, str) and 0 < len(value) <= 64 else None


def of_an_earlier_boot(boot: object) -> bool:
    """Was an entry with this `boot` written before the machine last booted? Its pids then
    name no process of now: they are judged as gone (gpuwait.linux.proc.boot_id)."""
    if boot is None:
        return False
    here = proc.boot_id()
    return here is not None and boot != here


def _lenient_inode(value: Any) -> int | None:
    """An inode number read leniently: a damaged one is as if never set."""
    return value if type(value) is int and 0 < value < 2**64 else None


def _held_by(value: Any) -> list[str]:
    """Known ways only: the list is shown, and an entry is anybody's text."""
    if not isinstance(value, list):
        return []
    return [way for way in value if isinstance(way, str) and way in HELD_BY][: len(HELD_BY)]


def copy_job(job: Job) -> Job:
    """A copy of `job` whose lists and dicts are its own (a caller may change them in place)."""
    copy = job._replace()
    values = copy.__dict__
    for name in _CONTAINER_FIELDS:
        value = values[name]
        if value is not None:
            values[name] = value.copy()
    # The one field that nests containers: min_compute_capability is a list.
    values["requirements"] = {
        k: list(v) if type(v) is list else v for k, v in job.requirements.items()
    }
    return copy


#: Job's fields that hold a list or a dict (read from the annotations, so a new one is not missed).
_CONTAINER_FIELDS = tuple(
    name
    for name, annotation in Job.__annotations__.items()
    if str(annotation).startswith(("list[", "dict[")) or "| list[" in str(annotation)
)
#: The fields an entry of this version has in the file.
_JOB_KEYS = (frozenset(Job._fields) - {"newer_fields", "owners_kept"}) | {"owners"}


class UserUsage(Record):
    """A user's past use of VRAM, in byte-seconds, as it stood at `at` (it decays from there)."""

    vram_seconds: float
    at: float


class Request(Record):
    """What a user asks of a job that may be another user's, written in the asker's own file and
    carried out only by the target's own gpuwait, after checking the asker's right to it.

    `kind` is PAUSE (a waiting job, `by_job`, asks a running --pausable job to step aside) or
    CANCEL (root takes another user's waiting job out of the queue). The target is named by
    its owner, id and gpuwait process (pid and start time), so a request can never hit a later
    job that happens to reuse an id or a pid.
    """

    kind: str
    uid: int
    job: str
    pid: int
    start_time: int
    at: float
    by_job: str | None = None
    #: Who asked: the owner of the file the request was read from (never the file's word).
    by_uid: int = -1
    #: `at` on the boot clock (see Job.started_boot); None: written by an older version.
    at_boot: float | None = None

    @classmethod
    def to(
        cls,
        job: Job,
        kind: str,
        at: float,
        by_uid: int,
        by_job: str | None = None,
        at_boot: float | None = None,
    ) -> Request:
        """A request of `kind` to `job`'s gpuwait process."""
        return cls(
            kind, job.uid, plain_id(job.id), job.pid, job.start_time, at, by_job, by_uid, at_boot
        )

    def targets(self, job: Job) -> bool:
        return (self.uid, self.job, self.pid, self.start_time) == (
            job.uid,
            plain_id(job.id),
            job.pid,
            job.start_time,
        )

    def to_json(self) -> dict[str, Any]:
        raw = dict(vars(self))
        del raw["by_uid"]
        return raw

    @classmethod
    def from_json(cls, raw: Any) -> Request:
        raw = _object(raw)
        request = cls(
            kind=_text(raw, "kind"),
            uid=_int(raw, "uid", 0, 2**32),
            job=_text(raw, "job"),
            pid=_int(raw, "pid", 1, 2**31),
            start_time=_int(raw, "start_time", 0, 2**62),
            at=_float(raw, "at"),
            by_job=_optional_text(raw, "by_job"),
            at_boot=_lenient_seconds(raw.get("at_boot")),
        )
        if request.kind not in (PAUSE, CANCEL):
            raise ValueError(f"request kind {request.kind!r} is unknown")
        return request


PAUSE = "pause"
CANCEL = "cancel"


def plain_id(job_id: str) -> str:
    """A job's id as its owner's file has it (see `combine`: `id@uid` where another file used
    it already)."""
    return job_id.partition("@")[0]


#: Requests one user's file may hold.
MAX_REQUESTS = 1024
#: More submissions than any machine makes (a million a second for 280 years). A file may say
#: its counter or an order is higher, up to the 2**62 a reader accepts: taken on, the next
#: submissions would write a counter past that, and every reader, the writer's own gpuwait
#: included, would reject the writer's file. Counters are taken on up to this only.
PLAUSIBLE_ORDER = 2**53


class LedgerData(Record):
    """The whole ledger: one file, or in a shared ledger directory every user's file together."""

    jobs: list[Job] = field(default_factory=list)
    next_order: int = 1
    rr_cursor: int = -1
    created_at: float = field(default_factory=time.time)
    #: `created_at` on the boot clock (None: a file of an older version), so that how long ago
    #: the ledger began (a recovery's grace) is told whatever steps the wall clock takes.
    created_boot: float | None = field(default_factory=proc.boot_clock)
    #: When entries of this file were last dropped as damaged (a ledger damaged in part,
    #: repaired), and on the boot clock: their jobs' gpuwait put them back, as after a ledger
    #: started afresh (gpuwait.queue.lifecycle.RECOVERY_GRACE). None: never.
    repaired_at: float | None = None
    repaired_boot: float | None = None
    #: Outcomes of finished jobs, per-GPU counters, GPU health, batch counts.
    book: Book = field(default_factory=Book)
    #: How many transactions freed room (see gpuwait.queue.wake).
    release_seq: int = 0
    #: Decayed VRAM-time of finished jobs, per uid (fair share between users).
    usage: dict[int, UserUsage] = field(default_factory=dict)
    #: Requests to other jobs' gpuwait processes (see Request), from every file read.
    requests: list[Request] = field(default_factory=list)
    #: The waiters' order (job ids) of the last lookahead plan made under the lock: the next
    #: plan searches on from it (core/lookahead). Only a starting point, so in a shared ledger
    #: directory each user's file keeps its own, and whatever a file says costs no one a start.
    plan_order: list[str] = field(default_factory=list)
    #: What a newer gpuwait wrote in this process's own file beyond the parts above: written
    #: back as found (see Job.newer_fields).
    newer_fields: dict[str, Any] = field(default_factory=dict)
    #: In a shared ledger directory: the uid whose file this process writes, and the part of
    #: `release_seq` that other users' files hold. Not written.
    me: int | None = None
    others_release: int = 0
    #: Other users' waiters that this process's plan would start: their own gpuwait does, told
    #: by the wake-up summary. Not written.
    starting: set[str] = field(default_factory=set)
    #: An entry that went missing (a damaged ledger recovered without it) was put back: waiters
    #: held until it came back may go on, as after a release (see gpuwait.queue.wake). Not
    #: written.
    put_back: bool = False
    #: In a shared ledger directory: the other users whose file could not be read (why, by
    #: uid) while a gpuwait of theirs runs: the room their jobs hold is not known. Not written.
    unread: dict[int, str] = field(default_factory=dict)
    #: When (on the wall clock) each of those files has been left so for UNREAD_GRACE
    #: (gpuwait.queue.ledger), by uid: no longer waited for then. Not written.
    unread_until: dict[int, float] = field(default_factory=dict)
    #: In a shared ledger directory: the other users whose file was started afresh after
    #: damage lately while a gpuwait of theirs runs (when, on the boot clock, that is no
    #: longer lately, by uid): their jobs' entries are still to come back. Not written.
    recovered: dict[int, float | None] = field(default_factory=dict)
    #: In a shared ledger directory: the names in it as the read that made this listed them
    #: (None: it listed none), for what else is told from this read. Not written.
    listed: list[str] | None = None

    def mine(self, job: Job) -> bool:
        """Is `job` in the file this process writes (every job is, in a private ledger)?"""
        return self.me is None or job.uid == self.me

    def find(self, job_id: str) -> Job | None:
        return next((j for j in self.jobs if j.id == job_id), None)

    def reference(self, job: Job, by: int | None = None) -> str:
        """The id a dependency of the user `by` (default: this process's) on `job` (`--after`)
        is kept under: its id for a job of their own; `ID@UID` for another user's, whichever of
        several users' entries with that id `combine` shows with the plain one now (the lowest
        uid's), as entries come and go. Another member's waiter keeps its dependencies in its
        own user's terms: a plan that reads them reads them so (`by`)."""
        if self.me is None:
            return job.id  # one user's ledger: every entry is theirs
        tail = f"@{job.uid}"
        if job.uid != (self.me if by is None else by):
            return job.id if job.id.endswith(tail) else job.id + tail
        if self.mine(job):
            return job.id
        # Their own job, shown here with its owner where this user's file has its id too.
        return job.id.removesuffix(tail)

    def by_reference(self, by: int | None = None) -> dict[str, Job]:
        """Every entry, by the id a dependency of the user `by` on it is kept under
        (`reference`)."""
        return {self.reference(j, by): j for j in self.jobs}

    def by_plain_id(self) -> dict[str, list[tuple[int, Job]]]:
        """Every entry, with its place in the ledger, by its id less any `@UID` of its own
        user's: what `referred` and `as_kept_in` look a job's dependencies up in. Made once for
        a plan of the whole queue, it keeps each entry's look-up to the few that bear its ids."""
        index: dict[str, list[tuple[int, Job]]] = {}
        for at, j in enumerate(self.jobs):
            index.setdefault(j.id.removesuffix(f"@{j.uid}"), []).append((at, j))
        return index

    def referred(
        self,
        refs: Iterable[str],
        by: int | None = None,
        index: Mapping[str, list[tuple[int, Job]]] | None = None,
    ) -> dict[str, Job]:
        """The entries `refs` (dependencies of the user `by`) name, by those references
        (`by_reference`, for just these: nothing to look through where there are none), found
        in `index` (`by_plain_id`, made here where not given)."""
        wanted = set(refs)
        if not wanted:
            return {}
        index = self.by_plain_id() if index is None else index
        found: dict[str, tuple[int, Job]] = {}
        for ref in wanted:
            # Kept under its id, or its id with its user's, whoever's it is (`reference`).
            plain, at_sign, _ = ref.rpartition("@")
            for at, j in [*index.get(ref, ()), *(index.get(plain, ()) if at_sign else ())]:
                if self.reference(j, by) == ref and at >= found.get(ref, (-1, j))[0]:
                    found[ref] = (at, j)  # the last such entry, as `by_reference` has it
        return {ref: j for ref, (_, j) in found.items()}

    def as_kept_in(
        self, job: Job, index: Mapping[str, list[tuple[int, Job]]] | None = None
    ) -> dict[str, Job]:
        """The entries `job`'s dependencies (and the job it stepped aside for) name, by the id
        they are kept under: as its own user keeps them (`referred`), or, in an entry of an
        older gpuwait's (`owners_kept` False), each other user's job also under the plain id
        that gpuwait's view showed: the lowest uid's where several users' jobs have that id.
        Such a gpuwait still waits after an upgrade, and a member who has not upgraded writes
        them so: read as `ID@UID` alone, the step would start at once. An id of that user's
        own jobs, live or (in this user's book) ended, stays theirs. Looked up in `index`
        (`by_plain_id`, made here where not given and needed)."""
        named = {*job.after, *job.after_ok, *([job.yield_to] if job.yield_to else [])}
        if not named:
            return {}
        by = job.uid
        index = self.by_plain_id() if index is None else index
        found = self.referred(named, by, index)
        if self.me is None or job.owners_kept:
            return found
        ended = {f.id for f in self.book.finished} if by == self.me else set()
        for plain in sorted(named - ended):
            others = [(j.uid, at, j) for at, j in index.get(plain, ()) if j.uid != by]
            if others:
                found.setdefault(plain, min(others, key=lambda other: other[:2])[2])
        return found

    def remove(self, job_id: str) -> Job | None:
        job = self.find(job_id)
        if job is not None:
            self.jobs.remove(job)
        return job


# --- the document ---------------------------------------------------------------------------

#: Entries validated, per file owner (each user's file in a shared ledger directory has its
#: own), and entries encoded, by this process: see gpuwait.queue.cache.
_VALIDATED: dict[int, ValidatedEntries[Job]] = {}
_ENCODED = EncodedEntries()


def _validated(owner: int) -> ValidatedEntries[Job]:
    cache = _VALIDATED.get(owner)
    if cache is None:
        if len(_VALIDATED) >= 64:
            _VALIDATED.clear()
        cache = _VALIDATED[owner] = ValidatedEntries(Job.from_json, copy_job)
    return cache


def forget_cached_entries() -> None:
    """As if this process had never read or written a ledger (tests and benchmarks)."""
    _VALIDATED.clear()
    _ENCODED.forget()


def to_document(data: LedgerData) -> dict[str, Any]:
    """The ledger as the JSON document that is written: in a shared ledger directory, this
    user's own file (their jobs, requests and usage), which is all one user may write."""
    me = data.me
    encoded: dict[str, Any] = {
        "schema": SCHEMA,
        "created_at": data.created_at,
        **({} if data.created_boot is None else {"created_boot": data.created_boot}),
        **({} if data.repaired_at is None else {"repaired_at": data.repaired_at}),
        **({} if data.repaired_boot is None else {"repaired_boot": data.repaired_boot}),
        "next_order": data.next_order,
        "rr_cursor": data.rr_cursor,
        "jobs": [j.to_json() for j in data.jobs if me is None or j.uid == me],
        "book": book_to_json(data.book),
        "release_seq": data.release_seq - data.others_release,
    }
    usage = data.usage if me is None else {u: v for u, v in data.usage.items() if u == me}
    if usage:
        encoded["usage"] = {str(uid): [u.vram_seconds, u.at] for uid, u in sorted(usage.items())}
    requests = [r for r in data.requests if me is None or r.by_uid == me]
    if requests:
        encoded["requests"] = [r.to_json() for r in requests]
    if data.plan_order:
        encoded["plan_order"] = data.plan_order
    if data.newer_fields:
        encoded = {**data.newer_fields, **encoded}
    return encoded


#: The parts of a ledger document this version writes (`to_document`).
_DOCUMENT_KEYS = frozenset(
    (
        "schema",
        "created_at",
        "created_boot",
        "repaired_at",
        "repaired_boot",
        "next_order",
        "rr_cursor",
        "jobs",
        "book",
        "release_seq",
        "usage",
        "requests",
        "plan_order",
    )
)


def encode(document: dict[str, Any]) -> bytes:
    """`to_document`'s result as the file's bytes (sorted keys, no spaces)."""
    return _ENCODED.encode(document)


class NewerSchema(ValueError):
    """A ledger written by a newer gpuwait, in a schema this one does not know."""

    def __init__(self, schema: int) -> None:
        super().__init__(
            f"schema {schema}, written by a newer gpuwait than this one (schema {SCHEMA}): "
            "update gpuwait wherever this ledger is used"
        )
        self.schema = schema


def from_document(
    raw: Any,
    warnings: list[str] | None,
    where: str,
    owner: int = -1,
    owned: bool = False,
    newer_ok: bool = False,
) -> LedgerData:
    """Validate a parsed ledger document; ValueError when it is not one at all, NewerSchema
    when a newer gpuwait wrote it (`newer_ok`: read it as far as this schema goes instead).

    What is wrong with parts of it (invalid entries, a damaged book or usage table) is dropped
    and, when `warnings` is given, said there, naming the file `where`. `owner`: who wrote the
    file, as the file system says; its requests are theirs, and with `owned` (one user's file
    in a shared ledger directory) so are its entries, whatever uid they claim.
    """
    schema = raw.get("schema") if isinstance(raw, dict) else "?"
    if type(schema) is int and schema > SCHEMA:
        if not newer_ok:
            raise NewerSchema(schema)
    elif not isinstance(raw, dict) or schema != SCHEMA:
        # Said as a number of a few digits, or by its type alone: another member's text (or a
        # number of 4,000 digits) is no reader's to show.
        small = type(schema) is int and abs(schema) < 10**9
        shown = schema if schema in (None, "?") or small else type(schema).__name__
        raise ValueError(f"schema {shown}")
    jobs_raw = raw.get("jobs")
    if not isinstance(jobs_raw, list):
        raise ValueError("no job list")
    data = LedgerData(
        next_order=_int(raw, "next_order", 0, 2**62),
        rr_cursor=raw["rr_cursor"] if isinstance(raw.get("rr_cursor"), int) else -1,
        created_at=_float(raw, "created_at"),
        created_boot=_lenient_seconds(raw.get("created_boot")),
        repaired_at=_lenient_seconds(raw.get("repaired_at")),
        repaired_boot=_lenient_seconds(raw.get("repaired_boot")),
        usage=_usage(raw.get("usage"), warnings),
        release_seq=raw["release_seq"] if isinstance(raw.get("release_seq"), int) else 0,
        plan_order=_plan_order(raw.get("plan_order")),
        newer_fields=_newer_fields(raw, _DOCUMENT_KEYS),
    )
    try:
        data.book = book_from_json(raw.get("book"))
    except (ValueError, RecursionError) as exc:
        if warnings is not None:
            warnings.append(
                f"ledger {where}: its record of finished jobs and GPUs was damaged "
                f"({exc}); started it afresh"
            )
    dropped: list[str] = []
    ids: set[str] = set()
    per_uid: dict[int, int] = {}
    parsed, invalid = _validated(owner).validate_all(jobs_raw[: MAX_ENTRIES * 2])
    dropped += invalid
    if owned:
        for job in parsed:
            job.uid = owner
    if len(jobs_raw) > MAX_ENTRIES * 2:
        dropped.append(f"more than {MAX_ENTRIES} entries")
    # An id claimed under two uids is another member's copy of someone's job id (ids are 32
    # random bits): which one is real cannot be told, so neither is kept. The real one's
    # gpuwait puts its entry back; kept, the copy would stand in for it (its reservation,
    # its owner for cancel) for as long as the file said so.
    owners: dict[str, set[int]] = {}
    for job in parsed:
        owners.setdefault(job.id, set()).add(job.uid)
    claimed = {i for i, uids in owners.items() if len(uids) > 1}
    if claimed:
        from gpuwait.core.text import printable  # only a damaged or hostile file needs it

        dropped += [
            f"id {printable(j.id, 16)} is claimed by several users"
            for j in parsed
            if j.id in claimed
        ]
        parsed = [j for j in parsed if j.id not in claimed]
    # Running entries first, so that a cap drops waiters rather than reservations.
    for job in sorted(parsed, key=lambda j: (j.state != RUNNING, j.order)):
        if job.id in ids:
            continue
        if len(data.jobs) >= MAX_ENTRIES:
            dropped.append(f"more than {MAX_ENTRIES} entries")
            continue
        if per_uid.get(job.uid, 0) >= MAX_ENTRIES_PER_UID:
            dropped.append(f"uid {job.uid} has more than {MAX_ENTRIES_PER_UID} entries")
            continue
        ids.add(job.id)
        per_uid[job.uid] = per_uid.get(job.uid, 0) + 1
        data.jobs.append(job)
    # Keep the file's own order (the cap above only decided which entries survive).
    position = {id(e): i for i, e in enumerate(parsed)}
    data.jobs.sort(key=lambda j: position[id(j)])
    requests_raw = raw.get("requests", [])
    if not isinstance(requests_raw, list):
        requests_raw = [None]
    for item in requests_raw[:MAX_REQUESTS]:
        try:
            data.requests.append(Request.from_json(item)._replace(by_uid=owner))
        except (ValueError, TypeError):
            dropped.append("a malformed request")
    if dropped and warnings is not None:
        # The jobs of the entries dropped may live: each one's gpuwait puts its entry back,
        # and until it has, nobody is admitted into its room.
        data.repaired_at, data.repaired_boot = time.time(), proc.boot_clock()
        more = f" and {len(dropped) - 1} more" if len(dropped) > 1 else ""
        warnings.append(
            f"ledger {where}: dropped {len(dropped)} invalid "
            f"entr{'y' if len(dropped) == 1 else 'ies'} ({dropped[0]}{more})"
        )
    mark_pause_requests(data)
    return data


def _plan_order(raw: object) -> list[str]:
    """A file's `plan_order`, as far as it is a list of job ids (anything else: none)."""
    if not isinstance(raw, list):
        return []
    return [x for x in raw[:MAX_ENTRIES] if isinstance(x, str) and len(x) <= 256]


def combine(
    own: LedgerData,
    others: Sequence[tuple[int, LedgerData]],
    me: int,
    counts: Callable[[Job], bool],
) -> LedgerData:
    """One user's file (`own`, read by its owner `me`) and the other users' files
    ((owner, data) as the file system names the owner): the ledger as everyone plans from it.

    Whatever a file says, its entries and requests are its owner's. Other users' entries count
    only where `counts(job)` (the kernel shows a live gpuwait of that owner, or an orphan's
    command); this user's own are kept as they are, for lifecycle to reap. An id another file
    uses already is shown with its owner (`id@uid`): the owner's own copy keeps the plain id,
    and so does the id of a job of theirs that has ended (in their book): another member who
    gives an entry of theirs that id makes no `--after` of this user's wait for it.
    """
    own.me = me
    for job in own.jobs:
        job.uid, job.kuid = me, None
    for request in own.requests:
        request.by_uid = me
    own.usage = {me: own.usage[me]} if me in own.usage else {}
    own.next_order = min(own.next_order, PLAUSIBLE_ORDER)
    ids = {j.id for j in own.jobs} | {f.id for f in own.book.finished}
    for owner, data in sorted(others, key=lambda part: part[0]):
        own.others_release += max(0, data.release_seq)
        own.next_order = max(own.next_order, min(data.next_order, PLAUSIBLE_ORDER))
        if owner in data.usage:
            own.usage[owner] = data.usage[owner]
        for job in counted(data.jobs, owner, counts):
            if job.id in ids:
                job.id = f"{job.id}@{owner}"
            ids.add(job.id)
            own.jobs.append(job)
        own.requests += [r._replace(by_uid=owner) for r in data.requests]
    own.release_seq += own.others_release
    own.next_order = max([own.next_order, *(min(j.order + 1, PLAUSIBLE_ORDER) for j in own.jobs)])
    mark_pause_requests(own)
    return own


def claims_proven(
    raw_jobs: Sequence[Any],
    owner: int,
    proves: Callable[[int, int, int, object, int | None, int | None, object], bool],
) -> list[Any]:
    """The raw entries of `owner`'s file (another user's) worth validating: of those naming one
    gpuwait process, the first, if `proves(owner, pid, start_time, state, child_pid,
    child_start_time, command)`; `counted` decides on the validated entries as ever."""
    kept: list[Any] = []
    pids: set[int] = set()
    for item in raw_jobs[: MAX_ENTRIES * 2]:
        if not isinstance(item, dict):
            continue
        pid, start = item.get("pid"), item.get("start_time")
        if type(pid) is not int or type(start) is not int or pid in pids:
            continue
        if of_an_earlier_boot(_lenient_boot(item.get("boot"))):
            continue
        pids.add(pid)
        child, child_start = item.get("child_pid"), item.get("child_start_time")
        if proves(
            owner,
            pid,
            start,
            item.get("state"),
            child if type(child) is int else None,
            child_start if type(child_start) is int else None,
            item.get("command"),
        ):
            kept.append(item)
    return kept


def counted(jobs: Sequence[Job], owner: int, counts: Callable[[Job], bool]) -> list[Job]:
    """The entries of `owner`'s file that count for other users: those `counts` proves, and of
    several naming one gpuwait process (or one command), the first: the others are copies."""
    kept: list[Job] = []
    pids: set[int] = set()
    commands: set[int] = set()
    for job in jobs:
        job.uid, job.kuid = owner, None
        if job.pid in pids or job.child_pid in commands:
            continue
        # Looked at once, proven or not: a file naming one process a thousand times costs
        # its readers one look.
        pids.add(job.pid)
        if not counts(job):
            continue
        if job.child_pid is not None:
            commands.add(job.child_pid)
        kept.append(job)
    return kept


def mark_pause_requests(
    data: LedgerData, now: float | None = None, boot_now: float | None = None
) -> None:
    """Set each running job's `pause_requested_*` from the requests that may ask it: from a
    waiting job of higher priority (or of the same user) whose gpuwait is not stopped, to a
    running --pausable (or --freezable) job that its owner's own rules let be asked now
    (`protected`), the earliest first. Whatever an entry itself says about being asked is not taken: only its asker's
    file may say so; and an asker's file says nothing about the rules of the job it asks."""
    if now is None:
        now, boot_now = time.time(), proc.boot_clock()
    jobs = {(j.uid, plain_id(j.id)): j for j in data.jobs}
    for job in data.jobs:
        job.pause_requested_at = job.pause_requested_by = job.pause_requested_boot = None
    for request in sorted(data.requests, key=lambda r: r.at):
        if request.kind != PAUSE or request.by_job is None:
            continue
        victim = jobs.get((request.uid, request.job))
        asker = jobs.get((request.by_uid, request.by_job))
        if (
            victim is None
            or asker is None
            or not request.targets(victim)
            or victim.pause_requested_at is not None
            or victim.state != RUNNING
            or not (victim.pausable or victim.freezable)
            or protected(victim, now, boot_now)
            or asker.state != WAITING
            # A waiter whose gpuwait is stopped (Ctrl-Z) is passed over and starts nothing:
            # its request stands again once it is continued.
            or (not elsewhere(asker) and proc.stopped(asker.pid, asker.start_time))
            # A user's own waiter may ask whatever the priorities (an idle job, with
            # `idle_action = pause`): they could cancel that job anyway.
            # The asker's own priority: a boost (it stepped aside) keeps its place, no more.
            or (asker.priority <= victim.effective_priority and asker.uid != victim.uid)
        ):
            continue
        victim.pause_requested_at = request.at
        victim.pause_requested_boot = request.at_boot
        victim.pause_requested_by = asker.id


# --- the book -------------------------------------------------------------------------------


def book_to_json(book: Book) -> dict[str, Any]:
    # vars() rather than dataclasses.asdict: every field is a plain value (or a list of them),
    # and asdict's deep copies cost more than the rest of a ledger transaction.
    return {
        "finished": [dict(vars(f)) for f in book.finished],
        "gpus": {u: dict(vars(c)) for u, c in book.gpus.items()},
        "health": {u: dict(vars(h)) for u, h in book.health.items()},
        "health_backend": book.health_backend,
        "batches": {b: dict(vars(c)) for b, c in book.batches.items()},
    }


def book_from_json(raw: Any) -> Book:
    """Parse the "book" part of the ledger; raises ValueError naming what is wrong."""
    if raw is None:
        return Book()
    if not isinstance(raw, dict):
        raise ValueError("not an object")
    backend = raw.get("health_backend")
    if backend is not None and not isinstance(backend, str):
        raise ValueError("health_backend must be a string")
    return Book(
        finished=[_finished(f) for f in _list(raw.get("finished", []), FINISHED_KEPT)],
        gpus={u: _counters(c) for u, c in _table(raw.get("gpus", {})).items()},
        health={u: _health(h) for u, h in _table(raw.get("health", {})).items()},
        health_backend=backend,
        batches={b: _batch(c) for b, c in _table(raw.get("batches", {})).items()},
    )


def _finished(raw: Any) -> Finished:
    raw = _object(raw)
    done = Finished(
        id=_text(raw, "id"),
        outcome=_text(raw, "outcome"),
        finished_at=_float(raw, "finished_at"),
        name=_optional_text(raw, "name"),
        batch=_optional_text(raw, "batch"),
        exit_status=_optional_count(raw, "exit_status"),
        signal=_optional_count(raw, "signal"),
        by_uid=_optional_count(raw, "by_uid"),
        oom=_optional_text(raw, "oom"),
    )
    if done.outcome not in OUTCOMES:
        raise ValueError(f"outcome {done.outcome!r} is unknown")
    return done


def _counters(raw: Any) -> GpuCounters:
    raw = _object(raw)
    ends = _list(raw.get("recent_ends", []), THROUGHPUT_WINDOW)
    return GpuCounters(
        dispatched=_count(raw, "dispatched"),
        completed=_count(raw, "completed"),
        failed=_count(raw, "failed"),
        # Absent from ledgers written before OOMs were counted apart.
        oom=_count(raw, "oom") if "oom" in raw else 0,
        recent_ends=[_float({"t": t}, "t") for t in ends],
    )


def _health(raw: Any) -> GpuHealth:
    raw = _object(raw)
    health = GpuHealth(
        index=_count(raw, "index"),
        name=_text(raw, "name"),
        total_bytes=_count(raw, "total_bytes"),
        state=_text(raw, "state"),
        since=_float(raw, "since"),
        detail=_optional_text(raw, "detail"),
    )
    if health.state not in (GPU_OK, GPU_LOST):
        raise ValueError(f"GPU state {health.state!r} is unknown")
    return health


def _batch(raw: Any) -> BatchCounts:
    raw = _object(raw)
    return BatchCounts(
        done=_count(raw, "done"),
        failed=_count(raw, "failed"),
        cancelled=_count(raw, "cancelled"),
        updated_at=_float(raw, "updated_at"),
    )


# --- the usage table ------------------------------------------------------------------------


def _usage(value: Any, warnings: list[str] | None) -> dict[int, UserUsage]:
    """The per-user usage table; anything malformed in it is dropped (it only orders waiters)."""
    if value is None:
        return {}
    usage: dict[int, UserUsage] = {}
    items = list(value.items()) if isinstance(value, dict) else []
    for key, item in items[:MAX_USAGE_USERS]:
        if (
            isinstance(key, str)
            and key.isascii()
            and key.isdigit()
            and len(key) <= 10
            and isinstance(item, list)
            and len(item) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in item)
            and 0 <= item[0] < 1e30
            and 0 <= item[1] < 1e11
        ):
            usage[int(key)] = UserUsage(float(item[0]), float(item[1]))
    if warnings is not None and (not isinstance(value, dict) or len(usage) != len(value)):
        warnings.append("ledger: dropped malformed entries of the per-user usage table")
    return usage


# --- field checks ---------------------------------------------------------------------------


def _int(raw: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{key} must be an integer from {low} to {high}")
    return value


def _count(raw: Mapping[str, Any], key: str) -> int:
    """A counter or figure of the book (any integer a file could sensibly hold)."""
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**62) < value < 2**62:
        raise ValueError(f"{key} must be an integer")
    return value


def _optional_count(raw: Mapping[str, Any], key: str) -> int | None:
    return None if raw.get(key) is None else _count(raw, key)


def _float(raw: Mapping[str, Any], key: str) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e11:
        raise ValueError(f"{key} must be a timestamp")
    return float(value)


def _text(raw: Mapping[str, Any], key: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise ValueError(f"{key} must be a short string")
    return value


def _optional_text(raw: Mapping[str, Any], key: str) -> str | None:
    return None if raw.get(key) is None else _text(raw, key)


def _object(raw: Any) -> Mapping[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError("expected an object")
    return raw


def _list(value: Any, limit: int) -> list[Any]:
    if not isinstance(value, list) or len(value) > limit:
        raise ValueError(f"expected a list of at most {limit} items")
    return value


def _table(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or len(value) > 4096:
        raise ValueError("expected a table")
    if not all(isinstance(k, str) and len(k) <= 256 for k in value):
        raise ValueError("keys must be short strings")
    return value


#: The most jobs one entry may wait for (`after`, `after_ok`).
MAX_DEPENDENCIES = _MAX_TEXTS


def _text_list(raw: Mapping[str, Any], key: str) -> list[str]:
    value = raw.get(key)
    if (
        not isinstance(value, list)
        or len(value) > _MAX_TEXTS
        or not all(isinstance(v, str) and len(v) <= _MAX_TEXT for v in value)
    ):
        raise ValueError(f"{key} must be a list of short strings")
    return list(value)


def _lenient_text(value: Any) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= _MAX_TEXT else None


#: The longest `size_source` taken from an entry: gpuwait's own run to 190 characters or so
#: ("largest peak of 12 runs of this script (other arguments), ..., raised after an
#: out-of-memory failure, some measured approximately; capped at what 8 cards hold").
MAX_SIZE_SOURCE = 256


def _lenient_note(value: Any) -> str | None:
    """Where an entry's size came from, as gpuwait writes it: one short line. Another member
    may write anything there, which every user's `status` shows in the job's wait."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_SIZE_SOURCE:
        return None
    return value if value.isprintable() else None


def _lenient_texts(value: Any) -> list[str]:
    if not isinstance(value, list):
        return []
    return [v for v in value[:1024] if isinstance(v, str) and 0 < len(v) <= _MAX_TEXT]


def _pid_list(value: Any) -> list[int]:
    if (
        not isinstance(value, list)
        or len(value) > 65536
        or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2**31 for v in value)
    ):
        raise ValueError("pids must be a list of process ids")
    return list(value)


def _request(value: Any) -> dict[str, float | int]:
    if value == {}:
        return {}
    if isinstance(value, dict) and len(value) == 1:
        n_bytes = value.get("bytes")
        if type(n_bytes) is int and 0 < n_bytes < 2**62:
            return {"bytes": n_bytes}
        fraction = value.get("fraction")
        if (
            isinstance(fraction, (int, float))
            and not isinstance(fraction, bool)
            and 0 < fraction <= 1
        ):
            return {"fraction": float(fraction)}
    raise ValueError("request must be {'bytes': n}, {'fraction': f} or {}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e12


def _seconds(value: Any) -> float | None:
    if value is None:
        return None
    if not _number(value):
        raise ValueError("expected_seconds must be a number of seconds")
    return float(value)


def _seconds_or(value: Any, default: float) -> float:
    seconds = _seconds(value)
    return default if seconds is None else seconds


def _seconds_by_gpu(value: Any) -> dict[str, float]:
    if (
        not isinstance(value, dict)
        or len(value) > 1024
        or not all(isinstance(k, str) and _number(v) for k, v in value.items())
    ):
        raise ValueError("per-GPU figures must map GPU UUIDs to numbers")
    return {k: float(v) for k, v in value.items()}


_REQUIREMENT_CHECKS: dict[str, Callable[[Any], bool]] = {
    "min_total_bytes": lambda v: _number(v) and isinstance(v, int),
    "name_pattern": lambda v: isinstance(v, str) and len(v) <= _MAX_TEXT,
    "min_compute_capability": lambda v: (
        isinstance(v, list)
        and len(v) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 100 for n in v)
    ),
    "max_util_pct": lambda v: _number(v) and v <= 100,
}


def _requirements(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("requirements must be an object")
    for key, item in value.items():
        check = _REQUIREMENT_CHECKS.get(key)
        if check is None or not check(item):
            raise ValueError(f"requirement {key!r} is unknown or malformed")
    return dict(value)


def _observed(value: Any, name: str = "observed") -> dict[str, int]:
    if value is None:
        return {}
    if (
        not isinstance(value, dict)
        or len(value) > 1024
        or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62
            for k, v in value.items()
        )
    ):
        raise ValueError(f"{name} must map GPU UUIDs to byte counts")
    return dict(value)
