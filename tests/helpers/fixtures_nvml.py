"""Fixtures that put real pynvml in front of the fake libnvidia-ml.so.1 (tests/fake_nvml).

`fake_nvml` describes the machine through the state file the fake reads on every call, so a
test changes GPUs, processes and faults between two snapshots without restarting anything.
It serves both the test's own process (pynvml is pointed at the fake) and subprocesses
(`fake_nvml.env()` puts the fake first on LD_LIBRARY_PATH).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

FAKE_SOURCE = Path(__file__).resolve().parent / "fake_nvml" / "fake_nvml.c"
LIB_NAME = "libnvidia-ml.so.1"
# The copy loaded into the pytest process carries another soname: glibc answers a later
# dlopen("libnvidia-ml.so.1") with any loaded object of that soname, which would hide the real
# driver from gpu-marked tests that run after these in the same process.
INPROC_LIB_NAME = "libfake-nvml-inproc.so"

GIB = 1024**3

# NVML return codes the tests inject.
NOT_SUPPORTED = 3
NO_PERMISSION = 4
DRIVER_NOT_LOADED = 9
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
ARGUMENT_VERSION_MISMATCH = 25
UNKNOWN = 999


@dataclass(frozen=True)
class FakeGpu:
    """One fake GPU. `used` excludes `reserved` (NVML v2's split); util None: not supported."""

    total: int = 80 * GIB
    used: int = 0
    reserved: int = 0
    util: int | None = 0
    name: str = "Fake A100"
    #: "8.0"; None: the driver answers NOT_SUPPORTED.
    cc: str | None = None
    uuid: str = ""  # empty: GPU-fake-<index>
    #: MIG mode on (True) or off (False); None: the driver answers NOT_SUPPORTED (no MIG).
    mig: bool | None = None
    #: NVML compute mode: 0 default, 1 exclusive thread, 2 prohibited, 3 exclusive process;
    #: None: the driver answers NOT_SUPPORTED.
    mode: int | None = 0
    #: The first `grow` process lists read with a buffer find the list grown past it
    #: (processes started between pynvml's two calls): INSUFFICIENT_SIZE.
    grow: int = 0


@dataclass(frozen=True)
class FakeProcess:
    gpu: int
    pid: int
    mem: int | None  # None: the driver cannot tell ("na")


@dataclass(frozen=True)
class FakeFailure:
    gpu: int | None  # None: every GPU ("*"), and calls that name no GPU
    func: str
    code: int


@dataclass(frozen=True)
class FakeHang:
    gpu: int | None  # None: every GPU ("*"), and calls that name no GPU
    func: str
    seconds: float


def _encode_text(text: str) -> str:
    # The fake reads '_' as a space and %XX as a byte, so literal underscores are escaped.
    return urllib.parse.quote(text, safe="").replace("_", "%5F").replace("%20", "_")


@dataclass
class FakeNvml:
    """The fake machine. Every mutator rewrites the state file at once."""

    lib_dir: Path
    state_path: Path
    log_path: Path
    gpus: list[FakeGpu] = field(default_factory=list)
    processes: list[FakeProcess] = field(default_factory=list)
    failures: list[FakeFailure] = field(default_factory=list)
    hangs: list[FakeHang] = field(default_factory=list)
    init_code: int | None = None
    driver: str = "999.99.99"

    def __post_init__(self) -> None:
        self.write()

    # -- the machine ----------------------------------------------------------------------

    def set_gpus(self, gpus: list[FakeGpu]) -> None:
        """Replace the GPUs; list position is the NVML index."""
        self.gpus = list(gpus)
        self.write()

    def update_gpu(self, index: int, **changes: Any) -> None:
        """Change fields of one GPU, e.g. update_gpu(0, used=3 * GIB)."""
        self.gpus[index] = replace(self.gpus[index], **changes)
        self.write()

    def add_process(self, gpu: int, pid: int, mem: int | None) -> None:
        self.processes.append(FakeProcess(gpu, pid, mem))
        self.write()

    def clear_processes(self, gpu: int | None = None) -> None:
        self.processes = [p for p in self.processes if gpu is not None and p.gpu != gpu]
        self.write()

    def fail(self, gpu: int | None, func: str, code: int) -> None:
        """Make `func` answer `code` for GPU `gpu` (None: every GPU and GPU-less calls)."""
        self.failures.append(FakeFailure(gpu, func, code))
        self.write()

    def clear_failures(self) -> None:
        self.failures = []
        self.hangs = []
        self.write()

    def hang(self, gpu: int | None, func: str, seconds: float) -> None:
        """Make `func` sleep `seconds` before answering for GPU `gpu` (None: every GPU)."""
        self.hangs.append(FakeHang(gpu, func, seconds))
        self.write()

    def fail_init(self, code: int | None) -> None:
        """nvmlInitWithFlags answers `code` (None: succeeds again)."""
        self.init_code = code
        self.write()

    # -- files and environment ------------------------------------------------------------

    def state_text(self) -> str:
        lines = [f"driver {_encode_text(self.driver)}"]
        for index, gpu in enumerate(self.gpus):
            uuid = gpu.uuid or f"GPU-fake-{index}"
            util = "na" if gpu.util is None else str(gpu.util)
            lines.append(
                f"gpu {index} uuid={_encode_text(uuid)} name={_encode_text(gpu.name)}"
                f" total={gpu.total} used={gpu.used} reserved={gpu.reserved} util={util}"
                f" cc={gpu.cc or 'na'}"
                f" mig={'na' if gpu.mig is None else int(gpu.mig)}"
                f" mode={'na' if gpu.mode is None else gpu.mode}"
                f" grow={gpu.grow}"
            )
        for proc in self.processes:
            mem = "na" if proc.mem is None else str(proc.mem)
            lines.append(f"proc {proc.gpu} pid={proc.pid} mem={mem}")
        for failure in self.failures:
            where = "*" if failure.gpu is None else str(failure.gpu)
            lines.append(f"fail {where} {failure.func} {failure.code}")
        for hang in self.hangs:
            where = "*" if hang.gpu is None else str(hang.gpu)
            lines.append(f"hang {where} {hang.func} {hang.seconds}")
        if self.init_code is not None:
            lines.append(f"init_fail {self.init_code}")
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        # Write and rename, so a call in another process never reads half a file.
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(self.state_text())
        os.replace(tmp, self.state_path)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for a subprocess that should load the fake as the NVIDIA driver."""
        env = dict(os.environ if base is None else base)
        env["FAKE_NVML_STATE"] = str(self.state_path)
        env["FAKE_NVML_LOG"] = str(self.log_path)
        old = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = str(self.lib_dir) + (os.pathsep + old if old else "")
        return env

    def calls(self) -> list[str]:
        """Log lines of every call so far, e.g. "nvmlDeviceGetUUID gpu=1 ret=15"."""
        if not self.log_path.exists():
            return []
        return self.log_path.read_text().splitlines()

    def clear_calls(self) -> None:
        self.log_path.unlink(missing_ok=True)


def _compile(out: Path, soname: str) -> None:
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-Wl,-soname,{soname}",
            "-o",
            str(out),
            str(FAKE_SOURCE),
            "-lpthread",
        ],
        check=True,
        capture_output=True,
        text=True,
    )


@pytest.fixture(scope="session")
def fake_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory holding the compiled fake as libnvidia-ml.so.1 (for LD_LIBRARY_PATH)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the fake NVML library")
    root = tmp_path_factory.mktemp("fake_nvml")
    lib_dir = root / "lib"
    lib_dir.mkdir()
    try:
        _compile(lib_dir / LIB_NAME, LIB_NAME)
        _compile(root / INPROC_LIB_NAME, INPROC_LIB_NAME)
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"building the fake NVML library failed:\n{exc.stderr}")
    return lib_dir


@pytest.fixture(scope="session")
def _fake_nvml_inproc(fake_nvml_lib: Path) -> ctypes.CDLL:
    # One load per process: the fake keeps no state between calls besides the init count.
    return ctypes.CDLL(str(fake_nvml_lib.parent / INPROC_LIB_NAME))


@pytest.fixture
def fake_nvml(
    fake_nvml_lib: Path,
    _fake_nvml_inproc: ctypes.CDLL,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[FakeNvml]:
    """A fake machine with no GPUs yet, live for pynvml in this process and in subprocesses."""
    import pynvml  # type: ignore[import-untyped]

    fake = FakeNvml(
        lib_dir=fake_nvml_lib,
        state_path=tmp_path / "fake_nvml.state",
        log_path=tmp_path / "fake_nvml.log",
    )
    monkeypatch.setenv("FAKE_NVML_STATE", str(fake.state_path))
    monkeypatch.setenv("FAKE_NVML_LOG", str(fake.log_path))
    old_ld = os.environ.get("LD_LIBRARY_PATH")
    monkeypatch.setenv(
        "LD_LIBRARY_PATH", str(fake_nvml_lib) + (os.pathsep + old_ld if old_ld else "")
    )

    # pynvml keeps the library and every function pointer in module globals; point them at
    # the fake for this test and give back whatever was there (a real driver, or nothing).
    _fake_nvml_inproc.fakeNvmlReset()
    # A start of NVML that an earlier test left in the fake counted in the count just forgotten.
    from gpuwait.gpu import nvml

    with nvml._init_lock:
        nvml._init_pending.clear()
    with pynvml.libLoadLock:
        saved = (pynvml.nvmlLib, pynvml._nvmlLib_refcount)
        pynvml.nvmlLib = _fake_nvml_inproc
        pynvml._nvmlLib_refcount = 0
        pynvml._nvmlGetFunctionPointer_cache.clear()
    try:
        yield fake
    finally:
        with pynvml.libLoadLock:
            pynvml.nvmlLib, pynvml._nvmlLib_refcount = saved
            pynvml._nvmlGetFunctionPointer_cache.clear()
