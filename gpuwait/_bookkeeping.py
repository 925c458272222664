"""What the queue remembers besides its live entries, kept in the ledger under "book".

- finished: the last `FINISHED_KEPT` jobs that left the queue, with their outcome, so that
  `--after`/`--after-ok` can tell how a dependency ended;
- per-GPU counters since the ledger was created: jobs dispatched, completed, failed, and the
  completion times of the last few, from which a moving average of throughput is derived;
- GPU health: every GPU seen, and whether it answered at the last reading;
- per-batch counts of jobs done, failed and cancelled.

Every part is read defensively: a damaged part is dropped and started afresh (with a warning)
without touching the queue itself.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from gpuwait._record import Record, field
from gpuwait._snapshot import MachineSnapshot

FINISHED_KEPT = 100
BATCHES_KEPT = 100
#: Completions per GPU over which throughput is averaged, and how many it takes at least.
THROUGHPUT_WINDOW = 20
THROUGHPUT_MIN_ENDS = 5
#: A GPU lost for this long with nothing on it is forgotten (removed from the machine).
FORGET_LOST_AFTER = 24 * 3600.0

OK = "ok"
FAILED = "failed"
CANCELLED = "cancelled"
#: The gpuwait process vanished (killed by SIGKILL, machine crash): its entry was reaped.
LOST = "lost"
TIMED_OUT = "timeout"
INTERRUPTED = "interrupted"
#: `--after-ok` named a job that did not succeed, so this one never started.
DEPENDENCY_FAILED = "dependency-failed"
OUTCOMES = (OK, FAILED, CANCELLED, LOST, TIMED_OUT, INTERRUPTED, DEPENDENCY_FAILED)

GPU_OK = "ok"
GPU_LOST = "lost"


class Finished(Record):
    """A job that left the queue."""

    id: str
    outcome: str
    finished_at: float
    name: str | None = None
    batch: str | None = None
    exit_status: int | None = None
    signal: int | None = None

    @property
    def succeeded(self) -> bool:
        return self.outcome == OK

    def describe(self) -> str:
        if self.outcome == FAILED and self.signal is not None:
            return f"killed by signal {self.signal}"
        if self.outcome == FAILED:
            return f"failed with exit status {self.exit_status}"
        return {
            OK: "succeeded",
            CANCELLED: "was cancelled",
            LOST: "was lost (its gpuwait process vanished)",
            TIMED_OUT: "gave up waiting",
            INTERRUPTED: "was interrupted while waiting",
            DEPENDENCY_FAILED: "never started (a job it depended on did not succeed)",
        }.get(self.outcome, self.outcome)


class GpuCounters(Record):
    dispatched: int = 0
    completed: int = 0
    failed: int = 0
    #: End times of the last THROUGHPUT_WINDOW jobs that ended there.
    recent_ends: list[float] = field(default_factory=list)

    def per_hour(self) -> float | None:
        """Jobs ended per hour over the recent ends; None with too few to mean anything."""
        ends = self.recent_ends
        if len(ends) < THROUGHPUT_MIN_ENDS or ends[-1] <= ends[0]:
            return None
        return (len(ends) - 1) * 3600.0 / (ends[-1] - ends[0])


class GpuHealth(Record):
    index: int
    name: str
    total_bytes: int
    state: str
    since: float
    detail: str | None = None


class BatchCounts(Record):
    done: int = 0
    failed: int = 0
    cancelled: int = 0
    updated_at: float = 0.0


class Book(Record):
    finished: list[Finished] = field(default_factory=list)
    gpus: dict[str, GpuCounters] = field(default_factory=dict)
    health: dict[str, GpuHealth] = field(default_factory=dict)
    #: The backend the health was read from; another backend starts a fresh record.
    health_backend: str | None = None
    batches: dict[str, BatchCounts] = field(default_factory=dict)

    # -- changes ---------------------------------------------------------------------------

    def note_admitted(self, gpu_uuids: Sequence[str]) -> None:
        for uuid in gpu_uuids:
            self.gpus.setdefault(uuid, GpuCounters()).dispatched += 1

    def note_finished(self, done: Finished, gpu_uuids: Sequence[str] = ()) -> None:
        """Record how a job left; `gpu_uuids` are where it ran (none if it never started)."""
        self.finished = [f for f in self.finished if f.id != done.id][-(FINISHED_KEPT - 1) :]
        self.finished.append(done)
        for uuid in gpu_uuids:
            counters = self.gpus.setdefault(uuid, GpuCounters())
            if done.succeeded:
                counters.completed += 1
            else:
                counters.failed += 1
            counters.recent_ends = [*counters.recent_ends, done.finished_at][-THROUGHPUT_WINDOW:]
        if done.batch is not None:
            counts = self.batches.setdefault(done.batch, BatchCounts())
            if done.succeeded:
                counts.done += 1
            elif done.outcome == CANCELLED:
                counts.cancelled += 1
            else:
                counts.failed += 1
            counts.updated_at = done.finished_at
            if len(self.batches) > BATCHES_KEPT:
                oldest = min(self.batches, key=lambda b: self.batches[b].updated_at)
                del self.batches[oldest]

    def note_health(
        self, snapshot: MachineSnapshot, busy: frozenset[str], now: float | None = None
    ) -> list[dict[str, Any]]:
        """Compare a reading with the GPUs seen before; return events for what changed.

        A GPU seen before and missing now is lost (NVML answered an error for it, or it left);
        one that answers again is back; one never seen while others were is hot-added. `busy`
        are the UUIDs with running jobs, which keep a lost GPU remembered.
        """
        now = time.time() if now is None else now
        events: list[dict[str, Any]] = []
        if self.health_backend != snapshot.backend:
            self.health, self.health_backend = {}, snapshot.backend
        first_reading = not self.health
        present = {g.uuid for g in snapshot.gpus}
        for gpu in snapshot.gpus:
            known = self.health.get(gpu.uuid)
            if known is None and not first_reading:
                events.append({"kind": "gpu_added", "gpu": gpu.uuid, "index": gpu.index})
            elif known is not None and known.state != GPU_OK:
                events.append({"kind": "gpu_back", "gpu": gpu.uuid, "index": gpu.index})
            if known is None or known.state != GPU_OK or known.index != gpu.index:
                self.health[gpu.uuid] = GpuHealth(
                    gpu.index, gpu.name, gpu.total_bytes, GPU_OK, now, None
                )
        for uuid, known in list(self.health.items()):
            if uuid in present:
                continue
            if known.state == GPU_OK:
                detail = _warning_for(snapshot.warnings, known.index)
                self.health[uuid] = GpuHealth(
                    known.index, known.name, known.total_bytes, GPU_LOST, now, detail
                )
                events.append(
                    {"kind": "gpu_lost", "gpu": uuid, "index": known.index, "detail": detail}
                )
            elif now - known.since > FORGET_LOST_AFTER and uuid not in busy:
                del self.health[uuid]
        return events

    # -- questions -------------------------------------------------------------------------

    def health_would_change(
        self, snapshot: MachineSnapshot, busy: frozenset[str], now: float | None = None
    ) -> bool:
        """Would `note_health` change anything? (Without changing this book.)"""
        probe = Book(health=dict(self.health), health_backend=self.health_backend)
        events = probe.note_health(snapshot, busy, now)
        return (
            bool(events)
            or probe.health != self.health
            or probe.health_backend != self.health_backend
        )

    def outcome(self, job_id: str) -> Finished | None:
        return next((f for f in reversed(self.finished) if f.id == job_id), None)

    def lost_gpus(self) -> dict[str, GpuHealth]:
        return {u: h for u, h in self.health.items() if h.state != GPU_OK}

    # -- storage ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        # vars() rather than dataclasses.asdict: every field is a plain value (or a list of
        # them), and asdict's deep copies cost more than the rest of a ledger transaction.
        return {
            "finished": [dict(vars(f)) for f in self.finished],
            "gpus": {u: dict(vars(c)) for u, c in self.gpus.items()},
            "health": {u: dict(vars(h)) for u, h in self.health.items()},
            "health_backend": self.health_backend,
            "batches": {b: dict(vars(c)) for b, c in self.batches.items()},
        }

    @classmethod
    def from_json(cls, raw: Any) -> Book:
        """Parse the "book" part of the ledger; raises ValueError naming what is wrong."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError("not an object")
        backend = raw.get("health_backend")
        if backend is not None and not isinstance(backend, str):
            raise ValueError("health_backend must be a string")
        return cls(
            finished=[_finished(f) for f in _list(raw.get("finished", []), FINISHED_KEPT)],
            gpus={u: _counters(c) for u, c in _table(raw.get("gpus", {})).items()},
            health={u: _health(h) for u, h in _table(raw.get("health", {})).items()},
            health_backend=backend,
            batches={b: _batch(c) for b, c in _table(raw.get("batches", {})).items()},
        )


