"""On a real NVIDIA GPU with CUDA checkpointing (driver 570 or newer, cuda-checkpoint on PATH): a
PyTorch job under `--freezable` is frozen for an urgent one and thawed, and its result is the
one a bare run gives. Skipped elsewhere, saying why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.waiting import ledger_entries, wait_for

pytestmark = pytest.mark.gpu

#: Deterministic work in steps, holding `share` GiB meanwhile; prints a checksum.
CHECKSUM = textwrap.dedent(
    """
    import sys, time, torch
    torch.use_deterministic_algorithms(True)
    share, steps = float(sys.argv[1]), int(sys.argv[2])
    held = torch.ones(int(share * 2**30) // 4, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1234)
    a = torch.randn(1024, 1024, device="cuda", generator=g)
    total = torch.zeros((), dtype=torch.float64, device="cuda")
    for step in range(steps):
        a = torch.tanh(a @ a.T / 1024)
        total += a.double().sum() + held[step * 4096].double()
        torch.cuda.synchronize()
        time.sleep(0.25)
    print(f"{total.item():.12e}")
    """
)
HOLD = "import sys, time, torch; x = torch.ones(int(float(sys.argv[1]) * 2**30) // 4, "
HOLD += "device='cuda'); torch.cuda.synchronize(); time.sleep(2)"


def _requirements() -> tuple[str, float]:
    """Why this cannot run here, or ("", the GiB each job holds)."""
    probe = "import pynvml; pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    if done.returncode != 0 or done.stdout.strip() in ("", "0"):
        return "no NVIDIA GPU and driver here", 0.0
    from gpuwait.gpu.freezing import detect

    lacks = detect().missing()
    if lacks:
        return "this machine cannot freeze CUDA jobs: " + "; ".join(lacks), 0.0
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    if subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120).returncode:
        return "PyTorch with CUDA is not installed", 0.0
    from gpuwait.gpu.nvml import NvmlBackend

    backend = NvmlBackend()
    try:
        gpu = backend.snapshot().gpus[0]
    finally:
        backend.close()
    return "", round(0.55 * gpu.free_bytes / 2**30, 1)


def events() -> list[dict[str, object]]:
    path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_frozen_pytorch_job_gives_the_result_of_a_bare_run(
    gpuwait_cmd: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    why, share = _requirements()
    if why:
        pytest.skip(why)
    monkeypatch.setenv("GPUWAIT_PAUSE_MIN_RUNTIME", "1s")
    # cuBLAS is deterministic with a fixed workspace.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    steps = "40"
    bare = subprocess.run(
        [sys.executable, "-c", CHECKSUM, str(share), steps],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
    )
    assert bare.returncode == 0, bare.stderr
    reserve = f"{share + 1:.1f}G"
    low = subprocess.Popen(
        [
            *gpuwait_cmd,
            *("--devices", "0", "--priority", "1", "--freezable", "--vram", reserve),
            *("--", sys.executable, "-c", CHECKSUM, str(share), steps),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    urgent = None
    try:

        def settled() -> bool:
            running = [j for j in ledger_entries() if j["state"] == "running"]
            return bool(running) and time.time() - float(running[0]["started_at"]) > 3.0

        wait_for(settled, timeout=120, interval=0.1, message="the job never ran for 3 s")
        urgent = subprocess.Popen(
            [
                *gpuwait_cmd,
                *("--devices", "0", "--priority", "5", "--vram", reserve),
                *("--", sys.executable, "-c", HOLD, str(share)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _, urgent_err = urgent.communicate(timeout=300)
        assert urgent.returncode == 0, urgent_err
        out, err = low.communicate(timeout=300)
        assert low.returncode == 0, err
    finally:
        for job in (low, urgent):
            if job is not None and job.poll() is None:
                job.kill()
                job.wait(timeout=60)
    kinds = [e["kind"] for e in events()]
    assert "freeze" in kinds and "thaw" in kinds, kinds
    assert out == bare.stdout
