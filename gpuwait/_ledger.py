"""The ledger: one JSON file that every gpuwait process of a user (or, in a shared ledger
directory, of a group of users) shares. The queue *is* the ledger.

Each gpuwait process (waiting or running) owns one entry. All changes happen under an exclusive
lock on a sidecar lock file, and the file is replaced atomically, so readers never see half a
file. Entries of processes that are gone, or whose pid now names another process, are reaped by
whichever gpuwait touches the ledger next; entries that name another user's process are dropped
as forged. The file holds data only, never anything executed, and every field is validated on
read, within caps on the file's size and its number of entries (in all and per user).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwait import _events, _proc, _wake
from gpuwait._atomic import ensure_private_dir, keep_damaged, write_atomic
from gpuwait._bookkeeping import LOST, Book, Finished
from gpuwait._errors import StateError
from gpuwait._ledgercache import EncodedEntries, ValidatedEntries
from gpuwait._lock import LockTimeout, flock_within
from gpuwait._policy import Claim, Requirements
from gpuwait._record import Record, field
from gpuwait._security import (
    check_dir,
    entry_owner_mismatch,
    is_shared_dir,
    open_state_file,
    printable,
)
from gpuwait._sizes import MemoryRequest
from gpuwait._snapshot import GpuSnapshot

if TYPE_CHECKING:
    from gpuwait._config import Settings

SCHEMA = 1
WAITING = "waiting"
RUNNING = "running"
_MAX_TEXT = 4096


class Job(Record):
    """One ledger entry."""

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
    observed: dict[str, int] = field(default_factory=dict)
    #: The command's process tree at the last sample; the policy reads their memory from NVML.
    pids: list[int] = field(default_factory=list)
    child_pid: int | None = None
    submitted_at: float = 0.0
    started_at: float | None = None
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
    checkpoint_signal: str = "USR1"
    grace_seconds: float = 120.0
    grace_kill: bool = False
    pauses: int = 0
    pause_requested_at: float | None = None
    pause_requested_by: str | None = None
    pause_signalled_at: float | None = None
    #: Priority of the job that paused this one: a resumed job queues at least that high, so a
    #: stream of urgent jobs cannot starve it; it waits until that job has started (`yield_to`).
    boost: int = 0
    yield_to: str | None = None
    #: Seconds this command takes to load to its peak (history), the cost of pausing it.
    load_seconds: float | None = None

    def memory_request(self) -> MemoryRequest | None:
        if "bytes" in self.request:
            return MemoryRequest(bytes=int(self.request["bytes"]))
        if "fraction" in self.request:
            return MemoryRequest(fraction=float(self.request["fraction"]))
        return None

    def requirements_for_policy(self) -> Requirements:
        r = self.requirements
        capability = r.get("min_compute_capability")
        return Requirements(
            min_total_bytes=r.get("min_total_bytes"),
            name_pattern=r.get("name_pattern"),
            min_compute_capability=None if capability is None else (capability[0], capability[1]),
            max_util_pct=r.get("max_util_pct"),
        )

    def claim(
        self,
        gpus: Sequence[GpuSnapshot],
        now: float | None = None,
        blocked: str | None = None,
        usage: float = 0.0,
    ) -> Claim:
        """This entry for the policy, its usage read from the same snapshot as the GPUs.

        `usage` is the owner's fair-share usage (see gpuwait._fairness), which orders waiters of
        one priority between users.

        Taking `observed` from the snapshot (not from the ledger's last published figure) keeps
        `external` and `committed` consistent with each other: nothing is counted twice, and
        nothing allocated since the snapshot can be subtracted from a reading that lacks it.
        A running job's expected time is what is left of it at `now` (never below zero).
        """
        pids = set(self.pids)
        if self.child_pid is not None:
            pids.add(self.child_pid)
        observed = {g.uuid: g.process_bytes(pids) for g in gpus if g.uuid in self.gpu_uuids}
        expected = self.expected_seconds
        expected_by_gpu = self.expected_by_gpu
        if self.state == RUNNING and self.started_at is not None:
            elapsed = max(0.0, (time.time() if now is None else now) - self.started_at)
            if expected is not None:
                expected = max(0.0, expected - elapsed)
            expected_by_gpu = {u: max(0.0, s - elapsed) for u, s in expected_by_gpu.items()}
        return Claim(
            job_id=self.id,
            running=self.state == RUNNING,
            priority=max(self.priority, self.boost),
            order=self.order,
            request=self.memory_request(),
            gpus_wanted=self.gpus,
            candidates=frozenset(self.candidates) if self.candidates is not None else None,
            pick=self.pick,
            gpu_uuids=tuple(self.gpu_uuids),
            reserved_bytes=self.reserved_bytes,
            observed=observed,
            pids=frozenset(pids),
            requirements=self.requirements_for_policy(),
            blocked=blocked,
            expected_seconds=expected,
            expected_by_gpu=dict(expected_by_gpu),
            held=tuple(self.held_gpus),
            weights=dict(self.weights),
            uid=self.uid,
            usage=usage,
        )

    def is_alive(self) -> bool:
        return _proc.is_alive(self.pid, self.start_time)

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
            observed=_observed(raw.get("observed")),
            pids=_pid_list(raw.get("pids", [])),
            child_pid=None if raw.get("child_pid") is None else _int(raw, "child_pid", 1, 2**31),
            submitted_at=_float(raw, "submitted_at"),
            started_at=None if raw.get("started_at") is None else _float(raw, "started_at"),
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
            else "USR1",
            grace_seconds=_seconds(raw.get("grace_seconds")) or 0.0,
            grace_kill=raw.get("grace_kill") is True,
            pauses=_int(raw, "pauses", 0, 10_000) if "pauses" in raw else 0,
            pause_requested_at=_seconds(raw.get("pause_requested_at")),
            pause_requested_by=(
                None if raw.get("pause_requested_by") is None else _text(raw, "pause_requested_by")
            ),
            pause_signalled_at=_seconds(raw.get("pause_signalled_at")),
            boost=_int(raw, "boost", 0, 5) if "boost" in raw else 0,
            yield_to=None if raw.get("yield_to") is None else _text(raw, "yield_to"),
            load_seconds=_seconds(raw.get("load_seconds")),
        )
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


def _int(raw: dict[str, Any], key: str, low: int, high: int) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{key} must be an integer from {low} to {high}")
    return value


def _float(raw: dict[str, Any], key: str) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e11:
        raise ValueError(f"{key} must be a timestamp")
    return float(value)


def _text(raw: dict[str, Any], key: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise ValueError(f"{key} must be a short string")
    return value


def _text_list(raw: dict[str, Any], key: str) -> list[str]:
    value = raw.get(key)
    if (
        not isinstance(value, list)
        or len(value) > 1024
        or not all(isinstance(v, str) and len(v) <= _MAX_TEXT for v in value)
    ):
        raise ValueError(f"{key} must be a list of short strings")
    return list(value)


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


def _observed(value: Any) -> dict[str, int]:
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
        raise ValueError("observed must map GPU UUIDs to byte counts")
    return dict(value)


def _copy_job(job: Job) -> Job:
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

#: Entries validated, and entries encoded, by this process: see gpuwait._ledgercache.
_VALIDATED = ValidatedEntries(Job.from_json, _copy_job)
_ENCODED = EncodedEntries()
#: The entries' processes, looked at in every transaction (see gpuwait._proc.LivenessReader).
_LIVENESS = _proc.LivenessReader()


def _forget_cached_entries() -> None:
    """As if this process had never read or written a ledger (tests and benchmarks)."""
    _VALIDATED.forget()
    _ENCODED.forget()
    _LIVENESS.close()


class UserUsage(Record):
    """A user's past use of VRAM, in byte-seconds, as it stood at `at` (it decays from there)."""

    vram_seconds: float
    at: float


class LedgerData(Record):
    """The whole ledger file."""

    jobs: list[Job] = field(default_factory=list)
    next_order: int = 1
    rr_cursor: int = -1
    created_at: float = field(default_factory=time.time)
    #: Outcomes of finished jobs, per-GPU counters, GPU health, batch counts.
    book: Book = field(default_factory=Book)
    #: How many transactions freed room (see gpuwait._wake).
    release_seq: int = 0
    #: Decayed VRAM-time of finished jobs, per uid (fair share between users).
    usage: dict[int, UserUsage] = field(default_factory=dict)

    def find(self, job_id: str) -> Job | None:
        return next((j for j in self.jobs if j.id == job_id), None)

    def remove(self, job_id: str) -> Job | None:
        job = self.find(job_id)
        if job is not None:
            self.jobs.remove(job)
        return job

    def to_json(self) -> dict[str, Any]:
        encoded: dict[str, Any] = {
            "schema": SCHEMA,
            "created_at": self.created_at,
            "next_order": self.next_order,
            "rr_cursor": self.rr_cursor,
            # vars(), not asdict(): the same JSON without asdict's deep copies.
            "jobs": [dict(vars(j)) for j in self.jobs],
            "book": self.book.to_json(),
            "release_seq": self.release_seq,
        }
        if self.usage:
            encoded["usage"] = {
                str(uid): [u.vram_seconds, u.at] for uid, u in sorted(self.usage.items())
            }
        return encoded


#: Limits on what a ledger file may hold. Any member of a shared ledger's group can write it, so
#: nothing in it may cost unbounded time or memory to read.
MAX_FILE_BYTES = 16 << 20
MAX_ENTRIES = 8192
MAX_ENTRIES_PER_UID = 1024
MAX_USAGE_USERS = 4096

_TEMP_RE = re.compile(r"^\.(?:ledger|wake)\.json\.([0-9]+)\.tmp$")
_CRC_PREFIX = b'{"crc":'


class Ledger:
    """The ledger file and its lock, in one directory.

    A private ledger (the default: the user's state dir, 0700) is replaced by rename on every
    change. A shared ledger (`ledger_dir` naming a group-writable directory with the sticky bit)
    cannot be: the sticky bit forbids renaming over another user's file. It is rewritten in
    place under the lock instead, into two copies in turn (`ledger.json.journal`, then
    `ledger.json`), each carrying a checksum; a copy torn by a writer killed halfway is told by
    its checksum and the other copy is used, by writers and by lock-free readers alike.
    """

    def __init__(
        self, directory: Path, *, must_exist: bool = False, lock_timeout: float | None = 60.0
    ) -> None:
        self.directory = directory
        self.path = directory / "ledger.json"
        self.journal_path = directory / "ledger.json.journal"
        self.lock_path = directory / "ledger.lock"
        #: An explicitly configured ledger dir must exist (an administrator creates a shared one).
        self.must_exist = must_exist
        self.lock_timeout = lock_timeout
        #: None until the directory was looked at; then whether it is a shared ledger dir.
        self.shared: bool | None = None
        self._group: int | None = None
        #: Messages about damaged files and dropped entries, for the CLI to show once.
        self.warnings: list[str] = []
        #: Entries removed by the last transaction because their process was gone.
        self.reaped: list[Job] = []
        #: The file's change token and content as the last transaction left them.
        self.token: tuple[int, int, int] | None = None
        self.committed: LedgerData | None = None
        #: Entries dropped by the last transaction as forged (their process is another user's).
        self.forged: list[Job] = []

    def change_token(self) -> tuple[int, int, int] | None:
        """Cheap fingerprint of the file: it changes whenever the ledger is rewritten."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def read(self) -> LedgerData:
        """The current ledger, without locking and without repairing it."""
        try:
            self._prepare(create=False)
        except FileNotFoundError:
            return LedgerData()
        except OSError as exc:
            raise self._unusable(exc) from None
        data, raw, _ = self._load(repair=False)
        # A shared ledger is rewritten in place, one copy at a time and each with a checksum,
        # so at least one copy is whole at any moment and _load takes it. Only when both
        # changed under this reader (two writers in a row) are both torn: read again. (A
        # shared lock would be simpler, but hundreds of polling readers would starve writers.)
        for _ in range(2):
            if not self.shared or raw is not None or not self.path.exists():
                break
            data, raw, _ = self._load(repair=False)
        return data

    @contextmanager
    def transaction(self) -> Iterator[LedgerData]:
        """Lock, load (recovering damage), reap dead entries, yield; write back if changed."""
        try:
            self._prepare(create=True)
        except OSError as exc:
            raise self._unusable(exc) from None
        to_wake: set[int] = set()
        with self._locked(fcntl.LOCK_EX):
            try:
                data, raw, rewrite = self._load(repair=True)
                before = _wake.fingerprint(data.jobs)
                present = {j.id: (j.state, j.pid) for j in data.jobs}
                alive = _LIVENESS.alive([(j.pid, j.start_time) for j in data.jobs])
                self.reaped = [
                    j for j, running in zip(data.jobs, alive, strict=True) if not running
                ]
                for job in self.reaped:
                    data.jobs.remove(job)
                    self._note_reaped(data, job)
                self.forged = [j for j in data.jobs if entry_owner_mismatch(j) is not None]
                for job in self.forged:
                    data.jobs.remove(job)
                    self.warnings.append(
                        f"ledger {self.path}: dropped entry {printable(job.id, 16)}: it claims uid {job.uid} "
                        f"but its process {job.pid} belongs to another user"
                    )
                if not self.shared:
                    self._prune_temp_files()
                yield data
                release = _wake.released(before, _wake.fingerprint(data.jobs))
                if release:
                    data.release_seq += 1
                encoded = data.to_json()
                if rewrite or encoded != raw or not _wake.wake_path(self.directory).exists():
                    self._write(encoded)
                    self._write_summary(_wake.summary(data.jobs, data.release_seq))
                    quiet = frozenset(j.id for j in (*self.reaped, *self.forged))
                    to_wake = _wake.concerned(present, data.jobs, quiet, release)
                # Taken under the lock, so they describe exactly the file as it now is.
                self.token, self.committed = self.change_token(), data
            except OSError as exc:
                raise StateError(
                    f"ledger {self.path} cannot be written: {exc.strerror}",
                    hint="free disk space or set GPUWAIT_STATE_DIR to a writable directory",
                ) from None
        # Once the lock is free: a woken waiter's first move may be to take it.
        _wake.kick(to_wake)

    def _note_reaped(self, data: LedgerData, job: Job) -> None:
        """A vanished gpuwait process: its job counts as lost (failed, where it ran)."""
        data.book.note_finished(
            Finished(
                id=job.id, outcome=LOST, finished_at=time.time(), name=job.name, batch=job.batch
            ),
            job.gpu_uuids if job.state == RUNNING else (),
        )
        _events.emit(
            self.directory, "reap", job=job.id, pid=job.pid, state=job.state, gpus=job.gpu_uuids
        )

    def _write_summary(self, content: dict[str, Any]) -> None:
        """wake.json beside the ledger. In a shared (sticky) directory it cannot be replaced by
        rename when another user wrote it last, so it is rewritten in place there; a reader
        that catches it half-written finds no valid summary and plans, which is safe."""
        body = json.dumps(content, separators=(",", ":")).encode()
        # Waiters act on the summary's content alone, and most changes (a job's new sample, a
        # waiter's reason) leave it as it was: rewriting it then would cost a rename (or, in a
        # shared directory, wake every watching waiter) for nothing.
        if _holds(_wake.wake_path(self.directory), body):
            return
        if not self.shared:
            _wake.write_summary(self.directory, body)
            return
        with contextlib.suppress(OSError):
            _write_in_place(_wake.wake_path(self.directory), body, self._group)

    # -- the directory and the lock ----------------------------------------------------------

    def _unusable(self, exc: OSError) -> StateError:
        if isinstance(exc, FileNotFoundError) and self.must_exist:
            return StateError(
                f"ledger directory {self.directory} does not exist",
                hint="an administrator creates a shared one (see README, 'Shared servers'), "
                "or unset ledger_dir to use your own",
            )
        return StateError(
            f"ledger directory {self.directory} is not usable: {exc.strerror}",
            hint="set GPUWAIT_STATE_DIR (or ledger_dir) to a safe, writable directory",
        )

    def _prepare(self, create: bool) -> None:
        """Look at the directory once: refuse an unsafe one, tell private from shared."""
        if self.shared is not None:
            return
        try:
            st = os.lstat(self.directory)
        except FileNotFoundError:
            if self.must_exist or not create:
                raise
            ensure_private_dir(self.directory)
            st = os.lstat(self.directory)
        shared = is_shared_dir(st)
        check_dir(self.directory, st, private=not shared)
        self.shared = shared
        self._group = st.st_gid if shared else None

    @contextmanager
    def _locked(self, operation: int) -> Iterator[None]:
        mode = 0o660 if self.shared else 0o600
        try:
            fd = open_state_file(self.lock_path, mode, shared_gid=self._group)
        except OSError as exc:
            raise self._unusable(exc) from None
        try:
            try:
                flock_within(fd, operation, self.lock_timeout)
            except LockTimeout:
                raise StateError(
                    f"the ledger lock {self.lock_path} was held by another process for "
                    f"{self.lock_timeout:g}s; giving up",
                    hint="a hung or stopped gpuwait holds it: find it with `fuser "
                    f"{self.lock_path}` (lock_timeout sets the wait)",
                ) from None
            yield
        finally:
            os.close(fd)

    def _prune_temp_files(self) -> None:
        """Temporary files of writers killed halfway through a write."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            match = _TEMP_RE.match(name)
            if match and _proc.start_time(int(match.group(1))) is None:
                with contextlib.suppress(OSError):
                    os.unlink(self.directory / name)

    # -- reading -----------------------------------------------------------------------------

    def _read_bytes(self, path: Path) -> bytes | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StateError(
                    f"ledger {path} is a symlink; gpuwait refuses it",
                    hint=f"remove the link ({path}) so gpuwait can write a real file",
                ) from None
            raise StateError(f"ledger {path} cannot be read: {exc.strerror}") from None
        try:
            chunks = []
            size = 0
            while size <= MAX_FILE_BYTES:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            return b"".join(chunks)
        except OSError as exc:
            raise StateError(f"ledger {path} cannot be read: {exc.strerror}") from None
        finally:
            os.close(fd)

    def _load(self, repair: bool) -> tuple[LedgerData, Any, bool]:
        """(data, the raw JSON it was read from, whether the file must be rewritten anyway)."""
        text = self._read_bytes(self.path)
        problem: str | None = None
        if text is not None:
            try:
                return (*self._decode(text, repair), False)
            except ValueError as exc:
                problem = str(exc)
        if self.shared:
            # A writer killed halfway through ledger.json leaves the journal whole, and the
            # reverse: the journal is always written completely before ledger.json is touched.
            journal = self._read_bytes(self.journal_path)
            if journal is not None:
                try:
                    data, raw = self._decode(journal, repair)
                    return data, raw, True
                except ValueError:
                    pass
        if text is None:
            return LedgerData(), None, False
        if repair:
            kept = self._keep_damaged(text)
            self.warnings.append(
                f"ledger {self.path} was damaged ({problem}); kept it as {kept} and started afresh"
            )
        return LedgerData(), None, True

    def _decode(self, text: bytes, repair: bool) -> tuple[LedgerData, Any]:
        """Parse and validate a whole file; ValueError when it is damaged."""
        if len(text) > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES >> 20} MiB")
        text = _check_crc(text)
        try:
            raw = json.loads(text)
        except (UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(type(exc).__name__) from None
        if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
            schema = raw.get("schema") if isinstance(raw, dict) else "?"
            if type(schema) is int and schema > SCHEMA:
                raise ValueError(
                    f"schema {schema}, written by a newer gpuwait than this one (schema "
                    f"{SCHEMA}): update gpuwait wherever this ledger is used"
                )
            raise ValueError(f"schema {schema}")
        jobs_raw = raw.get("jobs")
        if not isinstance(jobs_raw, list):
            raise ValueError("no job list")
        data = LedgerData(
            next_order=_int(raw, "next_order", 0, 2**62),
            rr_cursor=raw["rr_cursor"] if isinstance(raw.get("rr_cursor"), int) else -1,
            created_at=_float(raw, "created_at"),
            usage=_usage(raw.get("usage"), self.warnings if repair else None),
            release_seq=raw["release_seq"] if isinstance(raw.get("release_seq"), int) else 0,
        )
        try:
            data.book = Book.from_json(raw.get("book"))
        except (ValueError, RecursionError) as exc:
            if repair:
                self.warnings.append(
                    f"ledger {self.path}: its record of finished jobs and GPUs was damaged "
                    f"({exc}); started it afresh"
                )
        dropped: list[str] = []
        ids: set[str] = set()
        per_uid: dict[int, int] = {}
        # Running entries first, so that a cap drops waiters rather than reservations.
        parsed, invalid = _VALIDATED.validate_all(jobs_raw[: MAX_ENTRIES * 2])
        dropped += invalid
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
            dropped += [
                f"id {printable(j.id, 16)} is claimed by several users"
                for j in parsed
                if j.id in claimed
            ]
            parsed = [j for j in parsed if j.id not in claimed]
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
        if dropped and repair:
            more = f" and {len(dropped) - 1} more" if len(dropped) > 1 else ""
            self.warnings.append(
                f"ledger {self.path}: dropped {len(dropped)} invalid "
                f"entr{'y' if len(dropped) == 1 else 'ies'} ({dropped[0]}{more})"
            )
        return data, raw

    def _keep_damaged(self, text: bytes) -> str:
        """Keep the damaged bytes beside the ledger as evidence; return the copy's name."""
        if not self.shared:
            return keep_damaged(self.path).name
        # In a sticky directory the damaged file may be another user's: copy, never rename.
        name = f"{self.path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        fd = os.open(
            self.directory / name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o640,
        )
        try:
            os.fchmod(fd, 0o640)
            os.write(fd, text)
        finally:
            os.close(fd)
        return name

    # -- writing -----------------------------------------------------------------------------

    def _write(self, encoded: dict[str, Any]) -> None:
        body = _ENCODED.encode(encoded)
        if not self.shared:
            write_atomic(self.path, body)
            return
        data = b'{"crc":%d,' % zlib.crc32(body) + body[1:]
        for path in (self.journal_path, self.path):
            _write_in_place(path, data, self._group)


