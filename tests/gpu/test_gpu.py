"""On a real NVIDIA GPU: real NVML, real CUDA jobs allocating real memory. Skipped elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuwait.core.snapshot import GpuSnapshot

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


def _first_gpu() -> GpuSnapshot:
    """GPU 0 as gpuwait reads it through the real NVML."""
    from gpuwait.gpu.nvml import NvmlBackend

    backend = NvmlBackend()
    try:
        return backend.snapshot().gpus[0]
    finally:
        backend.close()


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
    share = 0.55 * _first_gpu().total_bytes / 2**30
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


def _limited_beside_a_neighbour(
    gpuwait_cmd: list[str], python: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], subprocess.Popen[str]]:
    """A neighbour holding 1.5 GiB for 8 s, and beside it a job reserving 2 GiB under
    `--enforce limit` that tries to allocate 4 GiB."""
    full = {**os.environ, **(env or {})}
    neighbour = subprocess.Popen(
        [*gpuwait_cmd, "--devices", "0", "--vram", "2G", "--", *python, "-c", ALLOCATE, "1.5", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full,
    )
    over = subprocess.run(
        [
            *gpuwait_cmd,
            "--devices",
            "0",
            "--enforce",
            "limit",
            "--vram",
            "2G",
            "--",
            *python,
            "-c",
            ALLOCATE,
            "4",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=full,
    )
    neighbour.wait(timeout=300)
    return over, neighbour


def test_real_pytorch_job_over_its_limit_fails_alone(real_gpu: int, gpuwait_cmd: list[str]) -> None:
    if not _has_torch_cuda():
        pytest.skip("PyTorch with CUDA is not installed")
    over, neighbour = _limited_beside_a_neighbour(gpuwait_cmd, [sys.executable])
    assert neighbour.returncode == 0, neighbour.stderr.read() if neighbour.stderr else ""
    assert over.returncode != 0
    assert "out of memory" in over.stderr.lower(), over.stderr
    history = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    records = [json.loads(line) for line in history.read_text().splitlines()]
    failed = [r for r in records if r.get("oom")]
    assert [r["oom_cause"] for r in failed] == ["own limit"]
    assert "PyTorch allocator cap" in failed[0]["budget"]["held_by"]


def test_real_mps_limit_holds_a_job_the_pytorch_cap_does_not_reach(
    real_gpu: int, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    import shutil

    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        pytest.skip("no CUDA MPS here")
    if not _has_torch_cuda():
        pytest.skip("PyTorch with CUDA is not installed")
    mps_env = {
        "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "log"),
    }
    for path in mps_env.values():
        os.mkdir(path)
    subprocess.run([control, "-d"], env={**os.environ, **mps_env}, check=True, timeout=60)
    try:
        # `python -I` ignores PYTHONPATH, so gpuwait's PyTorch hook never runs: only MPS holds.
        over, neighbour = _limited_beside_a_neighbour(
            gpuwait_cmd, [sys.executable, "-I"], env=mps_env
        )
    finally:
        subprocess.run(
            [control], input="quit\n", text=True, env={**os.environ, **mps_env}, timeout=60
        )
    assert neighbour.returncode == 0
    assert over.returncode != 0
    assert "out of memory" in over.stderr.lower(), over.stderr


#: Grows to `share` GiB in four steps (as a model loads), holds it, then prints its GPU.
RAMP = textwrap.dedent(
    """
    import os, sys, time, torch
    share, parts = float(sys.argv[1]), []
    for _ in range(4):
        parts.append(torch.ones(int(share * 2**30) // 16, device="cuda"))
        torch.cuda.synchronize()
        time.sleep(0.5)
    time.sleep(1.0)
    print(os.environ["CUDA_VISIBLE_DEVICES"])
    """
)


def test_real_stampede_of_ramping_jobs_runs_every_one_without_oom(
    real_gpu: int, gpuwait_cmd: list[str]
) -> None:
    """Eight jobs that each grow to a fifth of the card, launched at once: together they need
    1.6 cards, so started as they come (the free-memory pollers' way, each seeing the card empty
    before the others have allocated) some die of out-of-memory. Under gpuwait every one
    finishes, and the memory reserved at once never passes the usable share (90 %)."""
    if not _has_torch_cuda():
        pytest.skip("PyTorch with CUDA is not installed")
    total = _first_gpu().total_bytes
    share = 0.2 * total / 2**30
    # The context (a few hundred MiB) on top of the tensors.
    request = f"{share + 1:.1f}G"
    ramp = [sys.executable, "-c", RAMP, f"{share:.2f}"]
    procs = [
        subprocess.Popen(
            [*gpuwait_cmd, "--devices", "0", "--vram", request, "--", *ramp],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        results.append((p.returncode, out, err))
    assert [code for code, _, _ in results] == [0] * 8, results
    assert not any("out of memory" in err.lower() for _, _, err in results), results
    history = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    records = [json.loads(line) for line in history.read_text().splitlines()]
    assert len(records) == 8 and not any(r["oom"] for r in records)
    spans = [
        (r["started_at"], r["started_at"] + r["run_seconds"], r["reserved_bytes"]) for r in records
    ]
    for start, _, _ in spans:
        at_once = sum(size for s, e, size in spans if s <= start < e)
        assert at_once <= 0.9 * total, (at_once, total)
    assert max(sum(1 for s, e, _ in spans if s <= start < e) for start, _, _ in spans) < 8
