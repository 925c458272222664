"""Plain, immutable readings of the machine's GPUs.

Everything that decides (the policy, the status view, the runner's sampling) works on these
snapshots, never on live NVML handles or simulation files.
"""

from __future__ import annotations

from gpuwait.core.record import Record

#: NVML compute modes, as gpuwait names them (`nvidia-smi -c`): any number of processes may use
#: the card; one process at a time (EXCLUSIVE_PROCESS, and the EXCLUSIVE_THREAD of old drivers);
#: none at all (PROHIBITED).
COMPUTE_DEFAULT = "default"
COMPUTE_EXCLUSIVE_PROCESS = "exclusive-process"
COMPUTE_PROHIBITED = "prohibited"
COMPUTE_MODES = (COMPUTE_DEFAULT, COMPUTE_EXCLUSIVE_PROCESS, COMPUTE_PROHIBITED)
#: /proc/PID/comm of CUDA MPS's server and control daemon (cut to 15 characters). On an
#: EXCLUSIVE_PROCESS card the MPS server is the one process with a context, and its clients
#: share the card through it.
MPS_COMM = "nvidia-cuda-mps"


class ProcessUsage(Record, frozen=True):
    """One process holding memory on a GPU."""

    pid: int
    #: Bytes the driver attributes to the process; None where it cannot tell (containers, WSL).
    used_bytes: int | None
    #: The process's command name (/proc/PID/comm) where known; the ignore list matches on it.
    name: str | None = None


class GpuSnapshot(Record, frozen=True):
    """One GPU at one moment."""

    #: NVML index: PCI bus order, which is not CUDA's default order.
    index: int
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    processes: tuple[ProcessUsage, ...] = ()
    #: Percent of recent time a kernel ran; None where unsupported (MIG parents, simulation).
    utilization_pct: int | None = None
    #: The driver reports utilization, but this reading of it failed (`utilization_pct` None):
    #: not to be taken for a GPU that does not report it.
    utilization_failed: bool = False
    #: CUDA compute capability (major, minor); None where the driver cannot tell.
    compute_capability: tuple[int, int] | None = None
    #: False where the driver's process ids are not this pid namespace's (a container without
    #: --pid=host): `processes` is then empty, and memory is known per card only.
    per_process: bool = True
    #: The driver lists processes, but this reading of the list failed (`processes` empty):
    #: not to be taken for a card that nobody uses.
    processes_failed: bool = False
    #: Memory the driver keeps for itself (NVML v2's "reserved"), part of `used_bytes`: no
    #: process holds it, and it is not free either. 0 where the driver does not say (NVML v1,
    #: simulation).
    driver_bytes: int = 0
    #: The card's compute mode (one of COMPUTE_MODES); "default" where the driver does not say.
    compute_mode: str = COMPUTE_DEFAULT
    #: CUDA's number for the card (in PCI order) where it is not `index`: CUDA counts only the
    #: GPUs this process may use (MachineSnapshot.hidden); None where it is `index`.
    cuda_index: int | None = None

    @property
    def cuda_number(self) -> int:
        """The card's number for CUDA in PCI order (CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
        return self.index if self.cuda_index is None else self.cuda_index

    @property
    def one_process_only(self) -> bool:
        """The card lets one process at a time use it (EXCLUSIVE_PROCESS), and no MPS server is
        there to share it among several: a second job placed beside a running one would fail
        with "all CUDA-capable devices are busy or unavailable"."""
        if self.compute_mode != COMPUTE_EXCLUSIVE_PROCESS:
            return False
        return not any(p.name is not None and p.name.startswith(MPS_COMM) for p in self.processes)

    @property
    def free_bytes(self) -> int:
        return max(0, self.total_bytes - self.used_bytes)

    def process_bytes(self, pids: frozenset[int] | set[int]) -> int:
        """Memory the driver attributes to any of `pids` (unknown figures count as 0)."""
        return sum(p.used_bytes or 0 for p in self.processes if p.pid in pids)


class MachineSnapshot(Record, frozen=True):
    """All GPUs that answered, plus one warning per GPU that did not."""

    backend: str
    gpus: tuple[GpuSnapshot, ...]
    warnings: tuple[str, ...] = ()
    #: Indices of GPUs left out of this reading for a failure that may pass (a driver call
    #: that hung or answered an error, NVML's "GPU is lost" too), not for their nature (MIG
    #: mode): a request that needs one of them cannot be judged from this reading.
    unanswered: tuple[int, ...] = ()
    #: GPUs left out for being in MIG mode, as (index, UUID): CUDA takes them (running a
    #: program in one of their MIG instances), only gpuwait places no job there.
    in_mig_mode: tuple[tuple[int, str], ...] = ()
    #: What was read, where one backend can read different things: the simulation file. GPU
    #: health is remembered per source, so a user who switches simulation files has not lost
    #: the first file's GPUs.
    source: str = ""
    #: NVML indices of the GPUs this process may not open (NO_PERMISSION for the card's handle:
    #: a device cgroup hides them, as Slurm's ConstrainDevices does; not a card whose handle
    #: was given and a query refused). CUDA does not count them, so an index in an
    #: inherited CUDA_VISIBLE_DEVICES (Slurm's, from 0 in each job there) names the others.
    hidden: tuple[int, ...] = ()

    @property
    def origin(self) -> str:
        """The backend and its source: readings of one origin describe the same GPUs."""
        return f"{self.backend}:{self.source}" if self.source else self.backend

    def by_uuid(self) -> dict[str, GpuSnapshot]:
        return {g.uuid: g for g in self.gpus}
