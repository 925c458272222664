"""NVML misbehaving: calls that hang, a GPU lost mid-run, figures that cannot be true.

(A missing library and a failing init are covered in test_nvml_backend.py and test_run_e2e.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

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
from helpers.waiting import ledger_entries, process_state, wait_for

from gpuwait.core.errors import BackendUnavailable
from gpuwait.gpu.nvml import NvmlBackend


@pytest.fixture
def two_gpus(fake_nvml: FakeNvml) -> FakeNvml:
    fake_nvml.set_gpus([FakeGpu(total=24 * GIB), FakeGpu(total=24 * GIB)])
    return fake_nvml


def test_a_hung_gpu_is_left_out_and_comes_back(two_gpus: FakeNvml) -> None:
    backend = NvmlBackend(timeout=0.3)
    try:
        two_gpus.hang(1, "nvmlDeviceGetMemoryInfo_v2", 2.0)
        started = time.monotonic()
        snap = backend.snapshot()
        assert time.monotonic() - started < 1.5
        assert [g.index for g in snap.gpus] == [0]
        assert snap.warnings == ("GPU 1: NVML did not answer within 0.3s; treated as unavailable",)
        # While its call is stuck, the GPU is not asked again: no further wait.
        two_gpus.clear_failures()
        started = time.monotonic()
        snap = backend.snapshot()
        assert time.monotonic() - started < 0.25
        assert [g.index for g in snap.gpus] == [0]
        assert "has not answered" in snap.warnings[0]
        wait_for(
            lambda: len(backend.snapshot().gpus) >= 2,
            timeout=10,
            interval=0.1,
            message="the GPU never came back",
        )
    finally:
        backend.close()


def test_a_hung_gpu_count_is_not_asked_again_until_it_returns(two_gpus: FakeNvml) -> None:
    # Each reading asked again, waited the whole deadline and left one more thread in the
    # driver: a job's sampling (every second or so) blocked its loop for nvml_timeout per
    # sample and piled up a stuck thread per sample for as long as the driver was wedged.
    backend = NvmlBackend(timeout=0.3)
    before = set(threading.enumerate())
    try:
        two_gpus.hang(None, "nvmlDeviceGetCount_v2", 1.5)
        with pytest.raises(BackendUnavailable, match=r"within 0\.3s"):
            backend.snapshot()
        started = time.monotonic()
        for _ in range(3):
            with pytest.raises(BackendUnavailable, match="GPU count"):
                backend.snapshot()
        assert time.monotonic() - started < 0.25
        assert len(set(threading.enumerate()) - before) <= 1
        two_gpus.clear_failures()

        def answered() -> bool:
            try:
                return len(backend.snapshot().gpus) == 2
            except BackendUnavailable:
                return False

        wait_for(answered, timeout=10, interval=0.1, message="the GPU count never came back")
    finally:
        backend.close()
        for thread in set(threading.enumerate()) - before:
            thread.join(timeout=30)


@pytest.mark.parametrize(
    ("func", "message"),
    [("nvmlDeviceGetCount_v2", "GPU count"), ("nvmlInitWithFlags", "did not start")],
)
def test_a_hung_driver_is_unavailable_not_a_hang(
    two_gpus: FakeNvml, func: str, message: str
) -> None:
    two_gpus.hang(None, func, 1.5)
    before = set(threading.enumerate())
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match=message):
        backend = NvmlBackend(timeout=0.3)
        try:
            backend.snapshot()
        finally:
            backend.close()
    assert time.monotonic() - started < 1.2
    # The stuck call must have returned (1.5 s after it began) before the fake is taken away:
    # the thread that made it, still in the fake now, ends then.
    for thread in set(threading.enumerate()) - before:
        thread.join(timeout=30)
        assert not thread.is_alive(), f"{thread.name} never ended: the stuck {func} call hangs on"


@pytest.mark.parametrize(
    ("func", "said"),
    [
        ("nvmlInitWithFlags", "NVML did not start within 0.3s (the driver is not answering)"),
        ("nvmlDeviceGetCount_v2", "NVML has not answered when asked for the GPU count"),
    ],
)
def test_a_launch_given_up_on_a_hung_driver_is_not_told_to_install_one(
    two_gpus: FakeNvml, gpuwait_cmd: list[str], func: str, said: str
) -> None:
    # A wedged driver (init or the GPU count stuck in it): after gpu_error_timeout the launch
    # ended with the hint to install the NVIDIA driver, and that on_no_gpu decides whether
    # commands run anyway, which it does not for a driver that is there.
    two_gpus.hang(None, func, 30)
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "1G", "--", "true"],
        env={
            **two_gpus.env(),
            "GPUWAIT_NVML_TIMEOUT": "0.3s",
            "GPUWAIT_GPU_ERROR_TIMEOUT": "2s",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 4, done.stderr
    error, hint = done.stderr.splitlines()[-2:]
    assert error.startswith(f"gpuwait: error: {said}"), done.stderr
    assert hint == (
        "gpuwait: hint: check the driver (nvidia-smi); one that does not answer needs a GPU "
        "reset or a reboot"
    )


def test_a_launch_given_up_on_a_failing_gpu_count_is_not_told_to_install_a_driver(
    two_gpus: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # NVML started, then failed at every count of the GPUs: after gpu_error_timeout the launch
    # ended with the hint to install the NVIDIA driver, which had just answered.
    two_gpus.fail(None, "nvmlDeviceGetCount_v2", UNKNOWN)
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "1G", "--", "true"],
        env={**two_gpus.env(), "GPUWAIT_GPU_ERROR_TIMEOUT": "1s"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 4, done.stderr
    error, hint = done.stderr.splitlines()[-2:]
    assert error.startswith("gpuwait: error: NVML could not count the GPUs: Unknown Error")
    assert (
        hint == "gpuwait: hint: check the driver (nvidia-smi); a GPU reset or a reboot may mend it"
    )


def test_hung_gpu_end_to_end(two_gpus: FakeNvml, gpuwait_cmd: list[str]) -> None:
    two_gpus.hang(0, "nvmlDeviceGetMemoryInfo_v2", 30)
    started = time.monotonic()
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"],
        env={**two_gpus.env(), "GPUWAIT_NVML_TIMEOUT": "0.5s"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    # It ran on the GPU that answers, and gpuwait ended although a driver call never returned.
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "GPU-fake-1"
    assert "GPU 0: NVML did not answer within 0.5s" in done.stderr
    assert time.monotonic() - started < 15


def test_a_launch_waits_out_a_hiccup_of_the_gpu_it_needs(
    two_gpus: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # One failed reading of the GPU that CUDA_VISIBLE_DEVICES names (or --devices, or one of
    # --gpus 2) ended the launch at once with exit 3: "CUDA_VISIBLE_DEVICES='0' makes no GPU
    # visible to this command".
    two_gpus.fail(0, "nvmlDeviceGetUUID", 999)
    threading.Timer(0.8, two_gpus.clear_failures).start()
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"],
        env={**two_gpus.env(), "CUDA_VISIBLE_DEVICES": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "GPU-fake-0"
    assert "GPU 0 did not answer, and without it" in done.stderr
    # Not even every GPU there is could serve it: refused at once, as before.
    two_gpus.fail(0, "nvmlDeviceGetUUID", 999)
    started = time.monotonic()
    done = subprocess.run(
        [*gpuwait_cmd, "--gpus", "3", "--vram", "1G", "--", "true"],
        env=two_gpus.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    assert time.monotonic() - started < 5


def test_a_launch_that_needs_a_lost_gpu_waits_for_it_then_ends_with_exit_4(
    two_gpus: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # GPU 1 answering GPU_IS_LOST (here while its name is read) made `--devices 1` say "no GPU
    # '1' here" at once, exit 2: a GPU that is there, only failing to answer.
    env = {**two_gpus.env(), "GPUWAIT_GPU_ERROR_TIMEOUT": "1s"}
    argv = [*gpuwait_cmd, "--devices", "1", "--vram", "1G", "--"]
    two_gpus.fail(1, "nvmlDeviceGetName", GPU_IS_LOST)
    threading.Timer(0.4, two_gpus.clear_failures).start()
    done = subprocess.run(
        [*argv, "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "GPU-fake-1"), done.stderr
    # Lost for longer than gpu_error_timeout: exit 4, as for any failing reading.
    two_gpus.fail(1, "nvmlDeviceGetName", GPU_IS_LOST)
    done = subprocess.run([*argv, "true"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 4, done.stderr
    assert "GPU 1 did not answer" in done.stderr and "gpu_error_timeout" in done.stderr
    # The setting named as `gpuwait config` shows it, in the warning as in the error.
    assert "retrying for up to gpu_error_timeout = 1s" in done.stderr, done.stderr
    assert "longer than gpu_error_timeout = 1s" in done.stderr, done.stderr


def test_used_above_total_counts_as_full(fake_nvml: FakeNvml) -> None:
    fake_nvml.set_gpus([FakeGpu(total=24 * GIB, used=30 * GIB), FakeGpu(total=24 * GIB)])
    backend = NvmlBackend()
    try:
        snap = backend.snapshot()
    finally:
        backend.close()
    assert snap.gpus[0].used_bytes == 24 * GIB
    assert snap.gpus[1].used_bytes == 0
    assert len(snap.warnings) == 1 and "counted as full" in snap.warnings[0]


def test_process_using_more_than_the_card_is_clamped(two_gpus: FakeNvml) -> None:
    two_gpus.add_process(0, os.getpid(), 99 * GIB)
    backend = NvmlBackend()
    try:
        snap = backend.snapshot()
    finally:
        backend.close()
    assert snap.gpus[0].processes[0].used_bytes == 24 * GIB
    assert "clamped to the total" in snap.warnings[0]


def test_a_launch_that_may_use_a_lost_gpu_or_another_takes_the_other(
    two_gpus: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # `--devices 0,1` with GPU 0 fallen off the bus was retried as a launch that needed GPU 0,
    # for gpu_error_timeout (5 min), then ended with exit 4: GPU 1 free all along.
    two_gpus.fail(0, "nvmlDeviceGetName", GPU_IS_LOST)
    done = subprocess.run(
        [
            *gpuwait_cmd,
            "--devices",
            "0,1",
            "--vram",
            "1G",
            "--",
            "sh",
            "-c",
            "echo $CUDA_VISIBLE_DEVICES",
        ],
        env={**two_gpus.env(), "GPUWAIT_GPU_ERROR_TIMEOUT": "3s"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (0, "GPU-fake-1\n"), done.stderr


def test_gpu_lost_mid_run_leaves_the_command_alone(
    two_gpus: FakeNvml, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    flag = tmp_path / "started"
    proc = subprocess.Popen(
        [
            *gpuwait_cmd,
            "--vram",
            "1G",
            "--devices",
            "0",
            "--",
            "sh",
            "-c",
            f"touch {flag}; sleep 1.5; exit 4",
        ],
        env={**two_gpus.env(), "GPUWAIT_SAMPLE_INTERVAL": "0.1s"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: flag.exists() or proc.poll() is not None,
            timeout=20,
            interval=0.02,
            message="the command never started",
        )
        assert flag.exists(), "gpuwait ended before its command started"
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    two_gpus.fail(0, "nvmlDeviceGetHandleByIndex_v2", GPU_IS_LOST)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 4 and "Traceback" not in err
    history = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    assert json.loads(history.read_text())["exit_status"] == 4


def test_a_waiter_whose_every_gpu_is_lost_says_so_and_gives_up_after_gpu_error_timeout(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # Every GPU answering "GPU is lost" (the driver gone from under it), a waiter waited for
    # ever, its line saying only "no usable GPU right now". A GPU back within
    # gpu_error_timeout is used again.
    fake_nvml.set_gpus([FakeGpu(total=24 * GIB, used=20 * GIB)])
    env = {**fake_nvml.env(), "GPUWAIT_GPU_ERROR_TIMEOUT": "1s", "GPUWAIT_NVML_INTERVAL": "0.2s"}

    def waiter() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*gpuwait_cmd, "--vram", "8G", "--", "true"], env=env, stderr=subprocess.PIPE, text=True
        )

    def waiting() -> bool:
        return any(e.get("state") == "waiting" for e in ledger_entries())

    back = waiter()
    wait_for(waiting, timeout=30, message="it never waited")
    fake_nvml.fail(None, "nvmlDeviceGetHandleByIndex_v2", GPU_IS_LOST)
    time.sleep(0.4)
    fake_nvml.clear_failures()
    fake_nvml.update_gpu(0, used=0)
    _, err = back.communicate(timeout=30)
    assert back.returncode == 0, err
    assert "GPU readings failing, retrying (no GPU answers: GPU 0: GPU is lost" in err

    fake_nvml.update_gpu(0, used=20 * GIB)
    lost = waiter()
    wait_for(waiting, timeout=30, message="it never waited")
    fake_nvml.fail(None, "nvmlDeviceGetHandleByIndex_v2", GPU_IS_LOST)
    _, err = lost.communicate(timeout=30)
    assert lost.returncode == 4, err
    assert err.splitlines()[-2].startswith(
        "gpuwait: error: no GPU answers: GPU 0: GPU is lost (NVML error 15) (failing for "
    )
    assert ledger_entries() == []


def waiter_ends_once_gpu_1_is_lost(fake_nvml: FakeNvml, launch: list[str]) -> None:
    """`launch --vram 8G -- true` waits; GPU 1 then falls off the bus: within
    gpu_error_timeout it ends, exit 4, naming GPU 1."""
    env = {**fake_nvml.env(), "GPUWAIT_GPU_ERROR_TIMEOUT": "1s", "GPUWAIT_NVML_INTERVAL": "0.2s"}
    waiter = subprocess.Popen(
        [*launch, "--vram", "8G", "--timeout", "10s", "--", "true"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: any(e.get("state") == "waiting" for e in ledger_entries()),
            timeout=30,
            message="it never waited",
        )
        fake_nvml.fail(1, "nvmlDeviceGetHandleByIndex_v2", GPU_IS_LOST)
        _, err = waiter.communicate(timeout=30)
    finally:
        waiter.kill()
        waiter.wait()
    assert waiter.returncode == 4, err
    assert "gpuwait: error: GPU 1 did not answer" in err


@pytest.mark.parametrize("option", [["--devices", "1"], ["--gpus", "2"]])
def test_a_waiter_whose_own_gpu_is_lost_gives_up_after_gpu_error_timeout(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str], option: list[str]
) -> None:
    # `--devices 1` waiting when GPU 1 fell off the bus, GPU 0 still answering: it waited for
    # ever ("no usable GPU right now") for a card that needs a reset or a reboot. So did
    # `--gpus 2` on these two GPUs ("only 1 of the GPUs it may use answers now"), where a
    # launch in the same state gives up after gpu_error_timeout.
    fake_nvml.set_gpus([FakeGpu(total=24 * GIB), FakeGpu(total=24 * GIB, used=20 * GIB)])
    waiter_ends_once_gpu_1_is_lost(fake_nvml, [*gpuwait_cmd, *option])
    assert ledger_entries() == []


@pytest.mark.parametrize("option", [["--gpu-name", "A100"], ["--min-total-vram", "40G"]])
def test_a_waiter_for_two_of_a_kind_one_lost_gives_up_though_another_kind_answers(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str], option: list[str]
) -> None:
    # Two 80 GiB A100s and a 24 GiB T4: `--gpus 2` of the A100s, one of them lost, waited for
    # ever, counting the T4 among the GPUs it may use.
    fake_nvml.set_gpus(
        [
            FakeGpu(total=80 * GIB),
            FakeGpu(total=80 * GIB, used=76 * GIB),
            FakeGpu(total=24 * GIB, name="Fake T4"),
        ]
    )
    waiter_ends_once_gpu_1_is_lost(fake_nvml, [*gpuwait_cmd, "--gpus", "2", *option])


@pytest.mark.parametrize(
    ("failing", "code"),
    [("nvmlDeviceGetCount_v2", UNKNOWN), ("nvmlDeviceGetHandleByIndex_v2", GPU_IS_LOST)],
)
def test_a_launch_whose_readings_keep_failing_gives_up_at_its_timeout(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str], failing: str, code: int
) -> None:
    # NVML failing from the launch on (the GPU count, or every card lost): a job given
    # `--timeout 1s` waited out gpu_error_timeout instead (5 minutes by default, 90 s here),
    # though its --timeout counts from the launch. It gives up at its timeout now, exit 124,
    # saying why.
    fake_nvml.set_gpus([FakeGpu(total=24 * GIB)])
    fake_nvml.fail(None, failing, code)
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "1G", "--timeout", "1s", "--", "true"],
        env={**fake_nvml.env(), "GPUWAIT_GPU_ERROR_TIMEOUT": "90s"},
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert done.returncode == 124, done.stderr
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("gpuwait: error:")]
    assert error.startswith("gpuwait: error: gave up after waiting "), error
    assert f"(NVML error {code})" in error, error


@pytest.mark.parametrize("func", ["nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetMigMode"])
def test_a_launch_where_every_gpu_is_lost_retries_then_exits_4(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str], func: str
) -> None:
    # It was refused as if the request were too large, with a hint to ask for less: at once
    # (exit 3, "no candidate GPU") where the GPU was lost halfway through its reading, after
    # gpu_error_timeout ("GPU 0 did not answer, and without it no candidate GPU") otherwise.
    fake_nvml.set_gpus([FakeGpu(total=24 * GIB)])
    fake_nvml.fail(None, func, GPU_IS_LOST)
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "1G", "--", "true"],
        env={**fake_nvml.env(), "GPUWAIT_GPU_ERROR_TIMEOUT": "0.5s"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 4, done.stderr
    assert "gpuwait: error: no GPU answers: GPU 0: GPU is lost (NVML error 15) (failing" in (
        done.stderr
    )
    assert "gpuwait: hint: check the GPUs (nvidia-smi" in done.stderr


def test_nvml_shut_down_under_gpuwait_is_started_again(two_gpus: FakeNvml) -> None:
    # NVML's own count of starts back to 0 under gpuwait (a program holding a reservation
    # from gpuwait.reserve() that shuts NVML down once more than it started it): every call
    # answered "Uninitialized" for good, so a waiter gave up after gpu_error_timeout (exit 4)
    # and a running job's samples were lost, though the driver was fine.
    import pynvml  # type: ignore[import-untyped]

    backend = NvmlBackend()
    try:
        pynvml.nvmlShutdown()
        assert [g.uuid for g in backend.snapshot().gpus] == ["GPU-fake-0", "GPU-fake-1"]
    finally:
        backend.close()


def test_a_gpu_this_process_may_not_use_is_left_out_not_waited_for(
    two_gpus: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # A container's device cgroup (or Slurm's ConstrainDevices) hides GPU 1: NVML answers
    # NO_PERMISSION for it at every reading. Taken for a GPU that may answer again, it made a
    # request that can never fit retry for gpu_error_timeout (5 min by default), then exit 4.
    two_gpus.fail(1, "nvmlDeviceGetHandleByIndex_v2", NO_PERMISSION)
    backend = NvmlBackend()
    try:
        snap = backend.snapshot()
    finally:
        backend.close()
    assert [g.index for g in snap.gpus] == [0] and snap.unanswered == ()
    assert snap.warnings == (
        "GPU 1: no permission to use it (NVML error 4: hidden from this container or job?);"
        " left out",
    )
    started = time.monotonic()
    done = subprocess.run(
        [*gpuwait_cmd, "--gpus", "2", "--vram", "1G", "--", "true"],
        env={**two_gpus.env(), "GPUWAIT_GPU_ERROR_TIMEOUT": "3s"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    assert "2 GPUs wanted but only 1" in done.stderr
    assert time.monotonic() - started < 3


@pytest.mark.parametrize(
    ("hidden", "visible", "gpus", "given"),
    [
        ((0, 1), "0", 1, ["GPU-c"]),  # given the third card: Slurm says 0
        ((1,), "0,1", 2, ["GPU-a", "GPU-c"]),  # given the first and the third: 0,1
    ],
)
def test_an_index_in_cuda_visible_devices_counts_only_the_gpus_this_process_may_use(
    fake_nvml: FakeNvml,
    gpuwait_cmd: list[str],
    hidden: tuple[int, ...],
    visible: str,
    gpus: int,
    given: list[str],
) -> None:
    # Slurm with ConstrainDevices (task/cgroup) numbers a job's GPUs from 0, as CUDA does: it
    # counts only the cards the job's device cgroup lets it open, where NVML counts every card
    # and answers NO_PERMISSION for the others. An index was taken for NVML's: the job given
    # the third card was refused ("makes no GPU visible"), the one given the first and the
    # third was held to the first alone.
    fake_nvml.set_gpus([FakeGpu(uuid=f"GPU-{card}", total=24 * GIB) for card in "abc"])
    for index in hidden:
        fake_nvml.fail(index, "nvmlDeviceGetHandleByIndex_v2", NO_PERMISSION)
    echo = ("sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
    done = subprocess.run(
        [*gpuwait_cmd, "-q", "--gpus", str(gpus), "--vram", "1G", "--", *echo],
        env={**fake_nvml.env(), "CUDA_VISIBLE_DEVICES": visible},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ",".join(given)
    status = subprocess.run(
        [*gpuwait_cmd, "status", "--json"],
        env={**fake_nvml.env(), "CUDA_VISIBLE_DEVICES": visible},
        capture_output=True,
        text=True,
        timeout=60,
    )
    report = json.loads(status.stdout)
    assert [g["uuid"] for g in report["gpus"] if g["visible_here"]] == given


def test_the_gpus_a_device_cgroup_hides_are_named_in_one_warning(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # In a Slurm job with ConstrainDevices on an eight-card node, each launch (each `python`
    # the shell hook wraps) said seven lines, one for each card the job was not given.
    fake_nvml.set_gpus([FakeGpu(total=24 * GIB)] * 8)
    for index in range(1, 8):
        fake_nvml.fail(index, "nvmlDeviceGetHandleByIndex_v2", NO_PERMISSION)
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "1G", "--", "true"],
        env=fake_nvml.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "gpuwait: warning: GPU 1, 2, 3, 4, 5, 6, 7: no permission to use them (NVML error 4: "
        "hidden from this container or job?); left out"
    ]


def test_visible_devices_index_gives_cudas_number_where_a_device_cgroup_hides_gpus(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # visible_devices = index (for vLLM and other programs that read numbers) gave the NVML
    # index, 2 for the third card; where a device cgroup hides the first two (a Slurm job with
    # ConstrainDevices), CUDA numbers that card 0 and has no 2: the program found no GPU.
    fake_nvml.set_gpus([FakeGpu(uuid=f"GPU-{card}", total=24 * GIB) for card in "abc"])
    fake_nvml.fail(0, "nvmlDeviceGetHandleByIndex_v2", NO_PERMISSION)
    fake_nvml.fail(1, "nvmlDeviceGetHandleByIndex_v2", NO_PERMISSION)
    echo = ("sh", "-c", "echo $CUDA_VISIBLE_DEVICES $GPUWAIT_GPU_INDICES $GPUWAIT_GPU_UUIDS")
    done = subprocess.run(
        [*gpuwait_cmd, "-q", "--vram", "1G", "--", *echo],
        env={**fake_nvml.env(), "GPUWAIT_VISIBLE_DEVICES": "index"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "2", "GPU-c"]


def test_a_gpu_refused_only_a_query_is_counted_by_cuda_as_it_is(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # NVML gave GPU 0's handle (its device file opens: no device cgroup hides it) and then
    # answered one query NO_PERMISSION. CUDA counts that card; it was taken for one a cgroup
    # hides, so with visible_devices = index the job given GPU 1 got CUDA_VISIBLE_DEVICES=0:
    # the card left out, memory in use there by others. An inherited 1 was read as GPU 2.
    fake_nvml.set_gpus([FakeGpu(uuid=f"GPU-{card}", total=24 * GIB) for card in "abc"])
    fake_nvml.fail(0, "nvmlDeviceGetMemoryInfo_v2", NO_PERMISSION)
    echo = ("sh", "-c", "echo $CUDA_VISIBLE_DEVICES $GPUWAIT_GPU_INDICES $GPUWAIT_GPU_UUIDS")
    done = subprocess.run(
        [*gpuwait_cmd, "-q", "--vram", "1G", "--", *echo],
        env={**fake_nvml.env(), "GPUWAIT_VISIBLE_DEVICES": "index", "CUDA_VISIBLE_DEVICES": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1", "GPU-b"]


def test_a_shell_that_outlived_a_job_given_cudas_number_is_bound_to_its_gpu_no_more(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # A tmux shell opened inside a job run with visible_devices = index, where a device cgroup
    # hides GPU 0: the job had CUDA_VISIBLE_DEVICES=1 (CUDA's number for GPU 2), which is not
    # GPUWAIT_GPU_INDICES (2). Once the job ended, its python was wrapped again, but still
    # bound to the ended job's GPU, and waited for it while GPU 1 was free.
    fake_nvml.set_gpus([FakeGpu(uuid=f"GPU-{card}", total=24 * GIB) for card in "abc"])
    fake_nvml.update_gpu(2, used=24 * GIB)
    fake_nvml.fail(0, "nvmlDeviceGetHandleByIndex_v2", NO_PERMISSION)
    gone = subprocess.Popen(["true"])
    gone.wait()
    outlived = {
        "GPUWAIT_JOB_ID": "0a1b2c3d",
        "GPUWAIT_JOB_PID": str(gone.pid),
        "GPUWAIT_GPU_UUIDS": "GPU-c",
        "GPUWAIT_GPU_INDICES": "2",
        "CUDA_VISIBLE_DEVICES": "1",
        "GPUWAIT_VISIBLE_DEVICES": "index",
        "GPUWAIT_TIMEOUT": "3s",
    }
    show = "import os; print(os.environ['GPUWAIT_GPU_UUIDS'])"
    done = subprocess.run(
        [*gpuwait_cmd, "shell-hook", "--", "python", "-c", show],
        env={**fake_nvml.env(), **outlived},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["GPU-b"]


def test_a_slurm_job_without_cuda_visible_devices_is_told_cudas_number_of_its_gpu(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # A Slurm job given the third of four cards, with ConstrainDevices, CUDA_VISIBLE_DEVICES
    # unset in it: refused, with the hint "set CUDA_VISIBLE_DEVICES=2" (SLURM_JOB_GPUS, the
    # node's numbering), which CUDA, counting only the card the job may open, reads as none:
    # the line the hint gave was refused in turn, "makes no GPU visible".
    fake_nvml.set_gpus([FakeGpu(uuid=f"GPU-{card}", total=24 * GIB) for card in "abcd"])
    for index in (0, 1, 3):
        fake_nvml.fail(index, "nvmlDeviceGetHandleByIndex_v2", NO_PERMISSION)
    conf = tmp_path / "slurm.conf"
    conf.write_text("GresTypes=gpu\n")
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURMD_NODENAME": "node1",
        "SLURM_JOB_GPUS": "2",
        "SLURM_CONF": str(conf),
    }
    env = {**fake_nvml.env(), **slurm}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    echo = ("sh", "-c", "echo $GPUWAIT_GPU_UUIDS")
    done = subprocess.run(
        [*gpuwait_cmd, "-q", "--vram", "1G", "--", *echo],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stderr
    assert done.stderr.splitlines()[-1].endswith("or set CUDA_VISIBLE_DEVICES=0"), done.stderr
    done = subprocess.run(
        [*gpuwait_cmd, "-q", "--vram", "1G", "--", *echo],
        env={**env, "CUDA_VISIBLE_DEVICES": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["GPU-c"]


def meminfo() -> dict[str, int]:
    """/proc/meminfo's figures in bytes."""
    figures = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        figures[name] = int(rest.split()[0]) * 1024
    return figures


