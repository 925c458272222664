"""A failing reading of the GPUs does not end the queue: waiters retry with back-off and say
why; running jobs are untouched; only a failure longer than gpu_error_timeout ends a waiter
(exit 4). At start-up a failure that may pass is retried too, never run around.

Real gpuwait processes, on the simulation (the failure: a damaged simulation file, as when it is
caught half-saved) and through the real pynvml on the tests' fake driver (an NVML error).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.fixtures_nvml import GIB, UNKNOWN, FakeGpu, FakeNvml
from helpers.fixtures_sim import SIMJOB, SimFileFactory
from helpers.waiting import asleep_waiting, named_entry, said, wait_for

GPUWAIT = [sys.executable, "-m", "gpuwait"]


def job(name: str, vram: str, hold: str, report: Path) -> list[str]:
    simulated = [*SIMJOB, "--vram", vram, "--hold", hold, "--report", str(report)]
    return [*GPUWAIT, "--vram", vram, "--name", name, "--", *simulated]


Pair = tuple[Path, subprocess.Popen[str], subprocess.Popen[str]]


@pytest.fixture
def one_runs_one_waits(
    sim_file: SimFileFactory,
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[[str], Pair]:
    """start(hold) -> (simulation file, first, second): on one 24 GiB GPU, "first" runs 16 GiB
    for `hold`, "second" waits for 16 GiB."""

    def start(hold: str) -> Pair:
        sim = sim_file(gpus=1, memory="24G")
        monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "0.2s")
        first = procs(job("first", "16G", hold, tmp_path / "first.json"))
        wait_for(lambda: (e := named_entry("first")) and e.get("child_pid"), timeout=20)
        second = procs(job("second", "16G", "0.2s", tmp_path / "second.json"))
        wait_for(lambda: asleep_waiting(second.pid), timeout=20)
        return sim, first, second

    return start


def test_a_waiter_waits_through_failing_readings_and_starts_once_they_recover(
    one_runs_one_waits: Callable[[str], Pair], tmp_path: Path
) -> None:
    sim, first, second = one_runs_one_waits("3s")

    good = sim.read_text()
    sim.write_text("[[gpu]\nmemory = ")  # caught half-saved
    told = said(second, "retrying")  # it read the failure, and waits on
    time.sleep(0.5)  # more failed readings at 0.2 s
    assert second.poll() is None, "a waiter must not end over a failed reading"
    assert first.poll() is None, "a running job must not be disturbed"
    status = subprocess.run([*GPUWAIT, "status"], capture_output=True, text=True, timeout=30)
    assert "not valid TOML" in status.stderr + status.stdout
    sim.write_text(good)

    assert first.wait(timeout=30) == 0
    _, err = second.communicate(timeout=30)
    err = told + err
    assert second.returncode == 0, err
    assert "GPU readings failing, retrying" in err and "not valid TOML" in err
    for name in ("first", "second"):
        assert json.loads((tmp_path / f"{name}.json").read_text())["oom"] is False


def test_a_lasting_failure_ends_a_waiter_after_gpu_error_timeout(
    one_runs_one_waits: Callable[[str], Pair], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUWAIT_GPU_ERROR_TIMEOUT", "2s")
    sim, _, second = one_runs_one_waits("30s")
    sim.write_text("garbage = [")
    started = time.monotonic()
    _, err = second.communicate(timeout=30)
    assert second.returncode == 4, err
    assert 1.5 < time.monotonic() - started < 15
    assert "gpu_error_timeout" in err and "Traceback" not in err
    assert named_entry("second") is None


def test_at_start_up_a_failure_that_may_pass_is_retried_not_run_around(
    sim_file: SimFileFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = sim_file(gpus=1, memory="24G")
    good = sim.read_text()
    sim.write_text("[[gpu]\n")
    marker = tmp_path / "ran"
    command = [*GPUWAIT, "--vram", "1G", "--", "touch", str(marker)]
    # The failure lasts: exit 4, and the command never ran without coordination.
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GPUWAIT_GPU_ERROR_TIMEOUT": "1s"},
    )
    assert done.returncode == 4, done.stderr
    assert not marker.exists()
    # The failure passes: the command runs once the readings are back.
    launch = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        told = said(launch, "retrying")  # its first reading failed, and it waits on
    except BaseException:
        launch.kill()
        launch.communicate()
        raise
    time.sleep(0.5)
    assert not marker.exists()
    sim.write_text(good)
    _, err = launch.communicate(timeout=60)
    assert launch.returncode == 0, told + err
    assert marker.exists()


def test_through_nvml_a_transient_driver_error_is_waited_out(
    fake_nvml: FakeNvml,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The real pynvml against a driver gpuwait has never seen: a card held by a process outside
    # gpuwait, a waiter, then NVML failing for a while, then the card freed.
    monkeypatch.delenv("GPUWAIT_SIM", raising=False)
    monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "0.2s")
    fake_nvml.set_gpus([FakeGpu(total=24 * GIB, used=20 * GIB)])
    waiter = procs([*GPUWAIT, "--vram", "8G", "--", "true"])
    wait_for(lambda: asleep_waiting(waiter.pid), timeout=20)
    fake_nvml.fail(None, "nvmlDeviceGetCount_v2", UNKNOWN)
    told = said(waiter, "GPU readings failing, retrying")  # it read the failure, and waits on
    time.sleep(0.5)  # more failed readings at 0.2 s
    assert waiter.poll() is None, "a waiter must not end over a driver hiccup"
    fake_nvml.clear_failures()
    fake_nvml.update_gpu(0, used=0)
    _, err = waiter.communicate(timeout=30)
    err = told + err
    assert waiter.returncode == 0, err
    assert "GPU readings failing, retrying" in err and "Traceback" not in err


def test_a_simulated_job_starting_while_the_file_is_saved_waits_for_it(
    sim_file: SimFileFactory, tmp_path: Path
) -> None:
    # A real CUDA job never notices an NVML hiccup; a simulated one must not die of a simulation
    # file caught half-saved when it starts (gpuwait admitted it on the whole file a moment ago).
    sim = sim_file(gpus=1, memory="24G")
    good = sim.read_text()
    sim.write_text("[[gpu]\nmemory = ")
    job = subprocess.Popen(
        [*SIMJOB, "--vram", "1G", "--hold", "0.2s"], stderr=subprocess.PIPE, text=True
    )
    time.sleep(1.0)
    sim.write_text(good)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 0, err