def _warning_for(warnings: Sequence[str], index: int) -> str | None:
    """The backend's words about GPU `index` ("GPU 2: GPU is lost (NVML error 15); skipped")."""
    for text in warnings:
        head, _, rest = text.partition(":")
        if head.split(" (")[0] == f"GPU {index}":
            return rest.strip().removesuffix("; skipped")
    return None


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


def _int(raw: Mapping[str, Any], key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**62) < value < 2**62:
        raise ValueError(f"{key} must be an integer")
    return value


def _time(raw: Mapping[str, Any], key: str) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e11:
        raise ValueError(f"{key} must be a timestamp")
    return float(value)


def _text(raw: Mapping[str, Any], key: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or len(value) > 4096:
        raise ValueError(f"{key} must be a short string")
    return value


def _optional_int(raw: Mapping[str, Any], key: str) -> int | None:
    return None if raw.get(key) is None else _int(raw, key)


def _optional_text(raw: Mapping[str, Any], key: str) -> str | None:
    return None if raw.get(key) is None else _text(raw, key)


def _object(raw: Any) -> Mapping[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError("expected an object")
    return raw


def _finished(raw: Any) -> Finished:
    raw = _object(raw)
    done = Finished(
        id=_text(raw, "id"),
        outcome=_text(raw, "outcome"),
        finished_at=_time(raw, "finished_at"),
        name=_optional_text(raw, "name"),
        batch=_optional_text(raw, "batch"),
        exit_status=_optional_int(raw, "exit_status"),
        signal=_optional_int(raw, "signal"),
    )
    if done.outcome not in OUTCOMES:
        raise ValueError(f"outcome {done.outcome!r} is unknown")
    return done


def _counters(raw: Any) -> GpuCounters:
    raw = _object(raw)
    ends = _list(raw.get("recent_ends", []), THROUGHPUT_WINDOW)
    return GpuCounters(
        dispatched=_int(raw, "dispatched"),
        completed=_int(raw, "completed"),
        failed=_int(raw, "failed"),
        recent_ends=[_time({"t": t}, "t") for t in ends],
    )


def _health(raw: Any) -> GpuHealth:
    raw = _object(raw)
    health = GpuHealth(
        index=_int(raw, "index"),
        name=_text(raw, "name"),
        total_bytes=_int(raw, "total_bytes"),
        state=_text(raw, "state"),
        since=_time(raw, "since"),
        detail=_optional_text(raw, "detail"),
    )
    if health.state not in (GPU_OK, GPU_LOST):
        raise ValueError(f"GPU state {health.state!r} is unknown")
    return health


def _batch(raw: Any) -> BatchCounts:
    raw = _object(raw)
    return BatchCounts(
        done=_int(raw, "done"),
        failed=_int(raw, "failed"),
        cancelled=_int(raw, "cancelled"),
        updated_at=_time(raw, "updated_at"),
    )
