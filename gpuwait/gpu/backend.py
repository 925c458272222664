"""The one interface through which gpuwait reads GPUs: real NVML or the simulation.

Only the type checker reads this protocol; `gpuwait.gpu.open_backend` opens a backend."""

from __future__ import annotations

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
