"""Which GPUs a job may use: `--devices` and an inherited CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

from collections.abc import Sequence

from gpuwait.core.snapshot import GpuSnapshot


def _match(entry: str, gpus: Sequence[GpuSnapshot]) -> GpuSnapshot | None:
    entry = entry.strip()
    if entry.isascii() and entry.isdigit():
        return next((g for g in gpus if g.index == int(entry)), None)
    if entry.upper().startswith(("GPU-", "MIG-")):
        matches = [g for g in gpus if g.uuid.lower().startswith(entry.lower())]
        return matches[0] if len(matches) == 1 else None
    return None


def parse_devices_option(
    text: str, gpus: Sequence[GpuSnapshot], option: str = "--devices"
) -> list[str]:
    """UUIDs named by `option` (NVML indices or UUIDs, comma separated). Raises ValueError."""
    chosen: list[str] = []
    for entry in text.split(","):
        if not entry.strip():
            continue
        gpu = _match(entry, gpus)
        if gpu is None:
            known = ", ".join(f"{g.index} ({g.uuid})" for g in gpus) or "none"
            raise ValueError(f"{option} {text!r}: no GPU {entry.strip()!r} here; GPUs: {known}")
        if gpu.uuid not in chosen:
            chosen.append(gpu.uuid)
    if not chosen:
        raise ValueError(f"{option} {text!r} names no GPU; give indices or UUIDs, e.g. 0,1")
    return chosen


def parse_inherited_visible(text: str, gpus: Sequence[GpuSnapshot]) -> list[str]:
    """UUIDs visible through an inherited CUDA_VISIBLE_DEVICES, read the way CUDA reads it.

    CUDA stops at the first entry it cannot use, and an empty value hides every GPU. Indices are
    taken as NVML (PCI bus order) indices, which is what Slurm and container runtimes set.
    """
    visible: list[str] = []
    for entry in text.split(","):
        gpu = _match(entry, gpus)
        if gpu is None or gpu.uuid in visible:
            break
        visible.append(gpu.uuid)
    return visible
