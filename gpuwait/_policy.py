"""The scheduling policy: pure functions over snapshots and ledger claims.

No I/O, no clock, no NVML: everything it needs is passed in, so it can be property-tested.

Per GPU:
    usable    = total * safety
    external  = device used - memory observed for gpuwait jobs on that GPU   (never below 0)
    committed = sum over running jobs of max(reserved, observed)
    room      = usable - external - committed

A job that has not allocated yet still holds its reservation; a job that grew past it counts at
its real size; and nothing is counted twice, because what a job really uses is taken out of
`external` before `committed` adds it back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpuwait._sizes import MemoryRequest, format_size
from gpuwait._snapshot import GpuSnapshot

PICK_STRATEGIES = ("best-fit", "most-free", "round-robin")

#: An exclusive job takes a GPU only where at most this fraction is used by non-gpuwait processes
#: (a desktop or a driver reservation), so "a whole GPU" still means one that is free in practice.
EXCLUSIVE_MAX_EXTERNAL = 0.05


@dataclass(frozen=True)
class Claim:
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
    #: Bytes reserved on each GPU in `gpu_uuids` (running jobs only).
    reserved_bytes: int = 0
    #: Bytes the job's process tree was last seen using, per GPU UUID.
    observed: Mapping[str, int] = field(default_factory=dict)
    #: The user the job belongs to (per-user limits).
    uid: int = -1
    #: The user's fair-share usage (decayed VRAM-time); lower goes first within a priority.
    usage: float = 0.0

    @property
    def exclusive(self) -> bool:
        return self.request is None

    def sort_key(self) -> tuple[int, float, int]:
        """Queue order: higher priority first, then the user with less usage, then earlier
        submission (so one user's own jobs always keep their order)."""
        return (-self.priority, self.usage, self.order)


@dataclass(frozen=True)
class UserLimits:
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


@dataclass(frozen=True)
class GpuRoom:
    """What one GPU can still take, and why."""

    gpu: GpuSnapshot
    usable: int
    external: int
    committed: int
    running_jobs: int
    exclusive_held: bool

    @property
    def room(self) -> int:
        return self.usable - self.external - self.committed


@dataclass(frozen=True)
class WaitReason:
    """Why a waiting job is not admitted now."""

    needed: str
    best_gpu_index: int | None
    best_room: int
    running: int
    ahead: int
    #: Set when the job fits but its user is at a per-user limit.
    limit: str | None = None

    def describe(self) -> str:
        if self.limit is not None:
            return f"waiting for {self.needed}: {self.limit} ({self.running} running)"
        if self.best_gpu_index is None:
            where = "no usable GPU right now"
        else:
            where = f"best GPU{self.best_gpu_index} has {format_size(max(0, self.best_room))}"
        return f"waiting for {self.needed}: {where} ({self.running} running, {self.ahead} ahead of you)"


@dataclass(frozen=True)
class Plan:
    """Which waiting jobs may start now, on which GPUs (in PCI order), and why the rest wait."""

    admitted: Mapping[str, tuple[str, ...]]
    reserved: Mapping[str, int]
    waiting: Mapping[str, WaitReason]
    next_cursor: int


def gpu_rooms(
    gpus: Sequence[GpuSnapshot], claims: Iterable[Claim], safety: float
) -> dict[str, GpuRoom]:
    """Room per GPU UUID, given the running claims."""
    running = [c for c in claims if c.running]
    rooms: dict[str, GpuRoom] = {}
    for gpu in gpus:
        on_gpu = [c for c in running if gpu.uuid in c.gpu_uuids]
        observed = sum(max(0, c.observed.get(gpu.uuid, 0)) for c in on_gpu)
        committed = sum(max(c.reserved_bytes, c.observed.get(gpu.uuid, 0)) for c in on_gpu)
        rooms[gpu.uuid] = GpuRoom(
            gpu=gpu,
            usable=int(gpu.total_bytes * safety),
            external=max(0, gpu.used_bytes - observed),
            committed=committed,
            running_jobs=len(on_gpu),
            exclusive_held=any(c.exclusive for c in on_gpu),
        )
    return rooms


def need_on(claim: Claim, room: GpuRoom) -> int | None:
    """Bytes `claim` needs on this GPU, or None if it cannot go there now at all."""
    if claim.candidates is not None and room.gpu.uuid not in claim.candidates:
        return None
    if room.exclusive_held:
        return None
    if claim.request is None:
        if room.running_jobs or room.external > room.gpu.total_bytes * EXCLUSIVE_MAX_EXTERNAL:
            return None
        return max(1, room.room)
    return claim.request.on(room.gpu.total_bytes)


def impossible_reason(
    claim: Claim, gpus: Sequence[GpuSnapshot], safety: float, limits: UserLimits | None = None
) -> str | None:
    """Why `claim` can never be admitted on these GPUs, even when they are idle; None if it can."""
    candidates = [g for g in gpus if claim.candidates is None or g.uuid in claim.candidates]
    if not candidates:
        return "no candidate GPU"
    if len(candidates) < claim.gpus_wanted:
        return f"{claim.gpus_wanted} GPUs wanted but only {len(candidates)} can be used"
    if limits is not None:
        smallest = min(
            (
                claim.request.on(g.total_bytes)
                if claim.request
                else int(g.total_bytes * (safety - EXCLUSIVE_MAX_EXTERNAL))
                for g in candidates
            ),
        )
        refusal = limits.refusal(0, 0, claim.gpus_wanted, smallest * claim.gpus_wanted)
        if refusal is not None:
            return f"the request exceeds {refusal.replace('your ', '', 1)}"
    if claim.request is None:
        return None
    fitting = [
        g for g in candidates if claim.request.on(g.total_bytes) <= int(g.total_bytes * safety)
    ]
    if len(fitting) >= claim.gpus_wanted:
        return None
    largest = max(candidates, key=lambda g: (g.total_bytes, -g.index))
    return (
        f"{claim.request.describe()} per GPU can never fit: the largest candidate, "
        f"GPU{largest.index} ({format_size(largest.total_bytes)}), offers at most "
        f"{format_size(int(largest.total_bytes * safety))} at safety {safety:g}"
    )


def _order_for_pick(
    fitting: list[tuple[GpuRoom, int]], pick: str, cursor: int, gpu_count: int
) -> list[tuple[GpuRoom, int]]:
    if pick == "most-free":
        return sorted(fitting, key=lambda rn: (-rn[0].room, rn[0].gpu.index))
    if pick == "round-robin":
        span = max(gpu_count, 1 + max(r.gpu.index for r, _ in fitting))
        return sorted(
            fitting, key=lambda rn: ((rn[0].gpu.index - cursor - 1) % span, rn[0].gpu.index)
        )
    # best-fit: the GPU left with the least room, so large holes stay open for large jobs.
    return sorted(fitting, key=lambda rn: (rn[0].room - rn[1], rn[0].gpu.index))


def _held_by_user(claims: Iterable[Claim]) -> dict[int, tuple[int, int]]:
    """(GPUs, reserved bytes over all of them) that each user's running jobs hold."""
    held: dict[int, tuple[int, int]] = {}
    for c in claims:
        if c.running:
            gpus, vram = held.get(c.uid, (0, 0))
            held[c.uid] = (gpus + len(c.gpu_uuids), vram + c.reserved_bytes * len(c.gpu_uuids))
    return held


def plan(
    gpus: Sequence[GpuSnapshot],
    claims: Sequence[Claim],
    safety: float,
    cursor: int = -1,
    limits: UserLimits | None = None,
) -> Plan:
    """Admit waiting claims in queue order while they fit.

    Earlier waiters are placed first and their room is taken before later ones are looked at, so a
    later waiter never jumps an earlier one that fits the same GPU. A waiter that does not fit does
    not block those behind it; nor does one whose user is at a per-user limit.
    """
    held = _held_by_user(claims) if limits is not None else {}
    rooms = gpu_rooms(gpus, claims, safety)
    running_total = sum(1 for c in claims if c.running)
    waiting = sorted((c for c in claims if not c.running), key=Claim.sort_key)
    admitted: dict[str, tuple[str, ...]] = {}
    reserved: dict[str, int] = {}
    reasons: dict[str, WaitReason] = {}
    for position, claim in enumerate(waiting):
        fitting: list[tuple[GpuRoom, int]] = []
        for room in rooms.values():
            need = need_on(claim, room)
            if need is not None and need <= room.room:
                fitting.append((room, need))
        if len(fitting) >= claim.gpus_wanted and fitting:
            chosen = _order_for_pick(fitting, claim.pick, cursor, len(gpus))[: claim.gpus_wanted]
            chosen.sort(key=lambda rn: rn[0].gpu.index)
            if limits is not None:
                gpus_held, vram_held = held.get(claim.uid, (0, 0))
                vram = max(need for _, need in chosen) * len(chosen)
                refusal = limits.refusal(gpus_held, vram_held, len(chosen), vram)
                if refusal is not None:
                    reason = _wait_reason(claim, rooms, running_total, position)
                    reasons[claim.job_id] = replace(reason, limit=refusal)
                    continue
                held[claim.uid] = (gpus_held + len(chosen), vram_held + vram)
            for room, need in chosen:
                rooms[room.gpu.uuid] = GpuRoom(
                    gpu=room.gpu,
                    usable=room.usable,
                    external=room.external,
                    committed=room.committed + need,
                    running_jobs=room.running_jobs + 1,
                    exclusive_held=room.exclusive_held or claim.exclusive,
                )
            admitted[claim.job_id] = tuple(r.gpu.uuid for r, _ in chosen)
            reserved[claim.job_id] = max(need for _, need in chosen)
            if claim.pick == "round-robin":
                cursor = chosen[-1][0].gpu.index
            continue
        reasons[claim.job_id] = _wait_reason(claim, rooms, running_total, position)
    return Plan(admitted=admitted, reserved=reserved, waiting=reasons, next_cursor=cursor)


def _wait_reason(
    claim: Claim, rooms: Mapping[str, GpuRoom], running: int, ahead: int
) -> WaitReason:
    candidates = [
        r for r in rooms.values() if claim.candidates is None or r.gpu.uuid in claim.candidates
    ]
    best = max(candidates, key=lambda r: (r.room, -r.gpu.index), default=None)
    needed = "a whole GPU" if claim.request is None else claim.request.describe()
    if claim.gpus_wanted > 1:
        needed = f"{claim.gpus_wanted} GPUs with {needed} each"
    return WaitReason(
        needed=needed,
        best_gpu_index=best.gpu.index if best else None,
        best_room=best.room if best else 0,
        running=running,
        ahead=ahead,
    )
