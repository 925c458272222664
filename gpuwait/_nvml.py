"""The NVML backend: the one module that talks to the NVIDIA driver (through pynvml).

Everything pynvml can throw is turned into either a per-GPU warning (that GPU is left out,
the others still serve) or BackendUnavailable (no readings at all), so callers never see an
NVML exception or a traceback.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pynvml  # type: ignore[import-untyped]

from gpuwait._errors import BackendUnavailable
from gpuwait._snapshot import GpuSnapshot, MachineSnapshot, ProcessUsage

HINT = (
    "install the NVIDIA driver, or set GPUWAIT_SIM=FILE to use simulated GPUs; "
    "on_no_gpu in config.toml decides whether commands run anyway"
)

# NVML return codes, spelled out so this module does not depend on which error classes a
# given nvidia-ml-py release generates.
_NO_PERMISSION = 4
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_LIB_RM_VERSION_MISMATCH = 18
_NOT_SUPPORTED = 3
_ARGUMENT_VERSION_MISMATCH = 25
_UNKNOWN = 999

# Answers from nvmlDeviceGetMemoryInfo_v2 that mean "this driver cannot do v2", not "this GPU
# is broken": older drivers lack the symbol or reject the struct version, and some report
# Unknown or NotSupported instead. v1 is then asked; a broken GPU fails there too.
_MEMORY_V2_UNAVAILABLE = frozenset(
    {_FUNCTION_NOT_FOUND, _ARGUMENT_VERSION_MISMATCH, _UNKNOWN, _NOT_SUPPORTED}
)


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
        message = "NVIDIA driver is installed but not loaded (NVML error 9)"
    elif code == _NO_PERMISSION:
        message = "no permission to use the NVIDIA driver (NVML error 4)"
    elif code == _LIB_RM_VERSION_MISMATCH:
        # Typical right after a driver upgrade without a reboot; the generic hint would mislead.
        return BackendUnavailable(
            "NVIDIA driver and NVML library versions do not match (NVML error 18)",
            hint="reboot, or reload the nvidia kernel modules, after a driver upgrade; "
            "GPUWAIT_SIM=FILE uses simulated GPUs meanwhile",
        )
    else:
        message = f"NVML could not start: {_describe(exc)}"
    return BackendUnavailable(message, hint=HINT)


class _GpuLost(Exception):
    """A GPU stopped answering halfway through its reading."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(_describe(cause))


class NvmlBackend:
    """Live readings from the NVIDIA driver."""

    name = "nvml"

    def __init__(self) -> None:
        # None: not tried yet. Decided once per backend so that a driver without
        # nvmlDeviceGetMemoryInfo_v2 does not pay a failing call per GPU on every poll.
        self._memory_v2: bool | None = None
        self._open = False
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            raise _init_failure(exc) from exc
        self._open = True

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        # Nothing useful can be done about a failing shutdown at the end of a run.
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()

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
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except Exception as exc:
            raise BackendUnavailable(
                f"NVML could not count the GPUs: {_describe(exc)}", hint=HINT
            ) from exc
        gpus: list[GpuSnapshot] = []
        warnings: list[str] = []
        for index in range(count):
            try:
                gpus.append(self._read_gpu(index))
            except _GpuLost as exc:
                warnings.append(f"GPU {index}: {exc}; skipped")
            except Exception as exc:
                warnings.append(f"GPU {index}: {_describe(exc)}; skipped")
        return MachineSnapshot(backend=self.name, gpus=tuple(gpus), warnings=tuple(warnings))

    def _read_gpu(self, index: int) -> GpuSnapshot:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        name = self._name(handle)
        total, used = self._memory(handle)
        return GpuSnapshot(
            index=index,
            uuid=uuid,
            name=name,
            total_bytes=total,
            used_bytes=used,
            processes=self._processes(handle),
            utilization_pct=self._utilization(handle),
        )

    @staticmethod
    def _lost(exc: BaseException) -> bool:
        return _code(exc) == _GPU_IS_LOST

    def _name(self, handle: Any) -> str:
        try:
            return _text(pynvml.nvmlDeviceGetName(handle))
        except pynvml.NVMLError as exc:
            if self._lost(exc):
                raise _GpuLost(exc) from exc
            # The name is only shown; a GPU that cannot tell it can still run work.
            return "NVIDIA GPU"

    def _memory(self, handle: Any) -> tuple[int, int]:
        """(total, used) in bytes, where used = total - free.

        NVML v2 splits the driver's own reservation out of "used"; that memory is still not
        available to a new process, so it is counted as used and free_bytes stays what the
        driver calls free (which is what v1 reports as used, too).
        """
        version = getattr(pynvml, "nvmlMemory_v2", None)
        if self._memory_v2 is not False and version is not None:
            try:
                info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            except pynvml.NVMLError as exc:
                if _code(exc) not in _MEMORY_V2_UNAVAILABLE:
                    raise
                self._memory_v2 = False
            except TypeError:
                # An nvidia-ml-py too old to take `version`.
                self._memory_v2 = False
            else:
                self._memory_v2 = True
                return self._total_used(info)
        return self._total_used(pynvml.nvmlDeviceGetMemoryInfo(handle))

    @staticmethod
    def _total_used(info: Any) -> tuple[int, int]:
        total = int(info.total)
        free = min(max(int(info.free), 0), total)
        return total, total - free

    def _processes(self, handle: Any) -> tuple[ProcessUsage, ...]:
        try:
            found = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except pynvml.NVMLError as exc:
            if self._lost(exc):
                raise _GpuLost(exc) from exc
            # Not supported (vGPU, some containers), or a driver older than the v3 call:
            # the memory figures still hold, only attribution to processes is missing.
            return ()
        except pynvml.NVMLLibraryMismatchError:
            return ()
        processes: list[ProcessUsage] = []
        for proc in found:
            used = getattr(proc, "usedGpuMemory", None)
            processes.append(
                ProcessUsage(pid=int(proc.pid), used_bytes=None if used is None else int(used))
            )
        return tuple(processes)

    def _utilization(self, handle: Any) -> int | None:
        try:
            rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
        except pynvml.NVMLError as exc:
            if self._lost(exc):
                raise _GpuLost(exc) from exc
            return None
        return int(rates.gpu)

    def accounting_peak(self, uuid: str, pids: frozenset[int]) -> int | None:
        """The most memory `pids` held on the GPU over their lifetime, from NVML accounting mode.

        NVML keeps the maximum itself, so peaks between two samples are seen, and it is still
        there after the processes exited. For several pids this is the sum of their maxima (an
        upper bound of their joint peak). None where accounting mode is off, unsupported, not
        permitted, or knows none of the pids (in a container NVML reports host pids).
        """
        if not self._open or not pids:
            return None
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            if pynvml.nvmlDeviceGetAccountingMode(handle) != pynvml.NVML_FEATURE_ENABLED:
                return None
            known = {int(p) for p in pynvml.nvmlDeviceGetAccountingPids(handle)}
            total = 0
            found = False
            for pid in sorted(pids & known):
                peak = int(pynvml.nvmlDeviceGetAccountingStats(handle, pid).maxMemoryUsage)
                if 0 <= peak < 2**62:  # NVML_VALUE_NOT_AVAILABLE is all ones
                    total += peak
                    found = True
            return total if found else None
        except Exception:
            # Optional figure: whatever the driver says about accounting, the run goes on.
            return None
