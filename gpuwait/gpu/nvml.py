"""The NVML backend: the one module that talks to the NVIDIA driver (through pynvml).

Everything pynvml can throw is turned into either a per-GPU warning (that GPU is left out,
the others still serve) or BackendUnavailable (no readings at all), so callers never see an
NVML exception or a traceback.

A driver call can also hang (a GPU falling off the bus, a wedged driver). Every reading is made
in a helper thread with a deadline: a GPU whose reading does not come back in time is left out,
with a warning, and is not asked again until that stuck call returns; a hung call that concerns
no single GPU (init, the GPU count) makes the backend unavailable. Figures that cannot be true
(more used or free than the total) are clamped towards "full" and named in a warning. A GPU
in MIG mode is left out, with a warning: gpuwait places jobs on whole GPUs only; so is one that
NVML says this process may not use (NO_PERMISSION: hidden by a container's or a Slurm job's
device cgroup), which is no failure that may pass. Each GPU's
compute mode is read too (one process at a time, or none: the policy respects it).

The driver names processes by their pids in the host's pid namespace. In another one (a
container without --pid=host), once NVML lists a pid that is no GPU process here, the process
lists are left out of every later snapshot (`per_process` False): memory is counted per card.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any, TypeVar, cast

from gpuwait.core.devices import cuda_number
from gpuwait.core.errors import BackendUnavailable
from gpuwait.core.sizes import format_size
from gpuwait.core.snapshot import (
    COMPUTE_DEFAULT,
    COMPUTE_EXCLUSIVE_PROCESS,
    COMPUTE_PROHIBITED,
    GpuSnapshot,
    MachineSnapshot,
    ProcessUsage,
)
from gpuwait.gpu import with_names
from gpuwait.linux import pidns, proc, signals


def _import_pynvml() -> Any:
    """pynvml, without loading the ctypes.util that it imports and never calls on Linux.

    `from ctypes.util import find_library` pulls in subprocess, shutil and tempfile: some 15 ms
    of every launch on a GPU machine. A stand-in answers for ctypes.util while pynvml is imported
    (its find_library loads the real one if ever called) and is gone again right after, so
    anything importing ctypes.util later gets the real module.
    """
    if "pynvml" in sys.modules or "ctypes.util" in sys.modules:
        import pynvml  # type: ignore[import-untyped]

        return pynvml

    def find_library(name: str) -> str | None:
        from ctypes.util import find_library as real

        return real(name)

    stand_in = types.ModuleType("ctypes.util")
    stand_in.find_library = find_library  # type: ignore[attr-defined]
    sys.modules["ctypes.util"] = stand_in
    try:
        import pynvml
    finally:
        if sys.modules.get("ctypes.util") is stand_in:
            del sys.modules["ctypes.util"]
    return pynvml


pynvml = _import_pynvml()

T = TypeVar("T")

HINT = (
    "install the NVIDIA driver, or use simulated GPUs (`gpuwait sim init FILE`, then "
    "GPUWAIT_SIM=FILE); on_no_gpu in config.toml decides whether commands run anyway"
)

#: For a driver that is there but does not answer (a call stuck in it): nothing to install,
#: and on_no_gpu, which is for machines without a driver, does not apply.
HUNG_HINT = "check the driver (nvidia-smi); one that does not answer needs a GPU reset or a reboot"

#: For a driver that started and then fails: nothing to install either.
FAILING_HINT = "check the driver (nvidia-smi); a GPU reset or a reboot may mend it"

# NVML return codes, spelled out so this module does not depend on which error classes a
# given nvidia-ml-py release generates.
_UNINITIALIZED = 1
_NO_PERMISSION = 4
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_LIB_RM_VERSION_MISMATCH = 18
_NOT_SUPPORTED = 3
_INSUFFICIENT_SIZE = 7
_ARGUMENT_VERSION_MISMATCH = 25
_UNKNOWN = 999

# Answers from nvmlDeviceGetMemoryInfo_v2 that mean "this driver cannot do v2", not "this GPU
# is broken": older drivers lack the symbol or reject the struct version, and some report
# Unknown or NotSupported instead. v1 is then asked; a broken GPU fails there too.
_MEMORY_V2_UNAVAILABLE = frozenset(
    {_FUNCTION_NOT_FOUND, _ARGUMENT_VERSION_MISMATCH, _UNKNOWN, _NOT_SUPPORTED}
)
# ...of which these say it for sure; Unknown and NotSupported may also be one GPU's trouble.
_MEMORY_V2_MISSING = frozenset({_FUNCTION_NOT_FOUND, _ARGUMENT_VERSION_MISMATCH})


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _describe(exc: BaseException) -> str:
    """One line for an NVML failure: "GPU is lost (NVML error 15)"."""
    code = _code(exc)
    try:
        # str() of an NVMLError with an unlisted code calls back into the library.
        text = str(exc).strip()
    except Exception:
        text = ""
    if code is None:
        return text or type(exc).__name__
    return f"{text or 'NVML error'} (NVML error {code})"


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _init_failure(exc: BaseException) -> BackendUnavailable:
    code = _code(exc)
    if isinstance(exc, OSError) or code == _LIBRARY_NOT_FOUND:
        message = "NVIDIA driver not found (libnvidia-ml.so.1 could not be loaded)"
    elif code == _DRIVER_NOT_LOADED:
        # Installed: the hint to install it would mislead.
        return BackendUnavailable(
            "NVIDIA driver is installed but not loaded (NVML error 9)",
            hint="have an administrator load it (modprobe nvidia), or set GPUWAIT_SIM=FILE to "
            "use simulated GPUs; on_no_gpu in config.toml decides whether commands run anyway",
            lasting=True,
        )
    elif code == _NO_PERMISSION:
        # The driver's device files are not this user's to open: until an administrator
        # changes that, no wait helps, and the generic hint (install a driver) would mislead.
        return BackendUnavailable(
            "no permission to use the NVIDIA driver (NVML error 4)",
            hint="ask an administrator for access to the GPUs' device files (/dev/nvidiactl, "
            "/dev/nvidia*); GPUWAIT_SIM=FILE uses simulated GPUs meanwhile",
            gpus_here=True,
        )
    elif code == _LIB_RM_VERSION_MISMATCH:
        # Typical right after a driver upgrade without a reboot, and so until one: no wait
        # helps. The generic hint would mislead.
        return BackendUnavailable(
            "NVIDIA driver and NVML library versions do not match (NVML error 18)",
            hint="reboot, or reload the nvidia kernel modules, after a driver upgrade; "
            "GPUWAIT_SIM=FILE uses simulated GPUs meanwhile",
            gpus_here=True,
        )
    else:
        # The library is there and answered: a driver is installed, and the failure may pass
        # (retried up to gpu_error_timeout, which on_no_gpu has no say in).
        return BackendUnavailable(f"NVML could not start: {_describe(exc)}", hint=FAILING_HINT)
    # No driver at all on this machine: waiting would change nothing (on_no_gpu decides).
    return BackendUnavailable(message, hint=HINT, lasting=True)


class _GpuLost(Exception):
    """A GPU stopped answering halfway through its reading."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(_describe(cause))


