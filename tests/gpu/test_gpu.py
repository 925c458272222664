"""On a real NVIDIA GPU: real NVML, real CUDA jobs allocating real memory. Skipped elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def _real_gpu_count() -> int:
    # In a subprocess: the test process may have the fake libnvidia-ml loaded.
    probe = "import pynvml; pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())"
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return int(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip().isdigit() else 0


def _has_torch_cuda() -> bool:
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return (
        subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120).returncode
        == 0
    )


@pytest.fixture(scope="module")
def real_gpu() -> int:
    count = _real_gpu_count()
    if count == 0:
        pytest.skip("no NVIDIA GPU and driver here")
    return count


ALLOCATE = textwrap.dedent(
    """
    import os, sys, time, torch
    assert torch.cuda.device_count() == 1, torch.cuda.device_count()
    n = int(float(sys.argv[1]) * 2**30)
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    torch.cuda.synchronize()
    time.sleep(float(sys.argv[2]))
    print(os.environ["CUDA_VISIBLE_DEVICES"])
    """
)


def test_real_nvml_snapshot(real_gpu: int) -> None:
    from gpuwait.gpu.nvml import NvmlBackend

    backend = NvmlBackend()
    try:
        snapshot = backend.snapshot()
    finally:
        backend.close()
    assert len(snapshot.gpus) == real_gpu
    for gpu in snapshot.gpus:
        assert gpu.uuid.startswith(("GPU-", "MIG-"))
        assert 0 <= gpu.used_bytes <= gpu.total_bytes


def test_real_cuda_job_records_its_peak(real_gpu: int, gpuwait_cmd: list[str]) -> None:
    if not _has_torch_cuda():
        pytest.skip("PyTorch with CUDA is not installed")
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "4G", "--", sys.executable, "-c", ALLOCATE, "2", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("GPU-")
    history = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    record = json.loads(history.read_text().splitlines()[-1])
    # 2 GiB of tensor plus the CUDA context. Without per-pid figures (containers) the growth of
    # the card's used memory stands in, marked approximate; with other jobs there it is unknown.
    assert record["peak_bytes"] is None or record["peak_bytes"] >= 2 * 2**30
    assert record["peak_bytes"] is not None or record["peak_approximate"] is False


def test_real_jobs_that_do_not_fit_together_are_serialised(
    real_gpu: int, gpuwait_cmd: list[str]
) -> None:
    if not _has_torch_cuda():
        pytest.skip("PyTorch with CUDA is not installed")
    from gpuwait.gpu.nvml import NvmlBackend

    backend = NvmlBackend()
    try:
        gpu = backend.snapshot().gpus[0]
    finally:
        backend.close()
    share = 0.55 * gpu.total_bytes / 2**30
    procs = [
        subprocess.Popen(
            [
                *gpuwait_cmd,
                "--devices",
                "0",
                "--vram",
                f"{share + 1:.1f}G",
                "--",
                sys.executable,
                "-c",
                ALLOCATE,
                f"{share:.1f}",
                "3",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=600), p.stderr.read() if p.stderr else "") for p in procs]
    assert all(code == 0 for code, _ in results), results
    assert not any("out of memory" in err.lower() for _, err in results)