def test_a_gpu_that_shares_the_systems_memory_is_counted_by_it(
    fake_nvml: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # A GPU with no memory of its own (GB10 in DGX Spark: the system's memory is the GPU's)
    # answers NOT_SUPPORTED to both memory queries. It was skipped at every reading as a GPU
    # that may answer again: a launch retried for gpu_error_timeout, then ended with exit 4.
    fake_nvml.set_gpus([FakeGpu(uuid="GPU-uma")])
    fake_nvml.fail(0, "nvmlDeviceGetMemoryInfo", NOT_SUPPORTED)
    fake_nvml.fail(0, "nvmlDeviceGetMemoryInfo_v2", NOT_SUPPORTED)
    backend = NvmlBackend()
    try:
        before = meminfo()
        (gpu,) = backend.snapshot().gpus
        after = meminfo()
    finally:
        backend.close()
    assert gpu.total_bytes == before["MemTotal"]
    used = [before["MemTotal"] - m["MemAvailable"] for m in (before, after)]
    assert min(used) - GIB <= gpu.used_bytes <= max(used) + GIB
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"],
        env={**fake_nvml.env(), "GPUWAIT_GPU_ERROR_TIMEOUT": "2s"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "GPU-uma"), done.stderr


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (
            18,
            [
                "gpuwait: error: NVIDIA driver and NVML library versions do not match "
                "(NVML error 18)",
                "gpuwait: hint: reboot, or reload the nvidia kernel modules, after a driver "
                "upgrade; GPUWAIT_SIM=FILE uses simulated GPUs meanwhile",
            ],
        ),
        (
            NO_PERMISSION,
            [
                "gpuwait: error: no permission to use the NVIDIA driver (NVML error 4)",
                "gpuwait: hint: ask an administrator for access to the GPUs' device files "
                "(/dev/nvidiactl, /dev/nvidia*); GPUWAIT_SIM=FILE uses simulated GPUs meanwhile",
            ],
        ),
    ],
)
def test_a_driver_no_wait_can_mend_ends_a_launch_at_once_with_the_fix(
    two_gpus: FakeNvml, gpuwait_cmd: list[str], code: int, said: list[str]
) -> None:
    # The NVML library no longer matches the loaded kernel module (NVML error 18) until a
    # reboot; NVML refuses to start for want of permission (NVML error 4: a user who may not
    # open /dev/nvidiactl) until an administrator acts. The launch retried for
    # gpu_error_timeout (5 min by default) for nothing, saying what to do only at the end (for
    # error 4: to install the NVIDIA driver). Nor is it a machine without GPUs, where
    # on_no_gpu = run would start the command uncoordinated.
    two_gpus.fail_init(code)
    started = time.monotonic()
    for on_no_gpu in ("fail", "run"):
        done = subprocess.run(
            [*gpuwait_cmd, "--vram", "1G", "--", "echo", "ran"],
            env={
                **two_gpus.env(),
                "GPUWAIT_GPU_ERROR_TIMEOUT": "3s",
                "GPUWAIT_ON_NO_GPU": on_no_gpu,
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 4 and done.stdout == "", done.stderr
        assert done.stderr.splitlines() == said
    assert time.monotonic() - started < 3


def test_max_util_on_gpus_whose_utilization_never_reads_ends_after_gpu_error_timeout(
    two_gpus: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    # Every reading of both cards' utilization fails (an NVML error other than "not
    # supported"): --max-util, which waits for a reading under its cap, waited for ever.
    for gpu in (0, 1):
        two_gpus.fail(gpu, "nvmlDeviceGetUtilizationRates", 999)
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "1G", "--max-util", "50", "--", "true"],
        env={**two_gpus.env(), "GPUWAIT_GPU_ERROR_TIMEOUT": "1s"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 4, done.stderr
    assert "utilization" in done.stderr and "--max-util" in done.stderr
    assert "gpu_error_timeout" in done.stderr


def _blocked(thread: threading.Thread) -> set[int]:
    """The signals `thread` holds blocked, as the kernel tells."""
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    mask = int(status.split("SigBlk:")[1].split()[0], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def test_a_thread_stuck_in_the_driver_takes_none_of_the_signals_meant_for_gpuwait(
    two_gpus: FakeNvml,
) -> None:
    # Signals are the main thread's: gpuwait holds them for its waiting loop, which passes them
    # on to the command. A thread stuck in the driver that did not hold them too was the one
    # the kernel gave a SIGTERM for gpuwait whenever the main thread was outside that loop (a
    # ledger transaction, a reading): gpuwait died of it at once, its command left running,
    # never told.
    two_gpus.hang(0, "nvmlDeviceGetMemoryInfo_v2", 2.0)
    before = set(threading.enumerate())
    backend = NvmlBackend(timeout=0.3)
    try:
        backend.snapshot()
        stuck = [t for t in set(threading.enumerate()) - before if t.is_alive()]
        assert stuck, "no call of the reading was left stuck in the driver"
        wanted = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGTSTP}
        for thread in stuck:
            assert wanted <= _blocked(thread), thread.name
        # The caller's own mask is as it was: nothing held that it did not hold.
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()
    finally:
        backend.close()
        for thread in set(threading.enumerate()) - before:
            thread.join(timeout=30)


def test_a_hung_nvml_start_leaves_one_call_in_the_driver_however_often_it_is_tried(
    two_gpus: FakeNvml,
) -> None:
    # nvmlInit stuck in the driver: each try to open NVML (a waiter retries for as long as
    # gpu_error_timeout, hours if need be) started one more call, and left one more thread
    # stuck in the driver, for as long as it stayed wedged.
    before = set(threading.enumerate())
    two_gpus.hang(None, "nvmlInitWithFlags", 3)
    try:
        for _ in range(3):
            with pytest.raises(BackendUnavailable, match="did not start"):
                NvmlBackend(timeout=0.3)
        assert len(set(threading.enumerate()) - before) == 1
        started = [c for c in two_gpus.calls() if c.startswith("nvmlInitWithFlags ")]
        assert started == ["nvmlInitWithFlags gpu=- ret=-1 hang"], started
        # The call that came back at last is the next try's start: NVML opens, and no other
        # call was made.
        two_gpus.clear_failures()

        def opened() -> NvmlBackend | None:
            try:
                return NvmlBackend(timeout=0.3)
            except BackendUnavailable:
                return None

        backend = wait_for(opened, timeout=30, interval=0.1, message="NVML never started")
        try:
            assert len(backend.snapshot().gpus) == 2
        finally:
            backend.close()
        started = [c for c in two_gpus.calls() if c.startswith("nvmlInitWithFlags ")]
        assert started == ["nvmlInitWithFlags gpu=- ret=-1 hang", "nvmlInitWithFlags gpu=- ret=0"]
    finally:
        for thread in set(threading.enumerate()) - before:
            thread.join(timeout=30)


def test_a_restart_of_nvml_that_hangs_leaves_one_call_in_the_driver(two_gpus: FakeNvml) -> None:
    # NVML shut down under gpuwait, and the driver wedged as it is started again: each reading
    # retried the start, and one that made a call of its own each time left one more thread
    # stuck in the driver at every poll, for as long as it stayed wedged.
    import pynvml

    before = set(threading.enumerate())
    backend = NvmlBackend(timeout=0.3)
    try:
        pynvml.nvmlShutdown()
        two_gpus.hang(None, "nvmlInitWithFlags", 3)
        for _ in range(3):
            with pytest.raises(BackendUnavailable, match="GPU count"):
                backend.snapshot()
        assert len([t for t in set(threading.enumerate()) - before if t.is_alive()]) == 1
        hung = [c for c in two_gpus.calls() if c == "nvmlInitWithFlags gpu=- ret=-1 hang"]
        assert len(hung) == 1, two_gpus.calls()
        # The start that came back at last is the reading's: the GPUs are read again.
        two_gpus.clear_failures()
        gpus = wait_for(
            lambda: _read_gpus(backend), timeout=30, interval=0.1, message="NVML never restarted"
        )
        assert gpus == ["GPU-fake-0", "GPU-fake-1"]
    finally:
        backend.close()
        for thread in set(threading.enumerate()) - before:
            thread.join(timeout=30)


def _read_gpus(backend: NvmlBackend) -> list[str] | None:
    try:
        return [g.uuid for g in backend.snapshot().gpus]
    except BackendUnavailable:
        return None


def test_ctrl_z_stops_a_waiter_while_the_driver_does_not_answer(
    two_gpus: FakeNvml, gpuwait_cmd: list[str]
) -> None:
    """A Ctrl-Z that lands while a waiter waits for the driver to answer a reading stops it at
    once, not once the driver has answered or nvml_timeout has passed (5 s a call, for each
    GPU), the terminal's Ctrl-Z doing nothing meanwhile."""
    two_gpus.set_gpus([FakeGpu(total=24 * GIB, used=20 * GIB)] * 2)
    waiter = subprocess.Popen(
        [*gpuwait_cmd, "--vram", "10G", "--", "true"],
        env={**two_gpus.env(), "GPUWAIT_NVML_INTERVAL": "0.2s"},
        stderr=subprocess.DEVNULL,
        process_group=0,  # a job control shell's job: Ctrl-Z is ignored in an orphaned group
    )
    try:
        wait_for(lambda: any(e.get("state") == "waiting" for e in ledger_entries()), timeout=30)
        two_gpus.hang(None, "nvmlDeviceGetMemoryInfo_v2", 4.0)
        time.sleep(1.0)  # the next reading (every 0.2 s) has begun, and waits for the driver
        os.killpg(waiter.pid, signal.SIGTSTP)  # Ctrl-Z
        started = time.monotonic()
        wait_for(lambda: process_state(waiter.pid) == "T", timeout=10)
        assert time.monotonic() - started < 1.5
    finally:
        os.killpg(waiter.pid, signal.SIGKILL)
        waiter.wait()
