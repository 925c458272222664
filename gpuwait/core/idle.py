"""Idle VRAM holders: processes that keep memory on a GPU that does no work.

There is no daemon to watch the GPUs, so idleness is judged from the readings gpuwait makes
anyway, kept as evidence between them: for each process holding enough memory on a quiet GPU,
since when every reading has found it so. The driver reports utilization per GPU everywhere
(per process only on some cards), so the rule is the GPU's: a process is idle when it holds at
least `min_bytes` on a GPU whose utilization stayed under `max_util_pct` at every reading for
at least `after` seconds while it held that memory. A GPU whose utilization is unknown makes
nobody idle: gpuwait names no one on a guess.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from gpuwait.core.record import Record
from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot, ProcessUsage

#: Evidence: key (see `evidence_key`) -> the time since which the process was seen idle.
Evidence = dict[str, float]


class IdleRule(Record, frozen=True):
    """What counts as idle: the `idle_min_vram`, `idle_max_util` and `idle_after` settings."""

    min_bytes: int
    #: Percent: a GPU at or above it is working.
    max_util_pct: float
    after: float


class IdleHolder(Record, frozen=True):
    """A process that has held memory on a quiet GPU for at least the rule's `after`."""

    pid: int
    gpu_index: int
    gpu_uuid: str
    used_bytes: int
    idle_since: float
    #: A gpuwait job with nothing on the GPU: the room it holds reserved there.
    reserved_bytes: int = 0


#: (GPU UUID, pid) -> bytes a gpuwait job holds reserved there while nothing of it shows on it.
Unused = Mapping[tuple[str, int], int]


def with_unused_rooms(
    snapshot: MachineSnapshot,
    rooms: Mapping[int, Mapping[str, int]],
    members: Mapping[int, int],
) -> tuple[MachineSnapshot, dict[tuple[str, int], int]]:
    """`snapshot` with each running job that holds room on a GPU where none of its processes
    shows (a notebook's reservation not used yet) listed there by its command, holding nothing,
    and the room each such job holds (`Unused`). Its room keeps others waiting as memory
    would. `rooms`: a job's command pid -> bytes it reserves on each of its GPUs (UUID -> bytes: on
    cards of different sizes, not the same on each);
    `members`: each pid of a job's process tree -> its command's pid."""
    unused: dict[tuple[str, int], int] = {}
    gpus = []
    for gpu in snapshot.gpus:
        shown = {members.get(p.pid) for p in gpu.processes}
        added = tuple(
            ProcessUsage(pid=pid, used_bytes=0)
            for pid, reserved in sorted(rooms.items())
            if reserved.get(gpu.uuid, 0) > 0 and pid not in shown
        )
        for process in added:
            unused[(gpu.uuid, process.pid)] = rooms[process.pid][gpu.uuid]
        gpus.append(gpu._replace(processes=gpu.processes + added) if added else gpu)
    return snapshot._replace(gpus=tuple(gpus)), unused


def evidence_key(gpu_uuid: str, pid: int, start: int | None) -> str:
    """One process on one GPU. The start time tells a reused pid from the process that had it:
    a new process inherits no idle time."""
    return f"{gpu_uuid}/{pid}/{'?' if start is None else start}"


def observe(
    previous: Mapping[str, float],
    snapshot: MachineSnapshot,
    starts: Mapping[int, int | None],
    rule: IdleRule,
    now: float,
    ignore: Collection[str] = (),
    unused: Unused | None = None,
) -> Evidence:
    """The evidence after one more reading: every process seen holding memory on a quiet GPU
    keeps the time it was first seen so (now, if it was not before); one seen on a busy GPU,
    holding nothing, or gone drops out.
    `starts`: each process's start time where known; `ignore`: command names that are no load
    (a display server) and so never named; `unused`: the rooms of `with_unused_rooms`."""
    listed = {gpu.uuid: gpu for gpu in snapshot.gpus}
    # What this reading cannot see stays as it was: the GPUs it does not list (gpuwait in a
    # container given some of the machine's, sharing the state dir with the host), and the
    # processes on a quiet GPU whose processes it cannot tell (NVML's host pids, in a container
    # without --pid=host). Dropped, another reading's count would start again at each of these.
    evidence: Evidence = {}
    for key, since in previous.items():
        gpu = listed.get(key.split("/", 1)[0])
        if gpu is None or (not gpu.per_process and quiet(gpu, rule)):
            evidence[key] = since
    for gpu in snapshot.gpus:
        if not quiet(gpu, rule):
            continue
        for process in gpu.processes:
            # Every holding is kept, however small: `min_bytes` is applied when naming, so a
            # lower threshold set later finds the time already seen.
            if not _held(gpu.uuid, process, unused) or process.name in ignore:
                continue
            key = evidence_key(gpu.uuid, process.pid, starts.get(process.pid))
            since = previous.get(key, now)
            # A clock set back must not make a process idle for longer than it was seen.
            evidence[key] = min(since, now)
    return evidence


def idle_holders(
    evidence: Mapping[str, float],
    snapshot: MachineSnapshot,
    starts: Mapping[int, int | None],
    rule: IdleRule,
    now: float,
    unused: Unused | None = None,
) -> list[IdleHolder]:
    """The processes of `snapshot` holding at least `rule.min_bytes` that the evidence shows
    idle for at least `rule.after`, the longest idle first."""
    found: list[IdleHolder] = []
    for gpu in snapshot.gpus:
        for process in gpu.processes:
            since = evidence.get(evidence_key(gpu.uuid, process.pid, starts.get(process.pid)))
            if since is None or now - since < rule.after:
                continue
            if _held(gpu.uuid, process, unused) < rule.min_bytes:
                continue
            found.append(
                IdleHolder(
                    pid=process.pid,
                    gpu_index=gpu.index,
                    gpu_uuid=gpu.uuid,
                    used_bytes=process.used_bytes or 0,
                    idle_since=since,
                    reserved_bytes=(unused or {}).get((gpu.uuid, process.pid), 0),
                )
            )
    return sorted(found, key=lambda h: (h.idle_since, h.gpu_index, h.pid))


def quiet(gpu: GpuSnapshot, rule: IdleRule) -> bool:
    """Does `gpu` do no work by `rule` (its utilization known, and under the rule's)?"""
    return gpu.utilization_pct is not None and gpu.utilization_pct < rule.max_util_pct


def _held(uuid: str, process: ProcessUsage, unused: Unused | None) -> int:
    """What the process keeps from others on the GPU: its memory, or its job's unused room."""
    return process.used_bytes or (unused or {}).get((uuid, process.pid), 0)