def _check_crc(text: bytes) -> bytes:
    """A file written with a checksum must match it (a torn in-place write does not)."""
    if not text.startswith(_CRC_PREFIX):
        return text
    comma = text.find(b",", len(_CRC_PREFIX), len(_CRC_PREFIX) + 12)
    if comma < 0:
        raise ValueError("checksum unreadable")
    try:
        expected = int(text[len(_CRC_PREFIX) : comma])
    except ValueError:
        raise ValueError("checksum unreadable") from None
    body = b"{" + text[comma + 1 :]
    if zlib.crc32(body) != expected:
        raise ValueError("checksum mismatch: a write was cut short")
    return body


def _holds(path: Path, data: bytes) -> bool:
    """True when the file at `path` holds exactly `data`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.read(fd, len(data) + 1) == data
    except OSError:
        return False
    finally:
        os.close(fd)


def _write_in_place(path: Path, data: bytes, group: int | None) -> None:
    """Overwrite `path` with `data`. Space is reserved first, so a full disk fails before a byte
    of the old content is touched."""
    fd = open_state_file(path, 0o660, shared_gid=group)
    try:
        size = os.fstat(fd).st_size
        if len(data) > size:
            os.posix_fallocate(fd, 0, len(data))
        view = memoryview(data)
        offset = 0
        while offset < len(data):
            offset += os.pwrite(fd, view[offset:], offset)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


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


def ledger_for(settings: Settings) -> Ledger:
    """The ledger the settings name: `ledger_dir` when set (it must exist), else the state dir."""
    explicit = bool(settings["ledger_dir"])
    return Ledger(settings.ledger_dir, must_exist=explicit, lock_timeout=settings["lock_timeout"])
