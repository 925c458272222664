"""Whether this machine could freeze a CUDA job: move its device memory to host memory and stop
it, with no help from the job (CUDA checkpointing, docs/freezing.md).

Only what is present is looked at, and nothing is done with it: `--freezable` is accepted where
everything is there and refused otherwise, naming what this machine lacks (freezing itself is
gpuwait.runner.frozen's, through `cuda-checkpoint`). libcuda is loaded only to look its
checkpoint entry points up, never called (no cuInit, no context, no GPU touched); the driver's
version comes from NVML, like every other question to the driver. With simulated GPUs
(docs/simulation.md) there is no driver to ask: a `cuda-checkpoint` on PATH (a stand-in that
knows the simulation) is all it takes.
"""

from __future__ import annotations

import ctypes
import shutil

from gpuwait.core.record import Record
from gpuwait.core.text import whole_number

#: The driver branch from which both ways in are there: `cuda-checkpoint --action lock` (a
#: separate lock with a timeout, new in 570) and the cuCheckpointProcess* driver API (CUDA 12.8,
#: whose driver branch is 570). 550 to 565 have only `cuda-checkpoint --toggle`, which cannot
#: bound the wait for a job's submitted work.
MIN_DRIVER = 570
TOOL = "cuda-checkpoint"
LIBCUDA = "libcuda.so.1"
#: One of the driver API's entry points (gpuwait itself runs the tool, whose --action steps
#: match them); the others (Checkpoint, Restore, Unlock, GetState) came in the same release.
LOCK_SYMBOL = "cuCheckpointProcessLock"


class FreezeSupport(Record, frozen=True):
    """What this machine has of CUDA checkpointing."""

    #: Where `cuda-checkpoint` is on PATH, or None.
    tool: str | None
    #: "missing" (no libcuda.so.1), "old" (it lacks the checkpoint API), or "ok".
    driver_api: str
    #: The NVIDIA driver's version from NVML ("570.86.10"), or None where NVML did not answer.
    driver: str | None
    #: The GPUs are simulated: only the tool is looked for.
    simulated: bool = False

    def missing(self) -> list[str]:
        """What this machine lacks, each in a few words; empty when it has it all."""
        lacks = []
        if self.tool is None:
            lacks.append(f"no {TOOL} on PATH")
        if self.simulated:
            return lacks
        if self.driver_api == "missing":
            lacks.append(f"no {LIBCUDA}")
        elif self.driver_api == "old":
            lacks.append(f"{LIBCUDA} has no CUDA checkpoint API ({LOCK_SYMBOL})")
        if self.driver is None:
            lacks.append("no NVIDIA driver answered through NVML")
        elif _major(self.driver) < MIN_DRIVER:
            lacks.append(f"driver {self.driver} is older than {MIN_DRIVER}")
        return lacks

    def refusal(self) -> str | None:
        """Why --freezable is refused here, as one line; None where it is not."""
        lacks = self.missing()
        if not lacks:
            return None
        return (
            f"--freezable: this machine cannot freeze CUDA jobs ({'; '.join(lacks)}); use "
            "--pausable with a job that checkpoints itself (see docs/freezing.md)"
        )


def detect(nvml_timeout: float | None = 5.0, simulated: bool = False) -> FreezeSupport:
    if simulated:
        return FreezeSupport(shutil.which(TOOL), "ok", None, simulated=True)
    return FreezeSupport(shutil.which(TOOL), _driver_api(), _driver_version(nvml_timeout))


def _driver_api() -> str:
    try:
        # RTLD_LOCAL (the default) and no call into it: looking a symbol up runs no driver code
        # beyond the library's loading.
        lib = ctypes.CDLL(LIBCUDA)
    except OSError:
        return "missing"
    return "ok" if hasattr(lib, LOCK_SYMBOL) else "old"


def _driver_version(timeout: float | None) -> str | None:
    from gpuwait.gpu import nvml  # pynvml only once --freezable is asked about

    return nvml.driver_version(timeout)


def _major(version: str) -> int:
    """570 of "570.86.10"; 0 for a version that cannot be read (taken as too old)."""
    head = version.strip().split(".", 1)[0]
    major = whole_number(head) if len(head) < 6 else None
    return major or 0
