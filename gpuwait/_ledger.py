"""The ledger: one JSON file that every gpuwait process of a user shares. The queue *is* the ledger.

Each gpuwait process (waiting or running) owns one entry. All changes happen under an exclusive
lock on a sidecar lock file, and the file is replaced atomically, so readers without the lock
still see a whole file. Entries of processes that are gone, or whose pid now names another
process, are reaped by whichever gpuwait touches the ledger next.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwait import _events, _proc, _wake
from gpuwait._atomic import ensure_private_dir, keep_damaged, write_json_atomic
from gpuwait._bookkeeping import LOST, Book, Finished
from gpuwait._errors import StateError
from gpuwait._lock import exclusive
from gpuwait._policy import Claim, Requirements
from gpuwait._sizes import MemoryRequest
from gpuwait._snapshot import GpuSnapshot

SCHEMA = 1
WAITING = "waiting"
RUNNING = "running"
_MAX_TEXT = 4096


@dataclass
class Job:
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
        self, gpus: Sequence[GpuSnapshot], now: float | None = None, blocked: str | None = None
    ) -> Claim:
        """This entry for the policy, its usage read from the same snapshot as the GPUs.

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
            priority=self.priority,
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
        )

    def is_alive(self) -> bool:
        return _proc.is_alive(self.pid, self.start_time)

    @classmethod
    def from_json(cls, raw: Any) -> Job:
        """Validate one entry; raises ValueError naming what is wrong."""
        if not isinstance(raw, dict):
            raise ValueError("entry is not an object")
        job = cls(
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
        )
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
        if "bytes" in value and isinstance(value["bytes"], int) and 0 < value["bytes"] < 2**62:
            return {"bytes": value["bytes"]}
        fraction = value.get("fraction")
        if isinstance(fraction, (int, float)) and 0 < fraction <= 1:
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


@dataclass
class LedgerData:
    """The whole ledger file."""

    jobs: list[Job] = field(default_factory=list)
    next_order: int = 1
    rr_cursor: int = -1
    created_at: float = field(default_factory=time.time)
    #: Outcomes of finished jobs, per-GPU counters, GPU health, batch counts.
    book: Book = field(default_factory=Book)
    #: How many transactions freed room (see gpuwait._wake).
    release_seq: int = 0

    def find(self, job_id: str) -> Job | None:
        return next((j for j in self.jobs if j.id == job_id), None)

    def remove(self, job_id: str) -> Job | None:
        job = self.find(job_id)
        if job is not None:
            self.jobs.remove(job)
        return job

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "created_at": self.created_at,
            "next_order": self.next_order,
            "rr_cursor": self.rr_cursor,
            # vars(), not asdict(): the same JSON without asdict's deep copies.
            "jobs": [dict(vars(j)) for j in self.jobs],
            "book": self.book.to_json(),
            "release_seq": self.release_seq,
        }


class Ledger:
    """The ledger file and its lock, in one state directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / "ledger.json"
        self.lock_path = directory / "ledger.lock"
        #: Messages about damaged files and dropped entries, for the CLI to show once.
        self.warnings: list[str] = []
        #: Entries removed by the last transaction because their process was gone.
        self.reaped: list[Job] = []
        #: The file's change token and content as the last transaction left them.
        self.token: tuple[int, int, int] | None = None
        self.committed: LedgerData | None = None

    def change_token(self) -> tuple[int, int, int] | None:
        """Cheap fingerprint of the file: it changes whenever the ledger is rewritten."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def read(self) -> LedgerData:
        """The current ledger, without locking (writes are atomic) and without repairing it."""
        data, _ = self._load(repair=False)
        return data

    @contextmanager
    def transaction(self) -> Iterator[LedgerData]:
        """Lock, load (recovering damage), reap dead entries, yield; write back if changed."""
        with ExitStack() as held:
            try:
                ensure_private_dir(self.directory)
                held.enter_context(exclusive(self.lock_path))
            except OSError as exc:
                raise StateError(
                    f"state directory {self.directory} is not usable: {exc.strerror}",
                    hint="set GPUWAIT_STATE_DIR to a writable directory",
                ) from None
            try:
                data, raw = self._load(repair=True)
                before = _wake.fingerprint(data.jobs)
                self.reaped = [j for j in data.jobs if not j.is_alive()]
                for job in self.reaped:
                    data.jobs.remove(job)
                    self._note_reaped(data, job)
                yield data
                if _wake.released(before, _wake.fingerprint(data.jobs)):
                    data.release_seq += 1
                encoded = data.to_json()
                if encoded != raw or not _wake.wake_path(self.directory).exists():
                    write_json_atomic(self.path, encoded)
                    _wake.write_summary(self.directory, _wake.summary(data.jobs, data.release_seq))
                # Taken under the lock, so they describe exactly the file as it now is.
                self.token, self.committed = self.change_token(), data
            except OSError as exc:
                raise StateError(
                    f"ledger {self.path} cannot be written: {exc.strerror}",
                    hint="free disk space or set GPUWAIT_STATE_DIR to a writable directory",
                ) from None

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

    def _load(self, repair: bool) -> tuple[LedgerData, Any]:
        try:
            text = self.path.read_bytes()
        except FileNotFoundError:
            return LedgerData(), None
        except OSError as exc:
            raise StateError(f"ledger {self.path} cannot be read: {exc.strerror}") from None
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
                raise ValueError(f"schema {raw.get('schema') if isinstance(raw, dict) else '?'}")
            jobs_raw = raw.get("jobs")
            if not isinstance(jobs_raw, list):
                raise ValueError("no job list")
            data = LedgerData(
                next_order=_int(raw, "next_order", 0, 2**62),
                rr_cursor=raw["rr_cursor"] if isinstance(raw.get("rr_cursor"), int) else -1,
                created_at=_float(raw, "created_at"),
                release_seq=raw["release_seq"] if isinstance(raw.get("release_seq"), int) else 0,
            )
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            if repair:
                kept = keep_damaged(self.path)
                self.warnings.append(
                    f"ledger {self.path} was damaged ({exc}); kept it as {kept.name} and started afresh"
                )
            return LedgerData(), None
        try:
            data.book = Book.from_json(raw.get("book"))
        except (ValueError, RecursionError) as exc:
            if repair:
                self.warnings.append(
                    f"ledger {self.path}: its record of finished jobs and GPUs was damaged "
                    f"({exc}); started it afresh"
                )
        for entry in jobs_raw:
            try:
                data.jobs.append(Job.from_json(entry))
            except ValueError as exc:
                if repair:
                    self.warnings.append(f"ledger {self.path}: dropped an invalid entry ({exc})")
        ids = set()
        unique = []
        for job in data.jobs:
            if job.id not in ids:
                ids.add(job.id)
                unique.append(job)
        data.jobs = unique
        return data, raw
