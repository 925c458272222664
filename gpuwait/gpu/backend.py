"""The one interface through which gpuwait reads GPUs: real NVML or the simulation."""

from __future__ import annotations

import os
from typing import Protocol

from gpuwait.core.snapshot import MachineSnapshot


class Backend(Protocol):
    """A source of machine snapshots."""

    #: "nvml" or "sim"; shown by `status`.
    name: str

    def snapshot(self) -> MachineSnapshot:
        """Read every GPU now. GPUs that fail are left out and named in `warnings`."""
        ...

    def close(self) -> None:
        """Release the library or files behind the backend."""
        ...


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
