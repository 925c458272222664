"""NvmlBackend over real pynvml and the fake libnvidia-ml.so.1 (see tests/fake_nvml)."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml  # type: ignore[import-untyped]
import pytest
from helpers.fixtures_nvml import (
    ARGUMENT_VERSION_MISMATCH,
    DRIVER_NOT_LOADED,
    FUNCTION_NOT_FOUND,
    GIB,
    GPU_IS_LOST,
    NO_PERMISSION,
    NOT_SUPPORTED,
    UNKNOWN,
    FakeGpu,
    FakeNvml,
)
from helpers.waiting import ledger_entries, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwait.core.errors import BackendUnavailable
from gpuwait.core.snapshot import ProcessUsage
from gpuwait.gpu.nvml import NvmlBackend

MIB = 1024**2


@pytest.fixture
def two_gpus(fake_nvml: FakeNvml) -> FakeNvml:
    fake_nvml.set_gpus(
        [
            FakeGpu(uuid="GPU-aaaa", name="NVIDIA A100-SXM4-80GB", total=80 * GIB, used=10 * GIB),
            FakeGpu(uuid="GPU-bbbb", name="NVIDIA H100 80GB HBM3", total=80 * GIB, used=0),
        ]
    )
    return fake_nvml


@pytest.fixture
def backend(fake_nvml: FakeNvml) -> Iterator[NvmlBackend]:
    b = NvmlBackend()
    yield b
    b.close()


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def launch(
    fake: FakeNvml, gpuwait_cmd: list[str], *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    """`gpuwait ARGS` over the fake driver, with `env` added, output captured."""
    return subprocess.run(
        [*gpuwait_cmd, *args],
        env={**fake.env(), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


ECHO_VISIBLE = ("sh", "-c", "echo $CUDA_VISIBLE_DEVICES")


# -- readings -------------------------------------------------------------------------------


def test_two_gpus_with_processes(two_gpus: FakeNvml, backend: NvmlBackend) -> None:
    two_gpus.add_process(0, pid=4242, mem=6 * GIB)
    two_gpus.add_process(0, pid=4243, mem=None)  # the driver cannot attribute it
    two_gpus.add_process(1, pid=5000, mem=512 * MIB)

    snap = backend.snapshot()

    assert snap.backend == "nvml"
    assert snap.warnings == ()
    assert [g.index for g in snap.gpus] == [0, 1]
    a, h = snap.gpus
    assert (a.uuid, a.name) == ("GPU-aaaa", "NVIDIA A100-SXM4-80GB")
    assert (h.uuid, h.name) == ("GPU-bbbb", "NVIDIA H100 80GB HBM3")
    assert (a.total_bytes, a.used_bytes, a.free_bytes) == (80 * GIB, 10 * GIB, 70 * GIB)
    assert (h.total_bytes, h.used_bytes, h.free_bytes) == (80 * GIB, 0, 80 * GIB)
    assert a.processes == (ProcessUsage(4242, 6 * GIB), ProcessUsage(4243, None))
    assert h.processes == (ProcessUsage(5000, 512 * MIB),)
    assert a.process_bytes({4242, 4243}) == 6 * GIB
    assert snap.by_uuid()["GPU-bbbb"] is h


def test_names_keep_underscores_and_spaces(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    fake_nvml.set_gpus([FakeGpu(name="Tesla_T4 (rev 2)", uuid="GPU-1_2")])
    (gpu,) = backend.snapshot().gpus
    assert (gpu.name, gpu.uuid) == ("Tesla_T4 (rev 2)", "GPU-1_2")


def test_changes_show_in_the_next_snapshot(two_gpus: FakeNvml, backend: NvmlBackend) -> None:
    assert backend.snapshot().gpus[1].used_bytes == 0
    two_gpus.update_gpu(1, used=30 * GIB)
    two_gpus.add_process(1, pid=77, mem=30 * GIB)
    gpu = backend.snapshot().gpus[1]
    assert gpu.free_bytes == 50 * GIB
    assert gpu.processes == (ProcessUsage(77, 30 * GIB),)


def test_no_gpus_is_an_empty_machine_not_an_error(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    snap = backend.snapshot()
    assert snap.gpus == () and snap.warnings == ()


# -- process list -----------------------------------------------------------------------------


def test_process_list_with_no_processes_is_one_call(
    two_gpus: FakeNvml, backend: NvmlBackend
) -> None:
    two_gpus.clear_calls()
    snap = backend.snapshot()
    assert all(g.processes == () for g in snap.gpus)
    calls = [c for c in two_gpus.calls() if "ComputeRunningProcesses" in c]
    # Count 0 and a NULL buffer, answered SUCCESS with count 0: nothing runs.
    assert calls == [
        "nvmlDeviceGetComputeRunningProcesses_v3 gpu=0 ret=0 count=0 buf=null",
        "nvmlDeviceGetComputeRunningProcesses_v3 gpu=1 ret=0 count=0 buf=null",
    ]


def test_process_list_with_five_processes_uses_two_calls(
    two_gpus: FakeNvml, backend: NvmlBackend
) -> None:
    pids = [1001, 1002, 1003, 1004, 1005]
    for n, pid in enumerate(pids):
        two_gpus.add_process(1, pid=pid, mem=(n + 1) * GIB)
    two_gpus.clear_calls()

    gpu = backend.snapshot().gpus[1]

    assert [p.pid for p in gpu.processes] == pids
    assert [p.used_bytes for p in gpu.processes] == [n * GIB for n in range(1, 6)]
    calls = [c for c in two_gpus.calls() if "ComputeRunningProcesses" in c and "gpu=1" in c]
    assert len(calls) == 2
    # First asks for the size (7 = INSUFFICIENT_SIZE), then reads into a big enough buffer.
    assert calls[0].endswith("ret=7 count=0 buf=null")
    assert "ret=0" in calls[1] and "buf=null" not in calls[1]


@pytest.mark.parametrize("code", [NOT_SUPPORTED, FUNCTION_NOT_FOUND, NO_PERMISSION])
def test_process_list_unavailable_keeps_the_gpu(
    two_gpus: FakeNvml, backend: NvmlBackend, code: int
) -> None:
    # 13 reaches gpuwait as pynvml's NVMLLibraryMismatchError (a driver older than R450, which
    # has neither _v3 nor _v2).
    two_gpus.add_process(0, pid=1, mem=GIB)
    two_gpus.fail(None, "nvmlDeviceGetComputeRunningProcesses_v3", code)
    two_gpus.fail(None, "nvmlDeviceGetComputeRunningProcesses_v2", code)
    snap = backend.snapshot()
    assert snap.warnings == ()
    assert [g.processes for g in snap.gpus] == [(), ()]
    assert snap.gpus[0].used_bytes == 10 * GIB


def test_a_driver_without_the_v3_process_list_is_asked_for_the_v2_one(
    two_gpus: FakeNvml, backend: NvmlBackend
) -> None:
    # Drivers R450 to R495 (R470, the last for Kepler cards, among them) have no
    # nvmlDeviceGetComputeRunningProcesses_v3, the one call pynvml's unversioned function
    # makes; their _v2 lists the same processes in the same struct.
    two_gpus.add_process(0, pid=4242, mem=6 * GIB)
    two_gpus.add_process(0, pid=4243, mem=None)
    two_gpus.fail(None, "nvmlDeviceGetComputeRunningProcesses_v3", FUNCTION_NOT_FOUND)
    for _ in range(2):
        two_gpus.clear_calls()
        snap = backend.snapshot()
        assert snap.warnings == ()
        a, h = snap.gpus
        assert a.processes == (ProcessUsage(4242, 6 * GIB), ProcessUsage(4243, None))
        assert not a.processes_failed and h.processes == ()
    # Once known to be missing, _v3 is not asked again at every reading.
    assert not [c for c in two_gpus.calls() if "ComputeRunningProcesses_v3" in c]


def test_on_a_driver_without_the_v3_process_list_a_jobs_memory_is_its_own(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str], procs: Callable[..., subprocess.Popen[str]]
) -> None:
    # One 24 GiB card on an R470 driver. Job A (8G) uses its 8 GiB. Without the process list
    # that memory was nobody's: counted once as someone else's and once as A's reservation, it
    # left 5.6 GiB of the 21.6 GiB at safety 0.9, and B (8G) waited for A to end.
    fake_nvml.set_gpus([FakeGpu(uuid="GPU-aaaa", total=24 * GIB)])
    fake_nvml.fail(None, "nvmlDeviceGetComputeRunningProcesses_v3", FUNCTION_NOT_FOUND)
    procs([*gpuwait_cmd, "-q", "--vram", "8G", "--", "sleep", "60"], env=fake_nvml.env())
    entry = wait_for(
        lambda: next((e for e in ledger_entries() if e.get("child_pid")), None), timeout=30
    )
    fake_nvml.update_gpu(0, used=8 * GIB)
    fake_nvml.add_process(0, entry["child_pid"], 8 * GIB)
    done = launch(fake_nvml, gpuwait_cmd, "--vram", "8G", "--timeout", "3s", "--", "true")
    assert done.returncode == 0, done.stderr


# -- MIG ------------------------------------------------------------------------------------


def test_a_gpu_in_mig_mode_is_left_out(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    # In MIG mode the card's figures are the whole card's, while a job given the card's UUID
    # runs in one MIG instance: three 8 GiB jobs were all admitted onto an 80 GiB A100 split
    # into 10 GiB instances, each told CUDA_VISIBLE_DEVICES=<the card>.
    fake_nvml.set_gpus(
        [
            FakeGpu(uuid="GPU-mig", total=80 * GIB, mig=True),
            FakeGpu(uuid="GPU-whole", total=80 * GIB, mig=False),
            FakeGpu(uuid="GPU-old", total=24 * GIB),  # no MIG: NOT_SUPPORTED
        ]
    )
    snap = backend.snapshot()
    assert [g.uuid for g in snap.gpus] == ["GPU-whole", "GPU-old"]
    assert len(snap.warnings) == 1
    assert snap.warnings[0].startswith("GPU 0: MIG mode is on;")
    fake_nvml.update_gpu(0, mig=False)  # switched off (with a GPU reset): back
    assert [g.uuid for g in backend.snapshot().gpus] == ["GPU-mig", "GPU-whole", "GPU-old"]
    fake_nvml.fail(1, "nvmlDeviceGetMigMode", GPU_IS_LOST)
    snap = backend.snapshot()
    assert [g.uuid for g in snap.gpus] == ["GPU-mig", "GPU-old"]
    assert snap.warnings[0].startswith("GPU 1: GPU is lost")


def test_a_gpu_whose_mig_mode_cannot_be_read_is_not_taken_for_a_whole_gpu(
    fake_nvml: FakeNvml, backend: NvmlBackend, gpuwait_cmd: list[str]
) -> None:
    # An 80 GiB A100 in MIG mode whose MIG query answered Unknown Error was taken for a whole
    # card with 80 GiB free: an 8 GiB job was sent to it (CUDA_VISIBLE_DEVICES=GPU-mig), to
    # run in one of its MIG instances, whatever room that had.
    fake_nvml.set_gpus(
        [
            FakeGpu(uuid="GPU-mig", total=80 * GIB, mig=True),
            FakeGpu(uuid="GPU-whole", total=24 * GIB, used=23 * GIB),
        ]
    )
    assert backend.snapshot().in_mig_mode == ((0, "GPU-mig"),)
    fake_nvml.fail(0, "nvmlDeviceGetMigMode", UNKNOWN)
    # Read before: the mode last read holds.
    snap = backend.snapshot()
    assert [g.uuid for g in snap.gpus] == ["GPU-whole"]
    assert snap.in_mig_mode == ((0, "GPU-mig"),)
    # Never read (a launch's first reading): the GPU's reading failed, and it is retried.
    fresh = NvmlBackend()
    try:
        snap = fresh.snapshot()
    finally:
        fresh.close()
    assert [g.uuid for g in snap.gpus] == ["GPU-whole"] and snap.unanswered == (0,)
    assert snap.warnings == ("GPU 0: Unknown Error (NVML error 999); skipped",)
    done = launch(fake_nvml, gpuwait_cmd, "--vram", "8G", "--timeout", "1s", "--", *ECHO_VISIBLE)
    assert (done.returncode, done.stdout) == (124, ""), done.stderr
    # A GPU without MIG (NOT_SUPPORTED) is a whole GPU, as before.
    fake_nvml.clear_failures()
    fake_nvml.update_gpu(0, mig=None)
    done = launch(fake_nvml, gpuwait_cmd, "--vram", "8G", "--", *ECHO_VISIBLE)
    assert (done.returncode, done.stdout) == (0, "GPU-mig\n"), done.stderr


@pytest.mark.parametrize("visible", ["0,1", "GPU-mig,GPU-whole"])
def test_a_gpu_in_mig_mode_named_first_by_cuda_visible_devices_hides_none_after_it(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str], visible: str
) -> None:
    # A Slurm job (or a user) given GPUs 0 and 1, GPU 0 in MIG mode: CUDA takes GPU 0 (one of
    # its MIG instances) and GPU 1 after it. gpuwait read GPU 0 as an entry naming no GPU and
    # stopped there, as CUDA stops at an invalid one: "makes no GPU visible", exit 3, with GPU 1
    # free and whole.
    fake_nvml.set_gpus(
        [
            FakeGpu(uuid="GPU-mig", total=80 * GIB, mig=True),
            FakeGpu(uuid="GPU-whole", total=80 * GIB, mig=False),
        ]
    )
    done = launch(
        fake_nvml, gpuwait_cmd, "--vram", "1G", "--", *ECHO_VISIBLE, CUDA_VISIBLE_DEVICES=visible
    )
    assert (done.returncode, done.stdout) == (0, "GPU-whole\n"), done.stderr


def test_cuda_visible_devices_naming_only_a_gpu_in_mig_mode_says_so(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # It said the variable "makes no GPU visible" and to "list GPU indices or UUIDs that exist",
    # of a GPU that exists.
    fake_nvml.set_gpus([FakeGpu(mig=True), FakeGpu(mig=False)])
    done = launch(fake_nvml, gpuwait_cmd, "--vram", "1G", "--", "true", CUDA_VISIBLE_DEVICES="0")
    assert done.returncode == 3
    assert done.stderr.splitlines()[1:] == [
        "gpuwait: error: CUDA_VISIBLE_DEVICES='0' makes visible no GPU but GPU 0, which is in MIG "
        "mode; gpuwait places jobs on whole GPUs only",
        "gpuwait: hint: run the command without gpuwait, or from where a whole GPU is visible",
    ]


def test_the_shell_hook_runs_a_line_bare_where_every_gpu_is_in_mig_mode(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # With the shell hook on, every `python` typed on a machine whose every GPU is in MIG mode
    # ended with exit 3, a script that uses no GPU too, where a machine with no driver runs it
    # bare with one warning (on_no_gpu = run).
    fake_nvml.set_gpus([FakeGpu(mig=True), FakeGpu(mig=True)])
    line = ("shell-hook", "--", sys.executable, "-c", "print(1)")
    done = launch(fake_nvml, gpuwait_cmd, *line)
    assert (done.returncode, done.stdout) == (0, "1\n"), done.stderr
    assert done.stderr.splitlines() == [
        "gpuwait: warning: no GPU here takes a job: GPU 0, GPU 1 are in MIG mode, and gpuwait "
        "places jobs on whole GPUs only; the shell hook runs it bare"
    ]
    # So where NVML lists no GPU at all; `on_no_gpu = fail` keeps the refusal, as does a launch
    # through gpuwait itself.
    assert launch(fake_nvml, gpuwait_cmd, *line, GPUWAIT_ON_NO_GPU="fail").returncode == 3
    done = launch(fake_nvml, gpuwait_cmd, "--vram", "1G", "--", "true")
    assert done.returncode == 3 and "turn MIG mode off" in done.stderr
    fake_nvml.set_gpus([])
    done = launch(fake_nvml, gpuwait_cmd, *line)
    assert (done.returncode, done.stdout) == (0, "1\n"), done.stderr
    assert done.stderr == (
        "gpuwait: warning: NVML lists no GPU that this process may use; the shell hook runs it "
        "bare\n"
    )


def test_a_preferred_gpu_in_mig_mode_is_passed_over(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # `prefer = 0` in the settings, then GPU 0 switched to MIG mode: every launch ended with
    # exit 2, "no GPU '0' here".
    fake_nvml.set_gpus([FakeGpu(uuid="GPU-mig", mig=True), FakeGpu(uuid="GPU-whole")])
    done = launch(fake_nvml, gpuwait_cmd, "--vram", "1G", "--", *ECHO_VISIBLE, GPUWAIT_PREFER="0")
    assert (done.returncode, done.stdout) == (0, "GPU-whole\n"), done.stderr


def test_devices_naming_a_gpu_in_mig_mode(fake_nvml: FakeNvml, gpuwait_cmd: list[str]) -> None:
    # `--devices 0,1` with GPU 0 in MIG mode ended with exit 2, "no GPU '0' here", as did
    # `--devices 0`, of a GPU that is there.
    fake_nvml.set_gpus([FakeGpu(uuid="GPU-mig", mig=True), FakeGpu(uuid="GPU-whole")])
    done = launch(fake_nvml, gpuwait_cmd, "--devices", "0,1", "--vram", "1G", "--", *ECHO_VISIBLE)
    assert (done.returncode, done.stdout) == (0, "GPU-whole\n"), done.stderr
    done = launch(fake_nvml, gpuwait_cmd, "--devices", "GPU-mig", "--vram", "1G", "--", "true")
    assert done.returncode == 3
    assert done.stderr.splitlines()[1:] == [
        "gpuwait: error: --devices 'GPU-mig' names no GPU but GPU 0, which is in MIG mode; "
        "gpuwait places jobs on whole GPUs only",
        "gpuwait: hint: name whole GPUs (see gpuwait status)",
    ]


def test_a_machine_whose_every_gpu_is_in_mig_mode_says_so(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # An A100 server split into MIG instances: every launch was refused as "no candidate GPU",
    # with the hint to have the compute mode set back to default (nvidia-smi -c DEFAULT),
    # which every card already had.
    fake_nvml.set_gpus([FakeGpu(mig=True), FakeGpu(mig=True)])
    done = launch(fake_nvml, gpuwait_cmd, "--vram", "1G", "--", "true")
    assert done.returncode == 3
    assert done.stderr.splitlines()[2:] == [
        "gpuwait: error: no GPU here takes a job: GPU 0, GPU 1 are in MIG mode, and gpuwait "
        "places jobs on whole GPUs only",
        "gpuwait: hint: run the command without gpuwait, or have an administrator turn MIG "
        "mode off (nvidia-smi -mig 0)",
    ]
    # No GPU at all (the driver loaded, the cards gone): no card's compute mode to blame.
    fake_nvml.set_gpus([])
    done = launch(fake_nvml, gpuwait_cmd, "--vram", "1G", "--", "true")
    assert done.returncode == 3
    assert done.stderr.splitlines() == [
        "gpuwait: error: NVML lists no GPU that this process may use",
        "gpuwait: hint: see nvidia-smi; GPUWAIT_SIM=FILE uses simulated GPUs meanwhile",
    ]


@pytest.mark.parametrize("devices", [(), ("--devices", "1")])
def test_a_waiter_whose_gpus_go_into_mig_mode_is_told_so(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str], devices: tuple[str, ...]
) -> None:
    # The card it waited for was switched into MIG mode (and reset) by an administrator: the
    # waiter waited on for ever, its line saying "no usable GPU right now", where a launch
    # then is refused at once (exit 3) for the MIG mode.
    fake_nvml.set_gpus([FakeGpu(total=24 * GIB, used=20 * GIB)] * 2)
    waiter = subprocess.Popen(
        [*gpuwait_cmd, *devices, "--vram", "10G", "--", "true"],
        env={**fake_nvml.env(), "GPUWAIT_NVML_INTERVAL": "0.2s"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: any(e.get("state") == "waiting" for e in ledger_entries()), timeout=30)
        # Full as before: a reading that began before the switch asks the mode first, and
        # would take an empty card read after it for room.
        fake_nvml.set_gpus(
            [
                FakeGpu(total=24 * GIB, used=20 * GIB),
                FakeGpu(total=24 * GIB, used=20 * GIB, mig=True),
            ]
        )
        if not devices:
            fake_nvml.update_gpu(0, mig=True)
        _, err = waiter.communicate(timeout=30)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.communicate()
    assert waiter.returncode == 3, err
    gpus = "GPU 1 is" if devices else "GPU 0, GPU 1 are"
    assert (
        f"gpuwait: error: no GPU left that this job may use: {gpus} in MIG mode now, and "
        "gpuwait places jobs on whole GPUs only"
    ) in err.splitlines(), err
    assert "Traceback" not in err
    assert ledger_entries() == []


# -- memory versions --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code", [FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH, NOT_SUPPORTED, UNKNOWN]
)
def test_memory_v2_unavailable_falls_back_to_v1(
    two_gpus: FakeNvml, backend: NvmlBackend, code: int
) -> None:
    two_gpus.fail(None, "nvmlDeviceGetMemoryInfo_v2", code)
    two_gpus.update_gpu(1, used=2 * GIB, reserved=GIB // 2)

    snap = backend.snapshot()

    assert snap.warnings == ()
    assert [(g.total_bytes, g.used_bytes) for g in snap.gpus] == [
        (80 * GIB, 10 * GIB),
        (80 * GIB, 2 * GIB + GIB // 2),
    ]
    # v1 counts the driver's memory in "used" and cannot tell it apart.
    assert [g.driver_bytes for g in snap.gpus] == [0, 0]
    # Decided once: later snapshots go straight to v1 instead of failing on v2 every poll.
    two_gpus.clear_calls()
    backend.snapshot()
    memory_calls = [c.split()[0] for c in two_gpus.calls() if "MemoryInfo" in c]
    assert memory_calls == ["nvmlDeviceGetMemoryInfo"] * 2


def test_memory_v2_is_used_when_available(two_gpus: FakeNvml, backend: NvmlBackend) -> None:
    two_gpus.clear_calls()
    backend.snapshot()
    memory_calls = [c.split()[0] for c in two_gpus.calls() if "MemoryInfo" in c]
    assert memory_calls == ["nvmlDeviceGetMemoryInfo_v2"] * 2


def test_one_gpus_hiccup_does_not_turn_memory_v2_off_for_good(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # Once a GPU has answered v2, a v2 call that fails on a GPU in trouble (Unknown Error) is
    # that GPU's failure, not a driver without v2. Taken for one, it put every later reading of
    # the waiter on v1, which counts the driver's own memory as a process's: a whole-GPU job on
    # an 8 GiB card with 600 MiB reserved by the driver waited on with the card idle.
    fake_nvml.set_gpus([FakeGpu(total=8 * GIB, used=7 * GIB, reserved=600 * MIB)])
    waiter = subprocess.Popen(
        [*gpuwait_cmd, "--exclusive", "--timeout", "20s", "--", "echo", "ran"],
        env={**fake_nvml.env(), "GPUWAIT_NVML_INTERVAL": "0.05s"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: any("MemoryInfo_v2 gpu=0 ret=0" in c for c in fake_nvml.calls()))
        for func in ("nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetMemoryInfo"):
            fake_nvml.fail(0, func, UNKNOWN)
        wait_for(lambda: any("MemoryInfo gpu=0 ret=999" in c for c in fake_nvml.calls()))
        fake_nvml.clear_failures()
        fake_nvml.update_gpu(0, used=0)  # the card is idle now
        out, err = waiter.communicate(timeout=5)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.communicate()
    assert (waiter.returncode, out) == (0, "ran\n"), err


def test_one_gpus_first_v2_failure_does_not_turn_memory_v2_off_for_the_others(
    two_gpus: FakeNvml, backend: NvmlBackend
) -> None:
    # GPU0 in trouble at the very first reading (Unknown Error on v2, v1 still answers) while
    # GPU1 answers v2: the driver has v2. Taken for one without it, every later reading of
    # every card counted the driver's own memory as a process's (a whole-GPU job refused).
    for index in (0, 1):
        two_gpus.update_gpu(index, used=0, reserved=GIB // 2)
    two_gpus.fail(0, "nvmlDeviceGetMemoryInfo_v2", UNKNOWN)
    first = backend.snapshot()
    assert [g.driver_bytes for g in first.gpus] == [0, GIB // 2]
    two_gpus.clear_failures()
    assert [g.driver_bytes for g in backend.snapshot().gpus] == [GIB // 2, GIB // 2]


def test_driver_reserved_memory_is_not_offered_as_free(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    # v2 reports the driver's reservation apart from "used"; it is still not allocatable.
    fake_nvml.set_gpus([FakeGpu(total=80 * GIB, used=GIB, reserved=600 * MIB)])
    (gpu,) = backend.snapshot().gpus
    assert gpu.free_bytes == 80 * GIB - GIB - 600 * MIB
    # Told apart from processes' memory: it is the driver's own.
    assert (gpu.used_bytes, gpu.driver_bytes) == (GIB + 600 * MIB, 600 * MIB)


# -- faults -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "func",
    [
        "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetUtilizationRates",
    ],
)
def test_lost_gpu_is_skipped_and_comes_back(
    two_gpus: FakeNvml, backend: NvmlBackend, func: str
) -> None:
    two_gpus.fail(1, func, GPU_IS_LOST)

    snap = backend.snapshot()
    assert [g.uuid for g in snap.gpus] == ["GPU-aaaa"]
    assert snap.warnings == ("GPU 1: GPU is lost (NVML error 15); skipped",)

    two_gpus.clear_failures()
    snap = backend.snapshot()
    assert [g.uuid for g in snap.gpus] == ["GPU-aaaa", "GPU-bbbb"]
    assert snap.warnings == ()


def test_other_errors_skip_only_that_gpu(two_gpus: FakeNvml, backend: NvmlBackend) -> None:
    two_gpus.fail(0, "nvmlDeviceGetUUID", UNKNOWN)
    snap = backend.snapshot()
    assert [g.index for g in snap.gpus] == [1]
    assert snap.warnings == ("GPU 0: Unknown Error (NVML error 999); skipped",)


def test_utilization_not_supported_is_none(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    fake_nvml.set_gpus([FakeGpu(util=None), FakeGpu(util=37), FakeGpu(util=50)])
    fake_nvml.fail(2, "nvmlDeviceGetUtilizationRates", NOT_SUPPORTED)
    snap = backend.snapshot()
    assert [g.utilization_pct for g in snap.gpus] == [None, 37, None]
    assert not any(g.utilization_failed for g in snap.gpus)
    assert snap.warnings == ()


def test_a_failed_utilization_reading_does_not_let_a_busy_gpu_pass_a_cap(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    # One reading failing (an NVML error other than NOT_SUPPORTED) was taken for a GPU that
    # does not report utilization, which passes --max-util: a job capped at 10 % waited on a
    # GPU at 100 % for 4 s, then started there within 0.4 s of one failed reading.
    from gpuwait.queue.conditions import UtilizationWindow

    fake_nvml.set_gpus([FakeGpu(uuid="GPU-busy", util=100), FakeGpu(uuid="GPU-new", util=100)])
    window = UtilizationWindow()
    for _ in range(3):
        window.add(backend.snapshot())
    assert window.means() == {"GPU-busy": 100, "GPU-new": 100}
    fake_nvml.fail(None, "nvmlDeviceGetUtilizationRates", UNKNOWN)
    snap = backend.snapshot()
    assert [(g.utilization_pct, g.utilization_failed) for g in snap.gpus] == [(None, True)] * 2
    window.add(snap)
    assert window.means() == {"GPU-busy": 100, "GPU-new": 100}
    # With no reading before the failed one, the GPU has not been measured: it does not pass.
    fresh = UtilizationWindow()
    fresh.add(snap)
    assert fresh.means() == {}


def test_compute_capability_or_none(fake_nvml: FakeNvml, backend: NvmlBackend) -> None:
    fake_nvml.set_gpus([FakeGpu(cc="8.0"), FakeGpu(cc=None), FakeGpu(cc="9.0")])
    fake_nvml.fail(2, "nvmlDeviceGetCudaComputeCapability", FUNCTION_NOT_FOUND)
    snap = backend.snapshot()
    assert [g.compute_capability for g in snap.gpus] == [(8, 0), None, None]
    assert snap.warnings == ()
    fake_nvml.fail(0, "nvmlDeviceGetCudaComputeCapability", GPU_IS_LOST)
    assert [g.index for g in backend.snapshot().gpus] == [1, 2]


def test_unreadable_name_still_serves_the_gpu(two_gpus: FakeNvml, backend: NvmlBackend) -> None:
    two_gpus.fail(0, "nvmlDeviceGetName", NOT_SUPPORTED)
    snap = backend.snapshot()
    assert [g.name for g in snap.gpus] == ["NVIDIA GPU", "NVIDIA H100 80GB HBM3"]


@pytest.mark.parametrize(
    ("gpu", "query", "asked"),
    [
        # An 8.0 card whose compute capability query answered Unknown Error once: a launch
        # asking for --min-compute-capability 8.0 was refused at once, exit 3, "GPU0 does not
        # report its compute capability", as if no card of the kind were there.
        (
            FakeGpu(cc="8.0"),
            "nvmlDeviceGetCudaComputeCapability",
            ("--min-compute-capability", "8.0"),
        ),
        # An A100 whose name query answered Unknown Error once was named "NVIDIA GPU": a launch
        # with --gpu-name A100 was refused at once, exit 3, "GPU0 is a NVIDIA GPU".
        (FakeGpu(name="NVIDIA A100-SXM4-80GB"), "nvmlDeviceGetName", ("--gpu-name", "A100")),
    ],
    ids=["compute-capability", "name"],
)
def test_a_query_that_fails_once_is_no_card_of_another_kind(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str], gpu: FakeGpu, query: str, asked: tuple[str, str]
) -> None:
    fake_nvml.set_gpus([gpu])
    fake_nvml.fail(0, query, UNKNOWN)
    threading.Timer(0.5, fake_nvml.clear_failures).start()
    done = launch(
        fake_nvml,
        gpuwait_cmd,
        *asked,
        "--vram",
        "1G",
        "--",
        *ECHO_VISIBLE,
        GPUWAIT_GPU_ERROR_TIMEOUT="30s",
    )
    assert (done.returncode, done.stdout) == (0, "GPU-fake-0\n"), done.stderr


def test_count_failing_is_backend_unavailable(two_gpus: FakeNvml, backend: NvmlBackend) -> None:
    two_gpus.fail(None, "nvmlDeviceGetCount_v2", UNKNOWN)
    with pytest.raises(BackendUnavailable) as info:
        backend.snapshot()
    assert "count the GPUs" in info.value.message
    assert info.value.hint


def test_unexpected_python_errors_become_backend_unavailable(
    two_gpus: FakeNvml, backend: NvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("ctypes went sideways")

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", broken)
    snap = backend.snapshot()
    assert snap.gpus == ()
    assert snap.warnings[0] == "GPU 0: ctypes went sideways; skipped"

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", broken)
    with pytest.raises(BackendUnavailable, match="ctypes went sideways"):
        backend.snapshot()


_FUNCS = [
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetComputeMode",
]
_CODES = [1, 2, NOT_SUPPORTED, NO_PERMISSION, 7, FUNCTION_NOT_FOUND, GPU_IS_LOST, 25, UNKNOWN]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    faults=st.lists(
        st.tuples(
            st.sampled_from([None, 0, 1, 2]), st.sampled_from(_FUNCS), st.sampled_from(_CODES)
        ),
        max_size=4,
    )
)
def test_any_fault_mix_gives_a_snapshot_or_backend_unavailable(
    fake_nvml: FakeNvml, faults: list[tuple[int | None, str, int]]
) -> None:
    fake_nvml.set_gpus([FakeGpu(uuid=f"GPU-{i}") for i in range(3)])
    fake_nvml.clear_failures()
    for gpu, func, code in faults:
        fake_nvml.fail(gpu, func, code)
    backend = NvmlBackend()
    try:
        for _ in range(2):
            try:
                snap = backend.snapshot()
            except BackendUnavailable as exc:
                assert exc.message and exc.hint
                continue
            # Every GPU is either read or named in exactly one warning; one that failed in a
            # way that may pass is left out of this reading only ("unanswered"), one this
            # process may not use, for good.
            # (Those this process may not use share one warning: "GPU 0, 2: ...".)
            seen = {g.index for g in snap.gpus}
            named = [int(n) for w in snap.warnings for n in w.split(":")[0][4:].split(", ")]
            warned = set(named)
            assert len(named) == len(warned)
            assert seen | warned == {0, 1, 2} and not seen & warned
            skipped = {int(w.split(":")[0][4:]) for w in snap.warnings if w.endswith("; skipped")}
            assert skipped == set(snap.unanswered)
            assert all(w.endswith(("; skipped", "; left out")) for w in snap.warnings)
    finally:
        backend.close()


# -- start and stop ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (DRIVER_NOT_LOADED, "not loaded"),
        (NO_PERMISSION, "no permission"),
        (18, "versions do not match"),
        (UNKNOWN, "NVML could not start"),
    ],
)
def test_init_failure_is_backend_unavailable_with_hint(
    fake_nvml: FakeNvml, code: int, words: str
) -> None:
    fake_nvml.fail_init(code)
    with pytest.raises(BackendUnavailable) as info:
        NvmlBackend()
    assert words in info.value.message
    assert f"NVML error {code}" in info.value.message
    assert info.value.hint
    assert "\n" not in info.value.message


def test_a_driver_not_loaded_is_not_to_be_installed(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # "NVIDIA driver is installed but not loaded", then the hint to install the NVIDIA driver.
    fake_nvml.set_gpus([FakeGpu()])
    fake_nvml.fail_init(DRIVER_NOT_LOADED)
    done = launch(fake_nvml, gpuwait_cmd, "--vram", "1G", "--", "true", GPUWAIT_ON_NO_GPU="fail")
    assert done.returncode == 4
    assert done.stderr.splitlines() == [
        "gpuwait: error: NVIDIA driver is installed but not loaded (NVML error 9)",
        "gpuwait: hint: have an administrator load it (modprobe nvidia), or set "
        "GPUWAIT_SIM=FILE to use simulated GPUs; on_no_gpu in config.toml decides whether "
        "commands run anyway",
    ]


def test_nvml_failing_to_start_is_not_told_to_install_a_driver(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # NVML's start failing (Unknown Error) with the library there: retried up to
    # gpu_error_timeout, then the hint to install the NVIDIA driver, and that on_no_gpu
    # decides whether commands run anyway, where on_no_gpu = run had run nothing.
    fake_nvml.set_gpus([FakeGpu()])
    fake_nvml.fail_init(UNKNOWN)
    done = launch(
        fake_nvml,
        gpuwait_cmd,
        "--vram",
        "1G",
        "--",
        "echo",
        "ran",
        GPUWAIT_ON_NO_GPU="run",
        GPUWAIT_GPU_ERROR_TIMEOUT="1s",
    )
    assert (done.returncode, done.stdout) == (4, "")
    assert done.stderr.splitlines()[-1] == (
        "gpuwait: hint: check the driver (nvidia-smi); a GPU reset or a reboot may mend it"
    )


def test_missing_library_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library(name: str, *args: object, **kwargs: object) -> None:
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(pynvml, "nvmlLib", None)
    monkeypatch.setattr(pynvml, "CDLL", no_library)
    with pytest.raises(BackendUnavailable) as info:
        NvmlBackend()
    assert info.value.message == "NVIDIA driver not found (libnvidia-ml.so.1 could not be loaded)"
    # On a machine without GPUs, where one tries gpuwait first, the hint said to set
    # GPUWAIT_SIM=FILE, and not how such a file is made.
    assert info.value.hint is not None and "gpuwait sim init FILE" in info.value.hint


def test_close_ignores_shutdown_errors_and_ends_readings(
    two_gpus: FakeNvml, backend: NvmlBackend
) -> None:
    two_gpus.fail(None, "nvmlShutdown", UNKNOWN)
    backend.close()
    backend.close()
    assert "nvmlShutdown gpu=- ret=999" in two_gpus.calls()
    with pytest.raises(BackendUnavailable):
        backend.snapshot()


def test_each_backend_pairs_init_with_shutdown(two_gpus: FakeNvml) -> None:
    first, second = NvmlBackend(), NvmlBackend()
    first.close()
    # NVML counts inits: the second backend still reads after the first one closed.
    assert len(second.snapshot().gpus) == 2
    second.close()
    calls = [c.split()[0] for c in two_gpus.calls()]
    assert calls.count("nvmlInitWithFlags") == calls.count("nvmlShutdown") == 2


# -- subprocesses (how the CLI meets the driver) ----------------------------------------------


def test_subprocess_pynvml_loads_the_fake(two_gpus: FakeNvml) -> None:
    code = "import pynvml; pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())"
    result = run_python(code, two_gpus.env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2"


def test_subprocess_backend_snapshot(two_gpus: FakeNvml) -> None:
    two_gpus.add_process(1, pid=31337, mem=None)
    result = run_python(
        """
        from gpuwait.gpu.nvml import NvmlBackend
        b = NvmlBackend()
        for g in b.snapshot().gpus:
            print(g.index, g.uuid, g.free_bytes, [(p.pid, p.used_bytes) for p in g.processes])
        b.close()
        """,
        two_gpus.env(),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"0 GPU-aaaa {70 * GIB} []",
        f"1 GPU-bbbb {80 * GIB} [(31337, None)]",
    ]


_REPORT = """
    from gpuwait.core.errors import BackendUnavailable
    from gpuwait.gpu.nvml import NvmlBackend
    try:
        NvmlBackend()
    except BackendUnavailable as exc:
        print(exc.message)
        print(exc.hint)
    """


def test_subprocess_missing_library(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("a real libnvidia-ml is installed; it cannot be hidden from a subprocess")
    empty = tmp_path / "empty"
    empty.mkdir()
    env = fake_nvml.env()
    env["LD_LIBRARY_PATH"] = str(empty)
    result = run_python(_REPORT, env)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    message, hint = result.stdout.splitlines()
    assert message == "NVIDIA driver not found (libnvidia-ml.so.1 could not be loaded)"
    assert "GPUWAIT_SIM" in hint


def test_subprocess_init_failure(fake_nvml: FakeNvml) -> None:
    fake_nvml.fail_init(DRIVER_NOT_LOADED)
    result = run_python(_REPORT, fake_nvml.env())
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.splitlines()[0] == (
        "NVIDIA driver is installed but not loaded (NVML error 9)"
    )


def test_pynvml_loads_without_ctypes_util_and_leaves_the_real_one_importable() -> None:
    code = (
        "import sys, gpuwait.gpu.nvml as n\n"
        "assert n.pynvml.nvmlInit and 'ctypes.util' not in sys.modules\n"
        "import ctypes.util\n"
        "print(ctypes.util.__file__, n.pynvml.find_library('c'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    path, found = done.stdout.split()
    assert path.endswith("ctypes/util.py") and "libc" in found