class _MigEnabled(Exception):
    """A GPU in MIG mode: its jobs would run in one of its MIG instances, not on the card."""

    def __init__(self, uuid: str) -> None:
        super().__init__(uuid)
        self.uuid = uuid


class _Hidden(Exception):
    """NVML gave no handle for a GPU, NO_PERMISSION: its device file does not open for this
    process (a container's or a Slurm job's device cgroup), so CUDA does not count it either."""


class _Hung(Exception):
    """A driver call did not return within the deadline."""


class _HandlerRaised(BaseException):
    """What a signal handler of the program's raised while gpuwait waited for NVML's answer
    (the alarm of a program that reserves from Python, its handler raising TimeoutError):
    carried past the backend's own `except Exception`, which would take it for the driver's
    failure, to the backend's edge (`_handlers_own`), and raised there as it was."""

    def __init__(self, raised: Exception) -> None:
        super().__init__(raised)
        self.raised = raised


_F = TypeVar("_F", bound=Callable[..., Any])


def _handlers_own(fn: _F) -> _F:
    """`fn`, one of the backend's entries, raising what a handler of the program's raised
    while it waited for NVML (_HandlerRaised) as it was raised."""

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _HandlerRaised as exc:
            raise exc.raised from None

    return cast("_F", call)


class _Call:
    """One call made in a daemon thread: a call stuck in the driver cannot hold up the process,
    not even its exit."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._result: Any = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="gpuwait-nvml", daemon=True)
        signals.start_deaf(self.thread)

    def _run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as exc:
            self._error = exc

    def result(self, timeout: float | None) -> Any:
        try:
            self.thread.join(timeout)
        except Exception as exc:
            # Nothing of the wait's own: a handler of the program's that ran as it waited.
            raise _HandlerRaised(exc) from None
        if self.thread.is_alive():
            raise _Hung
        if self._error is not None:
            raise self._error
        return self._result


def _within(fn: Callable[[], T], timeout: float | None) -> T:
    result: T = _Call(fn).result(timeout)
    return result


#: The call to nvmlInit that has not come back yet (a driver stuck in the kernel): every later
#: start waits for that one instead of leaving one more thread in the driver, at each retry of
#: a launch that waits hours for it.
_init_pending: list[_Call] = []
_init_lock = threading.Lock()


def _init_within(timeout: float | None) -> None:
    """nvmlInit, waiting at most `timeout` seconds (_Hung), with one call at most in the
    driver at a time in this process: a call that has not come back is waited for again, and
    where it came back meanwhile, its answer is this start's (a late success is counted once,
    as NVML counts its starts: by the one caller that takes it)."""
    while True:
        with _init_lock:
            if not _init_pending:
                _init_pending.append(_Call(pynvml.nvmlInit))
            call = _init_pending[0]
        try:
            call.result(timeout)
        except (_Hung, _HandlerRaised):
            raise
        except Exception:
            if _took(call):
                raise
            continue
        if _took(call):
            return


def _took(call: _Call) -> bool:
    """Take the answer of `call`, the nvmlInit that came back, unless another caller did."""
    with _init_lock:
        if _init_pending and _init_pending[0] is call:
            _init_pending.clear()
            return True
        return False


class NvmlBackend:
    """Live readings from the NVIDIA driver."""

    name = "nvml"

    @_handlers_own
    def __init__(self, timeout: float | None = 5.0) -> None:
        # None: not tried yet. Decided once per backend so that a driver without
        # nvmlDeviceGetMemoryInfo_v2 does not pay a failing call per GPU on every poll.
        self._memory_v2: bool | None = None
        # This reading, still undecided: a GPU answered v1 where v2 failed as a driver without
        # it does (or as one GPU in trouble does): decided at the reading's end, unless
        # another GPU answered v2.
        self._memory_v2_refused = False
        self._open = False
        #: Longest wait for one reading; None waits as long as the driver takes.
        self.timeout = timeout
        #: GPU index -> the reading of it that has not come back yet.
        self._stuck: dict[int, tuple[_Call, float]] = {}
        #: The GPU count's call, while it has not come back (and when it was made).
        self._stuck_count: tuple[_Call, float] | None = None
        #: Whether this process is in the host's pid namespace (asked once, when first needed).
        self._initial_namespace: bool | None = None
        #: NVML was seen naming processes by pids that are not this namespace's: from then on
        #: its process list is left out and memory is counted per card (said once).
        self._host_pids = False
        #: GPU UUID -> the compute mode it last reported: what a reading of the mode that fails
        #: (other than "not supported") is taken to be, since a card taken for shared that
        #: holds one process at a time gets a second job that fails.
        self._modes: dict[str, str] = {}
        #: GPU UUID -> whether MIG mode was on at its last reading: what a reading of the mode
        #: that fails (other than "not supported") is taken to be. Never read, the GPU's
        #: reading fails: a card in MIG mode taken for a whole one gets jobs sent into one of
        #: its MIG instances, whatever room that has.
        self._mig: dict[str, bool] = {}
        #: GPU UUID -> its compute capability as last read (a card's never changes): what a
        #: reading of it that fails (other than "not supported") is taken to be.
        self._capabilities: dict[str, tuple[int, int]] = {}
        #: GPU UUID -> its name as last read: what a reading of it that fails (other than "not
        #: supported") is taken to be.
        self._names: dict[str, str] = {}
        #: An accounting reading did not come back in time: not asked again.
        self._accounting_hung = False
        #: The calls for a card's process list still to try, the one that answers first:
        #: pynvml's (nvmlDeviceGetComputeRunningProcesses_v3), then _v2 for a driver without
        #: _v3 (R450 to R495, 535.98). One found missing is dropped, not asked at each reading.
        self._process_calls: list[Callable[[Any], Any]] = [
            call
            for call in (
                pynvml.nvmlDeviceGetComputeRunningProcesses,
                getattr(pynvml, "nvmlDeviceGetComputeRunningProcesses_v2", None),
            )
            if call is not None
        ]
        try:
            _init_within(timeout)
        except _Hung:
            raise BackendUnavailable(
                f"NVML did not start within {timeout:g}s (the driver is not answering)",
                hint=HUNG_HINT,
            ) from None
        except Exception as exc:
            raise _init_failure(exc) from exc
        self._open = True

    @_handlers_own
    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        # Nothing useful can be done about a failing (or hanging) shutdown at the end of a run.
        with contextlib.suppress(Exception):
            _within(pynvml.nvmlShutdown, self.timeout)

    @_handlers_own
    def snapshot(self) -> MachineSnapshot:
        if not self._open:
            raise BackendUnavailable("the NVML backend is closed", hint=HINT)
        try:
            return self._snapshot()
        except BackendUnavailable:
            raise
        except Exception as exc:
            # A last guard: whatever pynvml or ctypes throws must reach the user as one line.
            raise BackendUnavailable(
                f"reading the GPUs through NVML failed: {_describe(exc)}", hint=HINT
            ) from exc

    def _snapshot(self) -> MachineSnapshot:
        if self._stuck_count is not None and self._stuck_count[0].thread.is_alive():
            # Asking again would cost the deadline and leave one more thread in the driver at
            # every reading, for as long as the driver is wedged.
            raise BackendUnavailable(
                "NVML has not answered when asked for the GPU count for "
                f"{time.monotonic() - self._stuck_count[1]:.0f}s",
                hint=HUNG_HINT,
            )
        self._stuck_count = None
        call = _Call(pynvml.nvmlDeviceGetCount)
        try:
            try:
                count = int(call.result(self.timeout))
            except pynvml.NVMLError as exc:
                if _code(exc) != _UNINITIALIZED:
                    raise
                # NVML was shut down under this process (its count of starts back to 0, by
                # other code of the process): started again, as at the first reading.
                _init_within(self.timeout)
                call = _Call(pynvml.nvmlDeviceGetCount)
                count = int(call.result(self.timeout))
        except _Hung:
            self._stuck_count = (call, time.monotonic())
            raise BackendUnavailable(
                f"NVML did not answer within {self.timeout:g}s when asked for the GPU count",
                hint=HUNG_HINT,
            ) from None
        except Exception as exc:
            raise BackendUnavailable(
                f"NVML could not count the GPUs: {_describe(exc)}", hint=FAILING_HINT
            ) from exc
        gpus: list[GpuSnapshot] = []
        warnings: list[str] = []
        unanswered: list[int] = []
        in_mig_mode: list[tuple[int, str]] = []
        hidden: list[int] = []
        denied: list[int] = []  # hidden, and any other that answered NO_PERMISSION
        self._memory_v2_refused = False
        for index in range(count):
            stuck = self._stuck.get(index)
            if stuck is not None and stuck[0].thread.is_alive():
                warnings.append(
                    f"GPU {index}: NVML has not answered for "
                    f"{time.monotonic() - stuck[1]:.0f}s; treated as unavailable"
                )
                unanswered.append(index)
                continue
            self._stuck.pop(index, None)
            # One GPU at a time, in index order, each with its own deadline: a hung GPU costs
            # the deadline once, and is then skipped until its call comes back.
            call = _Call(lambda i=index: self._read_gpu(i))  # type: ignore[misc]
            try:
                gpu, problems = call.result(self.timeout)
            except _Hung:
                self._stuck[index] = (call, time.monotonic())
                warnings.append(
                    f"GPU {index}: NVML did not answer within {self.timeout:g}s; "
                    "treated as unavailable"
                )
                unanswered.append(index)
                continue
            except _GpuLost as exc:
                warnings.append(f"GPU {index}: {exc}; skipped")
                # It is there, only not answering: a request that needs it is not refused as if
                # it did not exist, but retried as for any failed reading.
                unanswered.append(index)
                continue
            except _MigEnabled as exc:
                in_mig_mode.append((index, exc.uuid))
                warnings.append(
                    f"GPU {index}: MIG mode is on; gpuwait places jobs on whole GPUs only (a "
                    "job sent to it would run in one of its MIG instances, with that instance's "
                    "memory, not the card's); left out"
                )
                continue
            except _Hidden:
                # Not this process's to use (a container's or a Slurm job's device cgroup):
                # no reading will change that, and no job can run there.
                hidden.append(index)
                denied.append(index)
                continue
            except Exception as exc:
                if _code(exc) == _NO_PERMISSION:
                    # Its handle given, a query refused: left out as well, but CUDA, which
                    # opens the card, still counts it.
                    denied.append(index)
                    continue
                warnings.append(f"GPU {index}: {_describe(exc)}; skipped")
                unanswered.append(index)
                continue
            gpus.append(gpu)
            warnings += [f"GPU {index}: {p}" for p in problems]
        if denied:
            # One line for them all: a Slurm job given one card of eight has seven.
            warnings.append(
                f"GPU {', '.join(str(i) for i in denied)}: no permission to use "
                f"{'it' if len(denied) == 1 else 'them'} (NVML error {_NO_PERMISSION}: "
                "hidden from this container or job?); left out"
            )
        if hidden:
            # CUDA numbers only the GPUs this process may open.
            gpus = [g._replace(cuda_index=cuda_number(g.index, hidden)) for g in gpus]
        if self._memory_v2 is None and self._memory_v2_refused:
            self._memory_v2 = False
        if not self._host_pids:
            self._check_pids(gpus, warnings)
        if self._host_pids:
            gpus = [
                g._replace(processes=(), per_process=False, processes_failed=False) for g in gpus
            ]
        # On a card that takes one process at a time, the process's name tells an MPS server
        # (which its clients share the card through) from any other.
        gpus = [with_names(g) if g.compute_mode == COMPUTE_EXCLUSIVE_PROCESS else g for g in gpus]
        return MachineSnapshot(
            backend=self.name,
            gpus=tuple(gpus),
            warnings=tuple(warnings),
            unanswered=tuple(unanswered),
            in_mig_mode=tuple(in_mig_mode),
            hidden=tuple(hidden),
        )

    def _in_initial_namespace(self) -> bool:
        if self._initial_namespace is None:
            # Unknown (no /proc): the pids are checked, as in a container.
            self._initial_namespace = pidns.in_initial_namespace() is True
        return self._initial_namespace

    def _check_pids(self, gpus: list[GpuSnapshot], warnings: list[str]) -> None:
        """Notice, once, that NVML's pids are the host's: a container without --pid=host.

        A job's own processes would then be taken for foreign ones, and worse, a host pid that
        happens to be a job's pid here would lend the job another process's memory (which frees
        room that is not free). Only the card's used memory can be trusted then.
        """
        listed = [p.pid for g in gpus for p in g.processes]
        if not listed or self._in_initial_namespace():
            return
        found = pidns.strangers(listed)
        if found:
            self._host_pids = True
            warnings.append(
                f"NVML names GPU processes by the host's process ids (pid {found[0]} is no GPU "
                "process in this pid namespace: a container without --pid=host?); VRAM is "
                "counted per GPU, not per process"
            )

    def _read_gpu(self, index: int) -> tuple[GpuSnapshot, list[str]]:
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as exc:
            if _code(exc) == _NO_PERMISSION:
                raise _Hidden from exc
            raise
        uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        if self._mig_enabled(handle, uuid):
            raise _MigEnabled(uuid)
        name = self._name(handle, uuid)
        problems: list[str] = []
        total, used, driver = self._memory(handle, problems)
        utilization, utilization_failed = self._utilization(handle)
        processes, processes_failed = self._processes(handle, total, problems)
        gpu = GpuSnapshot(
            index=index,
            uuid=uuid,
            name=name,
            total_bytes=total,
            used_bytes=used,
            driver_bytes=driver,
            processes=processes,
            processes_failed=processes_failed,
            utilization_pct=utilization,
            utilization_failed=utilization_failed,
            compute_capability=self._compute_capability(handle, uuid),
            compute_mode=self._compute_mode(handle, uuid),
        )
        return gpu, problems

    @staticmethod
    def _lost(exc: BaseException) -> bool:
        return _code(exc) == _GPU_IS_LOST

    def _mig_enabled(self, handle: Any, uuid: str) -> bool:
        """Whether the GPU is in MIG mode now. Its memory figures are then the whole card's
        (where they can be read at all), while CUDA given the card's UUID runs a job in one MIG
        instance: admitting by the card's room would put several jobs into one instance's
        memory. Asked at every reading: an administrator may switch the mode (with a GPU reset)
        while gpuwait waits."""
        try:
            current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        except pynvml.NVMLError as exc:
            if self._lost(exc):
                raise _GpuLost(exc) from exc
            if _code(exc) in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
                # No MIG on this GPU, or a driver older than MIG.
                return False
            known = self._mig.get(uuid)
            if known is None:
                raise  # this GPU's reading failed: retried as any failed reading is
            return known
        except (AttributeError, TypeError, ValueError, pynvml.NVMLLibraryMismatchError):
            return False
        found = int(current) == int(pynvml.NVML_DEVICE_MIG_ENABLE)
        self._mig[uuid] = found
        return found

    def _name(self, handle: Any, uuid: str) -> str:
        try:
            name = _text(pynvml.nvmlDeviceGetName(handle))
        except pynvml.NVMLError as exc:
            if self._lost(exc):
                raise _GpuLost(exc) from exc
            if _code(exc) not in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND) and uuid not in self._names:
                # Named "NVIDIA GPU" for a failure that may pass, it would be refused to a
                # --gpu-name request as a card of another kind: this reading failed.
                raise
            # A GPU that cannot tell its name can still run work.
            return self._names.get(uuid, "NVIDIA GPU")
        self._names[uuid] = name
        return name

    def _memory(self, handle: Any, problems: list[str]) -> tuple[int, int, int]:
        """(total, used, the driver's own) in bytes, where used = total - free.

        NVML v2 splits the driver's own reservation out of "used"; that memory is still not
        available to a new process, so it is counted as used and free_bytes stays what the
        driver calls free (which is what v1 reports as used, too). It is also told apart, as
        no process holds it: v1 cannot tell it (0). A GPU that has no memory of its own (both
        versions NOT_SUPPORTED) is given the system's, from /proc/meminfo.
        """
        version = getattr(pynvml, "nvmlMemory_v2", None)
        refused = False
        if self._memory_v2 is not False and version is not None:
            try:
                info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            except pynvml.NVMLError as exc:
                if _code(exc) not in _MEMORY_V2_UNAVAILABLE:
                    raise
                # A driver that answered v2 has it: a failure now is this GPU's (one in
                # trouble), asked v1 this time only. Turned off for good, v1's "used" would
                # count the driver's own memory as a process's on every card from then on.
                # Not answered yet: only a driver that lacks it, or where no GPU of the
                # reading answers v2 and one answers v1, turns it off.
                if self._memory_v2 is None:
                    if _code(exc) in _MEMORY_V2_MISSING:
                        self._memory_v2 = False
                    else:
                        refused = True
            except TypeError:
                # An nvidia-ml-py too old to take `version`.
                self._memory_v2 = False
            else:
                self._memory_v2 = True
                return self._total_used(info, problems)
        try:
            found = self._total_used(pynvml.nvmlDeviceGetMemoryInfo(handle), problems)
        except pynvml.NVMLError as exc:
            shared = proc.system_memory() if _code(exc) == _NOT_SUPPORTED else None
            if shared is None:
                raise
            # No memory of its own (GB10 in DGX Spark, unified memory): the system's memory
            # is the GPU's, and everything that uses it (other programs too) is used.
            total, available = shared
            found = total, total - max(0, min(available, total)), 0
        self._memory_v2_refused |= refused
        return found

    @staticmethod
    def _total_used(info: Any, problems: list[str]) -> tuple[int, int, int]:
        total = int(info.total)
        if total <= 0:
            raise ValueError(f"NVML reported a total of {total} bytes")
        free = int(info.free)
        # v2 splits the driver's reservation out of "used"; v1 has no `reserved`.
        driver = int(getattr(info, "reserved", 0) or 0)
        reported_used = int(info.used) + driver
        if free > total or reported_used > total:
            problems.append(
                f"NVML reported {format_size(reported_used)} used and {format_size(free)} free "
                f"of {format_size(total)}; counted as full"
            )
            return total, total, 0
        used = max(total - max(free, 0), reported_used)
        return total, used, min(max(driver, 0), used)

    def _processes(
        self, handle: Any, total: int, problems: list[str]
    ) -> tuple[tuple[ProcessUsage, ...], bool]:
        """The card's compute processes, and whether the list failed this time (an empty
        list then says nothing of who is there)."""
        for attempt in (1, 2):
            try:
                found = self._process_list(handle)
                break
            except pynvml.NVMLError as exc:
                if self._lost(exc):
                    raise _GpuLost(exc) from exc
                code = _code(exc)
                if code == _INSUFFICIENT_SIZE and attempt == 1:
                    continue  # processes started between pynvml's two calls: asked again
                # Not supported (vGPU, some containers), refused for good (no permission), or
                # a driver older than the v3 call: the memory figures still hold, only
                # attribution to processes is missing. Counted as a failure of this reading
                # instead, a refusal that never ends would keep such a card from every job.
                return (), code not in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND, _NO_PERMISSION)
        if found is None:
            return (), False  # a driver older than R450: no call lists the processes
        processes: list[ProcessUsage] = []
        for process in found:
            used = getattr(process, "usedGpuMemory", None)
            if used is not None and int(used) > total:
                problems.append(
                    f"NVML reported process {int(process.pid)} using {format_size(int(used))} of "
                    f"{format_size(total)}; clamped to the total"
                )
                used = total
            processes.append(
                ProcessUsage(pid=int(process.pid), used_bytes=None if used is None else int(used))
            )
        return tuple(processes), False

    def _process_list(self, handle: Any) -> Any:
        """The card's compute processes as the driver lists them; None where it has no call for
        it. pynvml asks for them through nvmlDeviceGetComputeRunningProcesses_v3 alone, which
        drivers before R510 lack (R470, the last for Kepler cards, among them), and 535.98,
        which dropped it: their _v2 lists the same processes in the same struct. Without it, a job's own memory was nobody's,
        counted beside its reservation as someone else's."""
        while self._process_calls:
            try:
                return self._process_calls[0](handle)
            except pynvml.NVMLLibraryMismatchError:
                pass  # pynvml's word for its unversioned call's FUNCTION_NOT_FOUND
            except pynvml.NVMLError as exc:
                if _code(exc) != _FUNCTION_NOT_FOUND:
                    raise
            del self._process_calls[0]
        return None

    def _compute_capability(self, handle: Any, uuid: str) -> tuple[int, int] | None:
        """None where the driver cannot tell (NOT_SUPPORTED, or no such call). A query that
        fails otherwise keeps the figure last read, and fails the GPU's reading where there is
        none: taken for "cannot tell", it made --min-compute-capability refuse the card."""
        try:
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        except pynvml.NVMLError as exc:
            if self._lost(exc):
                raise _GpuLost(exc) from exc
            if _code(exc) in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND) or uuid in self._capabilities:
                return self._capabilities.get(uuid)
            raise  # this GPU's reading failed: retried as any failed reading is
        except (AttributeError, TypeError, ValueError, pynvml.NVMLLibraryMismatchError):
            # An nvidia-ml-py without the call, or an answer of an unexpected shape: only
            # --min-compute-capability needs it, and it treats "unknown" as not matching.
            return None
        found = int(major), int(minor)
        self._capabilities[uuid] = found
        return found

    def _compute_mode(self, handle: Any, uuid: str) -> str:
        """The card's compute mode (`nvidia-smi -c`), asked at every reading: an administrator
        may change it while gpuwait waits. A driver that cannot tell (NOT_SUPPORTED, an old
        nvidia-ml-py) lets any number of processes in: "default". A query that fails keeps the
        mode last read, and fails the GPU's reading where there is none (a launch's first)."""
        try:
            mode = int(pynvml.nvmlDeviceGetComputeMode(handle))
        except pynvml.NVMLError as exc:
            if self._lost(exc):
                raise _GpuLost(exc) from exc
            if _code(exc) in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
                return COMPUTE_DEFAULT
            if uuid not in self._modes:
                raise  # never read: this GPU's reading failed, retried as any failed one
            return self._modes[uuid]
        except (AttributeError, TypeError, ValueError, pynvml.NVMLLibraryMismatchError):
            return COMPUTE_DEFAULT
        if mode == int(pynvml.NVML_COMPUTEMODE_PROHIBITED):
            found = COMPUTE_PROHIBITED
        elif mode in (
            int(pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS),
            int(pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD),
        ):
            found = COMPUTE_EXCLUSIVE_PROCESS
        else:
            found = COMPUTE_DEFAULT
        self._modes[uuid] = found
        return found

    def _utilization(self, handle: Any) -> tuple[int | None, bool]:
        """(percent, whether the reading failed). None and not failed: the GPU does not report
        utilization (NOT_SUPPORTED: a MIG parent, some vGPUs). Any other error is this
        reading's failure, not the GPU's nature: taken for "does not report", it let a busy
        GPU pass a --max-util cap."""
        try:
            rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
        except pynvml.NVMLError as exc:
            if self._lost(exc):
                raise _GpuLost(exc) from exc
            return None, _code(exc) not in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND)
        return int(rates.gpu), False

    @_handlers_own
    def accounting_peak(
        self, uuid: str, pids: frozenset[int], since: float | None = None
    ) -> int | None:
        """The most memory `pids` held on the GPU over their lifetime, from NVML accounting mode.

        NVML keeps the maximum itself, so peaks between two samples are seen, and it is still
        there after the processes exited. For several pids this is the sum of their maxima (an
        upper bound of their joint peak). None where accounting mode is off, unsupported, not
        permitted, or knows none of the pids, and outside the host's pid namespace.

        `since`: when (wall clock) the first of the processes started. NVML keeps ended
        processes' stats and answers for a pid with its last process's: one that started
        before is an earlier process that had the pid, not one of these.
        """
        # Accounting is kept by host pid, and `pids` are this namespace's.
        if not self._open or not pids or not self._in_initial_namespace():
            return None
        if self._accounting_hung:
            return None
        try:
            # Asked once the command has ended, before its exit status is passed on: a driver
            # that stopped answering must not keep gpuwait from ending (nor cost the deadline
            # again for the job's next GPU).
            return _within(lambda: self._accounting_peak(uuid, pids, since), self.timeout)
        except _Hung:
            self._accounting_hung = True
            return None
        except Exception:
            # Optional figure: whatever the driver says about accounting, the run goes on.
            return None

    @staticmethod
    def _accounting_peak(uuid: str, pids: frozenset[int], since: float | None) -> int | None:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        if pynvml.nvmlDeviceGetAccountingMode(handle) != pynvml.NVML_FEATURE_ENABLED:
            return None
        known = {int(p) for p in pynvml.nvmlDeviceGetAccountingPids(handle)}
        total = 0
        found = False
        for pid in sorted(pids & known):
            stats = pynvml.nvmlDeviceGetAccountingStats(handle, pid)
            # Microseconds of the wall clock; a second's slack for the clocks' grain.
            if since is not None and int(stats.startTime) < (since - 1.0) * 1e6:
                continue
            # Not available: pynvml says None, an older one all ones (NVML_VALUE_NOT_AVAILABLE).
            peak = -1 if stats.maxMemoryUsage is None else int(stats.maxMemoryUsage)
            if 0 <= peak < 2**62:
                total += peak
                found = True
        return total if found else None


@_handlers_own
def driver_version(timeout: float | None = 5.0) -> str | None:
    """The NVIDIA driver's version ("570.86.10"); None where NVML cannot tell (no driver, or
    one that fails or does not answer in time). For questions about the machine, not the GPUs:
    it opens and closes NVML by itself."""
    try:
        _within(pynvml.nvmlInit, timeout)
    except Exception:
        return None  # whatever failed, the answer is the same: no driver to go by
    try:
        return _text(_within(pynvml.nvmlSystemGetDriverVersion, timeout))
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            _within(pynvml.nvmlShutdown, timeout)
