"""GPU compute modes (`nvidia-smi -c`): a card in EXCLUSIVE_PROCESS mode lets one process at a
time use it, and CUDA fails a second one with "all CUDA-capable devices are busy or
unavailable"; gpuwait gives such a card to one job at a time, whatever the job asks for.

Real pynvml over the fake libnvidia-ml.so.1, and the simulation's `compute_mode`.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_nvml import (
    GIB,
    GPU_IS_LOST,
    NO_PERMISSION,
    NOT_SUPPORTED,
    UNKNOWN,
    FakeGpu,
    FakeNvml,
)
from helpers.fixtures_sim import SimFileFactory, hold_card, run_sim_job, wrapped_sim_job
from helpers.users import clean_up, shared_root
from helpers.waiting import asleep_waiting, named_entry, wait_for

from gpuwait.core.snapshot import COMPUTE_DEFAULT, COMPUTE_EXCLUSIVE_PROCESS, COMPUTE_PROHIBITED
from gpuwait.gpu import read_once
from gpuwait.gpu.nvml import NvmlBackend
from gpuwait.linux import proc

GPUWAIT = [sys.executable, "-m", "gpuwait"]
BUSY = "all CUDA-capable devices are busy or unavailable"


@pytest.fixture
def backend(fake_nvml: FakeNvml) -> Iterator[NvmlBackend]:
    b = NvmlBackend()
    yield b
    b.close()


def test_the_compute_mode_is_read_and_an_unsupported_query_reads_as_default(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    fake_nvml.set_gpus([FakeGpu(mode=m) for m in (0, 1, 2, 3, None)])
    modes = [g.compute_mode for g in backend.snapshot().gpus]
    assert modes == [
        COMPUTE_DEFAULT,
        COMPUTE_EXCLUSIVE_PROCESS,  # EXCLUSIVE_THREAD, of old drivers: one process too
        COMPUTE_PROHIBITED,
        COMPUTE_EXCLUSIVE_PROCESS,
        COMPUTE_DEFAULT,  # NOT_SUPPORTED
    ]


def test_a_compute_mode_query_that_fails_keeps_the_mode_last_read(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    # A card read once as exclusive and then failing only this query is not taken for shared.
    fake_nvml.set_gpus([FakeGpu(mode=3), FakeGpu(mode=0), FakeGpu(mode=3)])
    backend.snapshot()
    fake_nvml.fail(0, "nvmlDeviceGetComputeMode", UNKNOWN)
    fake_nvml.fail(1, "nvmlDeviceGetComputeMode", NOT_SUPPORTED)
    fake_nvml.fail(2, "nvmlDeviceGetComputeMode", GPU_IS_LOST)
    snap = backend.snapshot()
    assert [(g.index, g.compute_mode) for g in snap.gpus] == [
        (0, COMPUTE_EXCLUSIVE_PROCESS),
        (1, COMPUTE_DEFAULT),
    ]
    assert snap.unanswered == (2,)


def test_a_compute_mode_never_read_is_not_taken_for_default(
    fake_nvml: FakeNvml, backend: NvmlBackend, gpuwait_cmd: list[str]
) -> None:
    # An EXCLUSIVE_PROCESS card held by a process outside gpuwait, whose compute mode query
    # answered Unknown Error at a launch's first reading: taken for a card any number of
    # processes may share, it got a 2 GiB job, which CUDA fails as "busy or unavailable".
    fake_nvml.set_gpus([FakeGpu(mode=3, used=GIB // 4), FakeGpu(mode=0, used=79 * GIB)])
    fake_nvml.add_process(0, os.getpid(), GIB // 4)
    fake_nvml.fail(0, "nvmlDeviceGetComputeMode", UNKNOWN)
    snap = backend.snapshot()
    assert [g.index for g in snap.gpus] == [1] and snap.unanswered == (0,)
    assert snap.warnings == ("GPU 0: Unknown Error (NVML error 999); skipped",)
    ran = subprocess.run(
        [*gpuwait_cmd, "--vram", "2G", "--timeout", "1s", "--", "true"],
        env=fake_nvml.env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 124, ran.stderr


def test_an_exclusive_process_card_runs_one_job_at_a_time(
    fake_nvml: FakeNvml, procs: Callable[..., subprocess.Popen[Any]], tmp_path: Path
) -> None:
    # An 80 GiB card set to EXCLUSIVE_PROCESS: a 2 GiB job beside a running 2 GiB one would
    # have been admitted, and died in CUDA as "busy or unavailable".
    fake_nvml.set_gpus([FakeGpu(uuid="GPU-excl", total=80 * GIB, mode=3)])
    stop = tmp_path / "stop"
    env = fake_nvml.env()
    first = procs(
        [*GPUWAIT, "-q", "--vram", "2G", "--name", "a", "--", "sh", "-c",
         f"while [ ! -e {stop} ]; do sleep 0.05; done"],
        env=env,
    )  # fmt: skip
    wait_for(lambda: (named_entry("a") or {}).get("child_pid"), timeout=30)
    second = procs([*GPUWAIT, "--vram", "2G", "--name", "b", "--", "true"], env=env)
    wait_for(lambda: second.poll() is not None or asleep_waiting(second.pid), timeout=30)
    assert second.poll() is None, second.communicate()
    status = subprocess.run(
        [*GPUWAIT, "status"], env=env, capture_output=True, text=True, timeout=60
    )
    said = " ".join(status.stdout.split())
    assert " 80.0G 0B 0B 2.0G 0B " in said, said  # nothing free for another job
    assert "compute mode exclusive-process: one process at a time" in said, said
    assert "waiting for 2.0 GiB: best GPU0 has 0 B; GPU0 runs one process" in said, said
    stop.touch()
    assert first.wait(timeout=30) == 0
    assert second.wait(timeout=30) == 0


def held(sim: Path, holder: subprocess.Popen[str]) -> None:
    """Wait until the simulated card holds memory (or `holder` ended, which the test sees)."""
    wait_for(lambda: holder.poll() is not None or read_once(sim).gpus[0].used_bytes > 0)


def test_a_simulated_exclusive_card_fails_a_second_process_as_cuda_does(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], sim_jobs: list[subprocess.Popen[str]]
) -> None:
    sim = sim_file(gpus=1, memory="24GiB", compute_mode="exclusive-process")
    holder = hold_card(gpuwait_cmd, "2G", "30s")
    sim_jobs.append(holder)
    held(sim, holder)
    bare = subprocess.run(
        [*gpuwait_cmd, "sim", "job", "--vram", "1G"], capture_output=True, text=True, timeout=60
    )
    assert bare.returncode == 1 and BUSY in bare.stderr
    holder.terminate()
    holder.communicate(timeout=30)


def test_a_simulated_exclusive_card_is_given_to_one_gpuwait_job_at_a_time(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], sim_jobs: list[subprocess.Popen[str]]
) -> None:
    sim = sim_file(gpus=1, memory="24GiB", compute_mode="exclusive-process")
    sim_jobs.append(hold_card(gpuwait_cmd, "2G", "0.3s"))
    held(sim, sim_jobs[0])
    second = run_sim_job(gpuwait_cmd, ["--vram", "2G"], "--vram", "2G")
    assert second.returncode == 0, second.stderr
    assert sim_jobs[0].wait(timeout=30) == 0


def test_processes_on_an_exclusive_process_card_are_named(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    # Their names tell an MPS server (the card's one process, shared by its clients) apart,
    # whatever the ignore list, and wherever the GPUs are read.
    fake_nvml.set_gpus([FakeGpu(mode=0), FakeGpu(mode=3)])
    for gpu in (0, 1):
        fake_nvml.add_process(gpu, os.getpid(), GIB)
    named = [p.name for g in backend.snapshot().gpus for p in g.processes]
    assert named == [None, proc.command_name(os.getpid())] and named[1] is not None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a process as another user")
@pytest.mark.parametrize(
    ("program", "mode", "job"),
    [
        # Named as an MPS server on a card that takes one process at a time: the card taken
        # for one its clients share, and a job placed there dies as "busy or unavailable".
        ("nvidia-cuda-mps-server", 3, ["--vram", "2G"]),
        # Named as a display server (ignore_processes): its 8 GiB taken for no load, and a job
        # that asks for a whole GPU given one a quarter full.
        ("Xorg", 0, ["--exclusive"]),
    ],
)
def test_another_users_process_named_as_a_server_is_taken_for_what_it_is(
    fake_nvml: FakeNvml,
    procs: Callable[..., subprocess.Popen[Any]],
    program: str,
    mode: int,
    job: list[str],
) -> None:
    # Anyone names their process what they like (prctl, or a copy of a program under that
    # name); another user's counts as what it does: it holds the card.
    root = shared_root()
    try:
        named = root / program
        shutil.copy("/bin/sleep", named)
        os.chmod(named, 0o755)
        holder = procs([str(named), "60"], user=2002, group=2002, extra_groups=[])
        wait_for(lambda: proc.command_name(holder.pid) == program[:15], timeout=30)
        fake_nvml.set_gpus([FakeGpu(uuid="GPU-held", total=32 * GIB, used=8 * GIB, mode=mode)])
        fake_nvml.add_process(0, holder.pid, 8 * GIB)
        done = subprocess.run(
            [*GPUWAIT, *job, "--timeout", "1s", "--", "true"],
            env=fake_nvml.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 124, done.stderr
    finally:
        clean_up(root, [])


def test_a_prohibited_card_is_never_chosen(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # GPU0 is PROHIBITED (no CUDA process may use it); best-fit took it first, as the card
    # with the least room left (some memory taken by the driver or a display).
    fake_nvml.set_gpus(
        [FakeGpu(uuid="GPU-closed", mode=2, used=40 * GIB), FakeGpu(uuid="GPU-open")]
    )
    env = fake_nvml.env()
    show = [sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"]
    ran = subprocess.run(
        [*gpuwait_cmd, "--vram", "2G", "--", *show],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (ran.returncode, ran.stdout.strip()) == (0, "GPU-open"), ran.stderr
    status = subprocess.run(
        [*gpuwait_cmd, "status"], env=env, capture_output=True, text=True, timeout=60
    )
    said = " ".join(status.stdout.split())
    assert "compute mode prohibited: runs no CUDA work; never chosen" in said, said
    # Where it is the only candidate, the request can never fit: said at once, exit 3.
    only = subprocess.run(
        [*gpuwait_cmd, "--devices", "0", "--vram", "2G", "--", "true"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert only.returncode == 3, only.stderr
    assert "GPU0's compute mode is prohibited" in only.stderr, only.stderr
    assert "Traceback" not in only.stderr


def test_a_process_list_that_grew_between_two_calls_is_asked_again(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    # Processes started between pynvml's two calls: the list outgrew its buffer once.
    fake_nvml.set_gpus([FakeGpu(mode=3, grow=1)])
    fake_nvml.add_process(0, os.getpid(), GIB)
    gpu = backend.snapshot().gpus[0]
    assert [p.pid for p in gpu.processes] == [os.getpid()]
    assert not gpu.processes_failed


def _launch_2g(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str], timeout: str
) -> subprocess.CompletedProcess[str]:
    """`gpuwait --vram 2G --timeout TIMEOUT -- true` on the fake driver."""
    return subprocess.run(
        [*gpuwait_cmd, "--vram", "2G", "--timeout", timeout, "--", "true"],
        env=fake_nvml.env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_an_exclusive_card_whose_process_list_fails_is_not_handed_out_as_idle(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # Another user's process holds the exclusive-process card with little memory (a CUDA
    # context), and the list keeps failing: the card looked unused, and the job was started
    # there, to die in CUDA as "busy or unavailable".
    fake_nvml.set_gpus([FakeGpu(mode=3, used=GIB // 4, grow=1000)])
    fake_nvml.add_process(0, os.getpid(), GIB // 4)
    ran = _launch_2g(fake_nvml, gpuwait_cmd, "1s")
    assert ran.returncode == 124, ran.stderr
    assert "Traceback" not in ran.stderr


def test_an_exclusive_card_whose_process_list_is_refused_for_good_is_judged_by_memory(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # A driver that never lets this user list the card's processes (no permission) is one
    # that cannot list them: the card is judged by the memory used there, as on a vGPU. Taken
    # for one whose list failed this time, the card would be kept from every job for good.
    fake_nvml.set_gpus([FakeGpu(mode=3)])
    fake_nvml.fail(0, "nvmlDeviceGetComputeRunningProcesses_v3", NO_PERMISSION)
    ran = _launch_2g(fake_nvml, gpuwait_cmd, "20s")
    assert ran.returncode == 0, ran.stderr


def test_a_job_kept_off_an_exclusive_card_whose_process_list_fails_is_told_so(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # Nobody is on the card, but the driver's list of its processes fails at every reading:
    # the job waits, and says why, rather than that a process is there, which nobody could
    # find (nvidia-smi lists none) and would wait on for good.
    fake_nvml.set_gpus([FakeGpu(mode=3)])
    fake_nvml.fail(0, "nvmlDeviceGetComputeRunningProcesses_v3", UNKNOWN)
    ran = _launch_2g(fake_nvml, gpuwait_cmd, "1s")
    assert ran.returncode == 124, ran.stderr
    assert "one is there" not in ran.stderr
    assert "the driver's list of its processes fails" in ran.stderr, ran.stderr
    assert "Traceback" not in ran.stderr


def test_a_jobs_process_on_an_exclusive_card_it_was_not_given_holds_that_card(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], sim_jobs: list[subprocess.Popen[str]]
) -> None:
    # A job on GPU0 whose command runs a process on GPU1 (CUDA_VISIBLE_DEVICES set again, as
    # deepspeed --include does): GPU1, in EXCLUSIVE_PROCESS mode, is that process's, and a job
    # given it would fail in CUDA as "busy or unavailable". The process carries the job's
    # variables, but it is no job's on GPU1.
    sim = sim_file(gpus=2, memory="24GiB", compute_mode=["default", "exclusive-process"])
    stray = shlex.join([*gpuwait_cmd, "sim", "job", "--vram", "1G", "--hold", "30s"])
    greedy = subprocess.Popen(
        [
            *(*gpuwait_cmd, "-q", "--vram", "2G", "--devices", "0", "--name", "greedy", "--"),
            *("sh", "-c", f"CUDA_VISIBLE_DEVICES=1 exec {stray}"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sim_jobs.append(greedy)
    wait_for(lambda: greedy.poll() is not None or read_once(sim).gpus[1].used_bytes > 0)
    assert greedy.poll() is None, greedy.communicate()
    mine = subprocess.Popen(
        wrapped_sim_job(gpuwait_cmd, ["--vram", "2G", "--devices", "1"], "--vram", "2G"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sim_jobs.append(mine)
    wait_for(lambda: mine.poll() is not None or asleep_waiting(mine.pid), timeout=60)
    assert mine.poll() is None, mine.communicate()
    greedy.terminate()
    greedy.communicate(timeout=60)
    _, err = mine.communicate(timeout=120)
    assert mine.returncode == 0, err
