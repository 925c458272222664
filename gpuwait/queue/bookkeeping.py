"""What the queue remembers besides its live entries, kept in the ledger under "book".

- finished: the last `FINISHED_KEPT` jobs that left the queue, with their outcome, so that
  `--after`/`--after-ok` can tell how a dependency ended;
- per-GPU counters since the ledger was created: jobs dispatched, completed, failed, out of
  memory (counted apart from the other failures), and the completion times of the last few,
  from which a moving average of throughput is derived;
- GPU health: every GPU seen, and whether it answered at the last reading;
- per-batch counts of jobs done, failed and cancelled.

Its file format is in gpuwait.queue.entries, with the rest of the ledger's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from gpuwait.core.budget import OOM_CARD_FULL, OOM_OWN_LIMIT
from gpuwait.core.record import Record, field
from gpuwait.core.snapshot import MachineSnapshot

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
#: A process whose exit status nobody saw ended: an adopted one (`gpuwait adopt`: no gpuwait was
#: its parent), or one holding a reservation that ended in a way Python does not show.
ENDED = "ended"
OUTCOMES = (OK, FAILED, CANCELLED, LOST, TIMED_OUT, INTERRUPTED, DEPENDENCY_FAILED, ENDED)

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
    #: Who cancelled it (a cancelled job): its owner, or root.
    by_uid: int | None = None
    #: A failed run that ran out of GPU memory: how (gpuwait.core.budget: "own limit", "card
    #: full", "unknown"). Its outcome stays FAILED, so that --after-ok and older readers agree.
    oom: str | None = None

    @property
    def ran_out_of_memory(self) -> bool:
        return self.outcome == FAILED and isinstance(self.oom, str)

    @property
    def succeeded(self) -> bool:
        return self.outcome == OK

    def describe(self) -> str:
        if self.ran_out_of_memory:
            how = {OOM_OWN_LIMIT: " at its own limit", OOM_CARD_FULL: " on a full card"}
            return f"ran out of GPU memory{how.get(str(self.oom), '')}"
        if self.outcome == FAILED and self.signal is not None:
            return f"was killed by signal {self.signal}"
        if self.outcome == FAILED:
            return f"failed with exit status {self.exit_status}"
        return {
            OK: "succeeded",
            CANCELLED: "was cancelled",
            LOST: "was lost (its gpuwait process vanished)",
            ENDED: "ended with an exit status gpuwait could not see",
            TIMED_OUT: "gave up waiting",
            INTERRUPTED: "was interrupted while waiting",
            DEPENDENCY_FAILED: "never started (a job it depended on did not succeed)",
        }.get(self.outcome, self.outcome)


class GpuCounters(Record):
    dispatched: int = 0
    completed: int = 0
    #: Failed runs other than those that ran out of GPU memory, which `oom` counts.
    failed: int = 0
    oom: int = 0
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
    #: Where the health was read (MachineSnapshot.origin: the backend, and for the simulation
    #: its file); readings from elsewhere start a fresh record, as they are of other GPUs.
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
        self.note_run(done, gpu_uuids)
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

    def note_run(self, done: Finished, gpu_uuids: Sequence[str]) -> None:
        """Count one run on the GPUs it used, by how it ended: also a run that is retried,
        whose job goes on (its own outcome is recorded once it has really ended)."""
        for uuid in gpu_uuids:
            counters = self.gpus.setdefault(uuid, GpuCounters())
            if done.succeeded:
                counters.completed += 1
            elif done.ran_out_of_memory:
                counters.oom += 1
            elif done.outcome not in (ENDED, CANCELLED):  # says nothing of success
                counters.failed += 1
            counters.recent_ends = [*counters.recent_ends, done.finished_at][-THROUGHPUT_WINDOW:]

    def note_health(
        self, snapshot: MachineSnapshot, busy: frozenset[str], now: float | None = None
    ) -> list[dict[str, Any]]:
        """Compare a reading with the GPUs seen before; return events for what changed.

        A GPU seen before and missing now is lost when the reading left a GPU out for a
        failure (NVML answered an error for it, or did not answer); one that answers again is
        back; one never seen while others were is hot-added. A reading in which every GPU
        answered and some seen before are missing is of fewer GPUs (a container given some of
        the machine's, through NVIDIA_VISIBLE_DEVICES or its device cgroup, sharing the
        ledger with the host): it loses none, and its numbering, its own, renumbers none.
        `busy` are the UUIDs with running jobs, which keep a lost GPU remembered.
        """
        now = time.time() if now is None else now
        events: list[dict[str, Any]] = []
        if self.health_backend != snapshot.origin:
            self.health, self.health_backend = {}, snapshot.origin
        first_reading = not self.health
        present = {g.uuid for g in snapshot.gpus}
        failed = bool(snapshot.unanswered)
        fewer = not failed and any(u not in present for u in self.health)
        for gpu in snapshot.gpus:
            known = self.health.get(gpu.uuid)
            index = known.index if fewer and known is not None else gpu.index
            if known is None and not first_reading:
                events.append({"kind": "gpu_added", "gpu": gpu.uuid, "index": index})
            elif known is not None and known.state != GPU_OK:
                events.append({"kind": "gpu_back", "gpu": gpu.uuid, "index": index})
            if known is None or known.state != GPU_OK or known.index != index:
                self.health[gpu.uuid] = GpuHealth(
                    index, gpu.name, gpu.total_bytes, GPU_OK, now, None
                )
        for uuid, known in list(self.health.items()):
            if uuid in present or (known.state == GPU_OK and not failed):
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


def _warning_for(warnings: Sequence[str], index: int) -> str | None:
    """The backend's words about GPU `index` ("GPU 2: GPU is lost (NVML error 15); skipped")."""
    for text in warnings:
        head, _, rest = text.partition(":")
        if head.split(" (")[0] == f"GPU {index}":
            return rest.strip().removesuffix("; skipped")
    return None
