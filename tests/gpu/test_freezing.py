"""`--freezable` is refused in one clear line (exit 2), naming what the machine lacks for CUDA
checkpointing, and accepted on one that has it all. The machine is made of fakes: a
`cuda-checkpoint` script on PATH, a libcuda.so.1 built here that exports the checkpoint API (or
not), and the fake NVML for the driver's version."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.fixtures_nvml import FakeGpu, FakeNvml

GPUWAIT = [sys.executable, "-m", "gpuwait"]
NO_DRIVER = (
    "gpuwait: error: --freezable: this machine cannot freeze CUDA jobs (no cuda-checkpoint on "
    "PATH; no libcuda.so.1; no NVIDIA driver answered through NVML); use --pausable with a job "
    "that checkpoints itself (see docs/freezing.md)\n"
)


def libcuda(directory: Path, *symbols: str) -> Path:
    """`directory` with a libcuda.so.1 exporting `symbols` (functions that must never be
    called: each would kill the process)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build a fake libcuda")
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "libcuda.c"
    source.write_text(
        "#include <stdlib.h>\nint cuInit(unsigned f) { abort(); }\n"
        + "".join(f"int {name}(int pid, void *args) {{ abort(); }}\n" for name in symbols)
    )
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(directory / "libcuda.so.1"), str(source)],
        check=True,
        capture_output=True,
    )
    return directory


def tool(directory: Path) -> Path:
    """`directory` with a cuda-checkpoint that leaves a mark if it is ever run."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "cuda-checkpoint"
    script.write_text(f"#!/bin/sh\ntouch {directory / 'was-run'}\n")
    script.chmod(0o755)
    return directory


def freezable(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPUWAIT, "--freezable", "--vram", "1G", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def plain_env() -> dict[str, str]:
    """No driver at all: no NVML, no libcuda, no cuda-checkpoint."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "GPUWAIT_SIM")}
    env["PATH"] = "/usr/bin:/bin"
    return env


def test_refused_naming_everything_missing(tmp_path: Path) -> None:
    done = freezable(plain_env())
    if "no libcuda.so.1" not in done.stderr:
        pytest.skip("this machine has an NVIDIA driver")
    assert done.returncode == 2
    assert done.stderr == NO_DRIVER
    assert done.stdout == ""


def test_refused_naming_what_is_missing(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    fake_nvml.set_gpus([FakeGpu()])
    fake_nvml.driver = "550.54.15"
    fake_nvml.write()
    env = fake_nvml.env(plain_env())
    env["LD_LIBRARY_PATH"] = f"{libcuda(tmp_path / 'lib')}:{env['LD_LIBRARY_PATH']}"
    done = freezable(env)
    assert done.returncode == 2
    assert done.stderr == (
        "gpuwait: error: --freezable: this machine cannot freeze CUDA jobs (no cuda-checkpoint "
        "on PATH; libcuda.so.1 has no CUDA checkpoint API (cuCheckpointProcessLock); driver "
        "550.54.15 is older than 570); use --pausable with a job that checkpoints itself (see "
        "docs/freezing.md)\n"
    )


def test_accepted_where_everything_is_there(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    fake_nvml.set_gpus([FakeGpu()])
    fake_nvml.driver = "570.86.10"
    fake_nvml.write()
    env = fake_nvml.env(plain_env())
    lib = libcuda(
        tmp_path / "lib",
        "cuCheckpointProcessLock",
        "cuCheckpointProcessCheckpoint",
        "cuCheckpointProcessRestore",
        "cuCheckpointProcessUnlock",
        "cuCheckpointProcessGetState",
    )
    env["LD_LIBRARY_PATH"] = f"{lib}:{env['LD_LIBRARY_PATH']}"
    bin_dir = tool(tmp_path / "bin")
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    done = freezable(env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    # Detection only: the job ran, and nobody asked it to step aside, so nothing was frozen.
    assert not (bin_dir / "was-run").exists()


def test_a_bad_command_line_is_still_told_first() -> None:
    done = subprocess.run([*GPUWAIT, "--freezable"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "no command given" in done.stderr
