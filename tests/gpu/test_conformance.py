"""The NVML backend (over the fake libnvidia-ml) and the simulation read one machine alike,
and the whole launcher works against an NVML library it has never seen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.fixtures_nvml import GIB, FakeGpu, FakeNvml

from gpuwait.gpu.nvml import NvmlBackend
from gpuwait.gpu.sim import Allocation, SimBackend, load_sim_file, write_allocation
from gpuwait.linux import proc


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_same_machine_same_snapshot(
    tmp_path: Path, fake_nvml: FakeNvml, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    uuids = ["GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000"]
    totals = [24 * GIB, 80 * GIB]
    base = [300 * 2**20, 0]
    driver = [0, 512 * 2**20]  # what the driver keeps for itself (NVML v2's "reserved")
    usage = [
        (0, sleepers[0].pid, 3 * GIB),
        (0, sleepers[1].pid, 5 * GIB),
        (1, sleepers[2].pid, 7 * GIB),
    ]

    sim_path = tmp_path / "sim.toml"
    sim_path.write_text(
        "".join(
            f'[[gpu]]\nname = "Same GPU"\nmemory = {totals[i]}\nuuid = "{uuids[i]}"\n'
            f"base_used = {base[i]}\ndriver_reserved = {driver[i]}\n"
            for i in range(2)
        )
    )
    config = load_sim_file(str(sim_path))
    config.state_dir.mkdir(mode=0o700, exist_ok=True)
    for gpu, pid, n_bytes in usage:
        write_allocation(
            config.state_dir, Allocation(pid, proc.start_time(pid) or 0, uuids[gpu], n_bytes)
        )

    fake_nvml.set_gpus(
        [
            FakeGpu(
                total=totals[i],
                used=base[i] + sum(b for g, _, b in usage if g == i),
                reserved=driver[i],
                name="Same GPU",
                uuid=uuids[i],
                util=None,
            )
            for i in range(2)
        ]
    )
    for gpu, pid, n_bytes in usage:
        fake_nvml.add_process(gpu, pid, n_bytes)

    nvml = NvmlBackend()
    try:
        from_nvml = nvml.snapshot()
    finally:
        nvml.close()
    from_sim = SimBackend(str(sim_path)).snapshot()

    def normalised(gpus: tuple[object, ...]) -> list[object]:
        return [
            (
                g.index,
                g.uuid,
                g.name,
                g.total_bytes,
                g.used_bytes,
                g.driver_bytes,
                sorted((p.pid, p.used_bytes) for p in g.processes),
            )  # type: ignore[attr-defined]
            for g in gpus
        ]

    assert normalised(from_nvml.gpus) == normalised(from_sim.gpus)
    assert from_nvml.warnings == from_sim.warnings == ()


def test_launcher_over_an_unseen_nvml_library(fake_nvml: FakeNvml, gpuwait_cmd: list[str]) -> None:
    """No GPUWAIT_SIM: gpuwait loads libnvidia-ml.so.1 through pynvml, finds the fake's GPUs,
    keeps out of the one a foreign process fills, and hands the command the other one's UUID."""
    fake_nvml.set_gpus(
        [
            FakeGpu(total=24 * GIB, used=20 * GIB, uuid="GPU-aaaaaaaa-0000-0000-0000-000000000000"),
            FakeGpu(total=24 * GIB, used=1 * GIB, uuid="GPU-bbbbbbbb-0000-0000-0000-000000000000"),
        ]
    )
    fake_nvml.add_process(0, 999_999, 20 * GIB)
    env = fake_nvml.env(dict(os.environ))
    script = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "8G", "--", sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "GPU-bbbbbbbb-0000-0000-0000-000000000000"

    report = json.loads(
        subprocess.run(
            [*gpuwait_cmd, "status", "--json"], env=env, capture_output=True, text=True, timeout=60
        ).stdout
    )
    assert report["backend"] == "nvml"
    assert [g["external_bytes"] for g in report["gpus"]] == [20 * GIB, 1 * GIB]

    too_big = subprocess.run(
        [*gpuwait_cmd, "--vram", "22G", "true"], env=env, capture_output=True, text=True, timeout=60
    )
    assert too_big.returncode == 3 and "can never fit" in too_big.stderr


def test_status_tells_the_drivers_own_memory_from_other_processes(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    """An idle card on a recent driver: NVML v2 reports a few hundred MiB the driver keeps for
    itself (nvidia-smi leaves it out of "used"). It is not free, but no process outside gpuwait
    uses it: `extern` shows 0, and a line says where the used memory is."""
    fake_nvml.set_gpus(
        [FakeGpu(total=80 * GIB, used=0, reserved=615 * 2**20), FakeGpu(total=80 * GIB, used=0)]
    )
    fake_nvml.update_gpu(1, used=3 * GIB, reserved=615 * 2**20)
    fake_nvml.add_process(1, 999_999, 3 * GIB)
    env = fake_nvml.env(dict(os.environ))
    shown = subprocess.run(
        [*gpuwait_cmd, "status"], env=env, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    rows = {
        line.split()[0]: line.split()
        for line in shown.stdout.splitlines()
        if line.split() and line.split()[0].isdigit()
    }
    # GPU, name (two words), total, used, extern
    assert rows["0"][3:6] == ["80.0G", "615M", "0B"], shown.stdout
    assert rows["1"][3:6] == ["80.0G", "3.6G", "3.0G"], shown.stdout
    assert "the NVIDIA driver keeps 615M of each GPU: part of used, not of extern" in shown.stdout
    report = json.loads(
        subprocess.run(
            [*gpuwait_cmd, "status", "--json"], env=env, capture_output=True, text=True, timeout=60
        ).stdout
    )
    assert [g["driver_bytes"] for g in report["gpus"]] == [615 * 2**20] * 2
    # What the room is made of is unchanged: the driver's memory is not free.
    assert [g["free_bytes"] for g in report["gpus"]] == [
        int(0.9 * 80 * GIB) - 615 * 2**20,
        int(0.9 * 80 * GIB) - 615 * 2**20 - 3 * GIB,
    ]
