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
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpuwait import _proc
from gpuwait._atomic import ensure_private_dir, keep_damaged, write_json_atomic
from gpuwait._errors import StateError
from gpuwait._lock import exclusive
from gpuwait._policy import Claim
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

    def memory_request(self) -> MemoryRequest | None:
        if "bytes" in self.request:
            return MemoryRequest(bytes=int(self.request["bytes"]))
        if "fraction" in self.request:
            return MemoryRequest(fraction=float(self.request["fraction"]))
        return None

    def claim(self, gpus: Sequence[GpuSnapshot]) -> Claim:
        """This entry for the policy, its usage read from the same snapshot as the GPUs.

        Taking `observed` from the snapshot (not from the ledger's last published figure) keeps
        `external` and `committed` consistent with each other: nothing is counted twice, and
        nothing allocated since the snapshot can be subtracted from a reading that lacks it.
        """
        pids = set(self.pids)
        if self.child_pid is not None:
            pids.add(self.child_pid)
        observed = {g.uuid: g.process_bytes(pids) for g in gpus if g.uuid in self.gpu_uuids}
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
            "jobs": [asdict(j) for j in self.jobs],
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
                self.reaped = [j for j in data.jobs if not j.is_alive()]
                for job in self.reaped:
                    data.jobs.remove(job)
                yield data
                encoded = data.to_json()
                if encoded != raw:
                    write_json_atomic(self.path, encoded)
            except OSError as exc:
                raise StateError(
                    f"ledger {self.path} cannot be written: {exc.strerror}",
                    hint="free disk space or set GPUWAIT_STATE_DIR to a writable directory",
                ) from None

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
            )
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            if repair:
                kept = keep_damaged(self.path)
                self.warnings.append(
                    f"ledger {self.path} was damaged ({exc}); kept it as {kept.name} and started afresh"
                )
            return LedgerData(), None
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
