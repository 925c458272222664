"""Which GPUs a job may use: `--devices` and an inherited CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot
from gpuwait.core.text import whole_number


def _find(entry: str, ids: Sequence[tuple[int, str]]) -> int | None:
    """The position in `ids` ((NVML index, UUID) pairs) of the GPU `entry` names: its index, or
    its UUID or a prefix of it that names no other; None where it names none of them."""
    entry = entry.strip()
    number = whole_number(entry)
    if number is not None:
        return next((at for at, (index, _) in enumerate(ids) if index == number), None)
    if entry.upper().startswith(("GPU-", "MIG-")):
        found = [at for at, (_, uuid) in enumerate(ids) if uuid.lower().startswith(entry.lower())]
        return found[0] if len(found) == 1 else None
    return None


def _match(entry: str, gpus: Sequence[GpuSnapshot]) -> GpuSnapshot | None:
    at = _find(entry, [(g.index, g.uuid) for g in gpus])
    return None if at is None else gpus[at]


def parse_devices_option(
    text: str,
    gpus: Sequence[GpuSnapshot],
    option: str = "--devices",
    reading: MachineSnapshot | None = None,
) -> list[str]:
    """UUIDs named by `option` (NVML indices or UUIDs, comma separated). Raises ValueError.

    With `reading`, an entry that may name a GPU it left out (`left_out_now`: lost, in MIG
    mode) is passed over, and none left is no error: [] (the caller says what that means)."""
    chosen: list[str] = []
    passed = False
    for entry in text.split(","):
        if not entry.strip():
            continue
        if reading is not None and left_out_now(entry, reading):
            passed = True
            continue
        gpu = _match(entry, gpus)
        if gpu is None:
            known = ", ".join(f"{g.index} ({g.uuid})" for g in gpus) or "none"
            raise ValueError(f"{option} {text!r}: no GPU {entry.strip()!r} here; GPUs: {known}")
        if gpu.uuid not in chosen:
            chosen.append(gpu.uuid)
    if not chosen and not passed:
        raise ValueError(f"{option} {text!r} names no GPU; give indices or UUIDs, e.g. 0,1")
    return chosen


def _cuda_numbered(entry: str, hidden: Collection[int]) -> str:
    """`entry` of an inherited CUDA_VISIBLE_DEVICES with an index in it as NVML's: CUDA counts
    only the GPUs this process may use, in PCI order as NVML does, so where a device cgroup
    hides some (`hidden`, NVML indices: Slurm's ConstrainDevices, which numbers a job's GPUs
    from 0), its 0 is the first of the others. A UUID is as it is."""
    number = whole_number(entry.strip())
    if number is None or not hidden:
        return entry
    for index in sorted(hidden):
        if index > number:
            break
        number += 1
    return str(number)


def cuda_number(index: int, hidden: Collection[int]) -> int:
    """CUDA's number for the GPU of NVML index `index`: CUDA counts only the GPUs this
    process may open, so it is the index less the `hidden` GPUs before it."""
    return index - sum(h < index for h in hidden)


def as_cuda_numbers(indices: str, hidden: Collection[int]) -> str:
    """A list of NVML indices (Slurm's SLURM_JOB_GPUS) as CUDA_VISIBLE_DEVICES must name them
    where `hidden` GPUs are not counted; as it is where an entry is no index, or a hidden one."""
    numbers = [whole_number(entry.strip()) for entry in indices.split(",")]
    if not hidden or any(n is None or n in hidden for n in numbers):
        return indices
    return ",".join(str(cuda_number(n, hidden)) for n in numbers if n is not None)


def parse_inherited_visible(
    text: str,
    gpus: Sequence[GpuSnapshot],
    in_mig_mode: Sequence[tuple[int, str]] = (),
    hidden: Collection[int] = (),
) -> list[str]:
    """UUIDs visible through an inherited CUDA_VISIBLE_DEVICES, read the way CUDA reads it.

    CUDA stops at the first entry it cannot use, and an empty value hides every GPU. Indices are
    taken as NVML (PCI bus order) indices, which is what Slurm and container runtimes set,
    counting only the GPUs this process may use (`hidden`: NVML indices of the others, as CUDA
    does). An entry naming a GPU in MIG mode (`in_mig_mode`: (index, UUID) of the cards left
    out of `gpus` for it) is one CUDA takes, running the program in one of the card's MIG
    instances: the entries after it stay visible, though gpuwait places no job on that card.
    """
    visible: list[str] = []
    passed: set[int] = set()
    for entry in (_cuda_numbered(entry, hidden) for entry in text.split(",")):
        gpu = _match(entry, gpus)
        if gpu is None:
            mig = _find(entry, in_mig_mode)
            if mig is None or mig in passed:
                break
            passed.add(mig)
            continue
        if gpu.uuid in visible:
            break
        visible.append(gpu.uuid)
    return visible


def first_in_mig_mode(
    text: str, in_mig_mode: Sequence[tuple[int, str]], hidden: Collection[int] = ()
) -> int | None:
    """The NVML index of the GPU in MIG mode that the list `text` (CUDA_VISIBLE_DEVICES, with
    `hidden` as for parse_inherited_visible, or --devices) names first, where its first entry
    naming any GPU names one."""
    entries = [_cuda_numbered(e, hidden) for e in text.split(",") if e.strip()]
    at = _find(entries[0], in_mig_mode) if entries else None
    return None if at is None else in_mig_mode[at][0]


def left_out_now(entry: str, snapshot: MachineSnapshot) -> bool:
    """Whether `entry` (an NVML index, a UUID or a prefix of one) may name a GPU of the machine
    that `snapshot` left out: one in MIG mode, or one that did not answer (by its index, or by
    a UUID no GPU read has, since the reading cannot tell such a GPU's UUID)."""
    if _find(entry, snapshot.in_mig_mode) is not None:
        return True
    entry = entry.strip()
    number = whole_number(entry)
    if number is not None:
        return number in snapshot.unanswered
    return (
        bool(snapshot.unanswered)
        and entry.upper().startswith(("GPU-", "MIG-"))
        and _match(entry, snapshot.gpus) is None
    )


#: What would help where no GPU of the machine is one a job can be placed on (`none_usable`).
MIG_MODE_HINT = (
    "run the command without gpuwait, or have an administrator turn MIG mode off "
    "(nvidia-smi -mig 0)"
)


def in_mig_mode_words(indices: Sequence[int]) -> str:
    """The words that say GPUs are in MIG mode: "GPU 0 is in MIG mode", "GPU 0, GPU 1 are in
    MIG mode"."""
    which = ", ".join(f"GPU {index}" for index in indices)
    return f"{which} {'is' if len(indices) == 1 else 'are'} in MIG mode"


NO_GPU_HINT = "see nvidia-smi; GPUWAIT_SIM=FILE uses simulated GPUs meanwhile"


def none_usable(snapshot: MachineSnapshot) -> tuple[str, str] | None:
    """(why, hint) where `snapshot` read no GPU a job can be placed on and none that may answer
    again: every card in MIG mode, or none at all that this process may use (NVML counts
    none, or each is hidden from it). None where it read one."""
    if snapshot.gpus or snapshot.unanswered:
        return None
    if snapshot.in_mig_mode:
        mig = in_mig_mode_words([index for index, _ in snapshot.in_mig_mode])
        return (
            f"no GPU here takes a job: {mig}, and gpuwait places jobs on whole GPUs only",
            MIG_MODE_HINT,
        )
    return "NVML lists no GPU that this process may use", NO_GPU_HINT
