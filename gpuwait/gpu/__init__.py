"""Reading GPUs: the backend protocol (gpuwait.gpu.backend), NVML, and the simulation with its
simulated jobs. `open_backend` opens the one the settings name."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot
    from gpuwait.gpu.backend import Backend


def open_backend(
    sim_path: str | os.PathLike[str] | None, nvml_timeout: float | None = 5.0
) -> Backend:
    """The simulation when `sim_path` is set, otherwise NVML (each reading bounded by
    `nvml_timeout` seconds).

    Raises BackendUnavailable (with a hint) when neither can be read.
    """
    if sim_path:
        from gpuwait.gpu.sim import SimBackend

        return SimBackend(os.fspath(sim_path))
    from gpuwait.gpu.nvml import NvmlBackend

    return NvmlBackend(timeout=nvml_timeout)


def read_once(
    sim_path: str | os.PathLike[str] | None, nvml_timeout: float | None = 5.0
) -> MachineSnapshot:
    """One reading of the GPUs, the backend opened for it and closed again (as `open_backend`
    opens it; raises BackendUnavailable as it does)."""
    backend = open_backend(sim_path, nvml_timeout)
    try:
        return backend.snapshot()
    finally:
        backend.close()


def with_names(gpu: GpuSnapshot) -> GpuSnapshot:
    """`gpu` with the command name (/proc/PID/comm) of each process of this user's or root's
    filled in where not known yet. Another user's stays unnamed: anyone may name a process what
    they like (prctl, or a copy of a program), and named Xorg it would count as no load
    (ignore_processes), named nvidia-cuda-mps-server as an MPS server that jobs may share a
    card that takes one process at a time through."""
    from gpuwait.linux import proc

    trusted = (os.getuid(), 0)
    return gpu._replace(
        processes=tuple(
            p._replace(name=proc.command_name(p.pid))
            if p.name is None and proc.owner_uid(p.pid) in trusted
            else p
            for p in gpu.processes
        )
    )
