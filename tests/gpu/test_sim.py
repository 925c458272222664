"""The GPU simulation: sim files, the backend's readings, and simulated CUDA jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.fixtures_sim import SIMJOB, SimFileFactory, sim_file_text, start_sim_job
from helpers.users import can_switch_users, clean_up, run_as, shared_root, user_home
from helpers.waiting import wait_for

from gpuwait.core.errors import BackendUnavailable, UsageError
from gpuwait.gpu.sim import (
    Allocation,
    SimBackend,
    SimConfig,
    cuda_visible_gpus,
    default_uuid,
    load_sim_file,
    sim_lock,
    state_dir_for,
    write_allocation,
    write_sim_file,
)
from gpuwait.gpu.simjob import torch_size
from gpuwait.linux import proc

GiB = 2**30
MiB = 2**20
UUID_A = "GPU-aaaa1111-0000-0000-0000-000000000000"
UUID_B = "GPU-aaaa2222-0000-0000-0000-000000000000"
UUID_C = "GPU-cccc3333-0000-0000-0000-000000000000"


def snapshot(path: Path) -> dict[int, tuple[int, dict[int, int]]]:
    """index -> (used bytes, {pid: bytes})."""
    snap = SimBackend(str(path)).snapshot()
    return {
        g.index: (g.used_bytes, {p.pid: p.used_bytes or 0 for p in g.processes}) for g in snap.gpus
    }


def gpu_used(path: Path, index: int) -> int:
    return snapshot(path)[index][0]


def finish(job: subprocess.Popen[str], timeout: float = 20) -> tuple[int, str, str]:
    out, err = job.communicate(timeout=timeout)
    return job.returncode, out, err


def report(path: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads(path.read_text())
    return data


# --- readings ----------------------------------------------------------------------------------


def test_snapshot_reflects_running_job_then_base(sim_file: SimFileFactory, tmp_path: Path) -> None:
    path = sim_file(
        gpus=2,
        base_used="300MiB",
        utilization=[None, 35],
        name="Sim A100",
        compute_capability=[None, "8.6"],
    )
    base = 300 * MiB
    job = start_sim_job(
        "--vram",
        "4G",
        "--hold",
        "1s",
        env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"},
    )
    try:
        wait_for(lambda: snapshot(path)[1][1], timeout=15)
        used, processes = snapshot(path)[1]
        assert processes == {job.pid: 4 * GiB}
        assert used == base + 4 * GiB
        assert snapshot(path)[0] == (base, {})
    finally:
        rc, out, err = finish(job)
    assert (rc, out, err) == (0, "", "")
    assert snapshot(path) == {0: (base, {}), 1: (base, {})}
    assert not (state_dir_for(path) / f"{job.pid}.json").exists()
    snap = SimBackend(str(path)).snapshot()
    assert snap.backend == "sim" and snap.warnings == ()
    gpu = snap.gpus[1]
    assert (gpu.name, gpu.total_bytes, gpu.utilization_pct) == ("Sim A100", 24 * GiB, 35)
    assert gpu.uuid == default_uuid(os.path.realpath(path), 1)
    assert snap.gpus[0].utilization_pct is None
    assert [g.compute_capability for g in snap.gpus] == [None, (8, 6)]


def test_ramping_job_grows(sim_file: SimFileFactory, tmp_path: Path) -> None:
    path = sim_file(gpus=1)
    out = tmp_path / "report.json"
    job = start_sim_job("--vram", "2G", "--ramp", "1.5s", "--hold", "0.2s", "--report", str(out))
    try:
        first = wait_for(lambda: gpu_used(path, 0), timeout=15)
        wait_for(lambda: gpu_used(path, 0) > first + 200 * MiB, timeout=5)
        second = gpu_used(path, 0)
        assert 0 < first < second <= 2 * GiB
        assert first < 2 * GiB
    finally:
        rc, _, err = finish(job)
    assert rc == 0, err
    assert report(out)["peak_bytes"] == 2 * GiB
    assert gpu_used(path, 0) == 0


# --- out of memory: the over-admission detector ------------------------------------------------


@pytest.mark.parametrize("ramp", ["0", "0.4s"])
def test_two_jobs_that_do_not_fit_one_dies_of_oom(
    sim_file: SimFileFactory, tmp_path: Path, ramp: str
) -> None:
    sim_file(gpus=1, memory="24GiB")
    reports = [tmp_path / "a.json", tmp_path / "b.json"]
    jobs = [
        # The hold outlasts the other job's start by far, so the two always overlap.
        start_sim_job("--vram", "16G", "--ramp", ramp, "--hold", "2s", "--report", str(r))
        for r in reports
    ]
    results = [finish(job) for job in jobs]
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 1], results
    loser = next(i for i, (rc, _, _) in enumerate(results) if rc == 1)
    winner = 1 - loser
    err = results[loser][2].strip()
    assert err.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ")
    assert "GPU 0 has a total capacity of 24.00 GiB of which " in err
    assert f"Process {jobs[winner].pid} has " in err
    assert len(err.splitlines()) == 1
    assert results[winner][2] == ""
    assert report(reports[loser])["oom"] is True
    assert report(reports[winner])["oom"] is False
    assert report(reports[winner])["peak_bytes"] == 16 * GiB


def test_many_jobs_never_overcommit(sim_file: SimFileFactory) -> None:
    path = sim_file(gpus=1, memory="24GiB", base_used="1GiB")
    # Held long enough that all eight overlap even on a loaded machine: then at most four fit.
    jobs = [start_sim_job("--vram", "5G", "--ramp", "0.3s", "--hold", "3s") for _ in range(8)]
    peak = 0
    config = load_sim_file(str(path))
    while any(job.poll() is None for job in jobs):
        # Read under the simulation's lock, as the jobs decide: read without it, a record
        # read before its job released and another's written after (a loaded machine) added
        # up to more than the card ever held.
        with sim_lock(config):
            peak = max(peak, gpu_used(path, 0))
    results = [finish(job) for job in jobs]
    assert peak <= 24 * GiB
    survivors = [rc for rc, _, _ in results if rc == 0]
    assert 1 <= len(survivors) <= 4, results
    assert all(rc == 0 or (rc == 1 and "CUDA out of memory" in err) for rc, _, err in results), (
        results
    )
    assert gpu_used(path, 0) == GiB


def test_oom_message_when_card_is_full_at_once(sim_file: SimFileFactory) -> None:
    sim_file(gpus=1, memory="24GiB", base_used="8GiB")
    first = start_sim_job("--vram", "12G", "--hold", "20s")
    try:
        path = Path(os.environ["GPUWAIT_SIM"])
        wait_for(lambda: snapshot(path)[0][1], timeout=15)
        rc, out, err = finish(start_sim_job("--vram", "6G", "--hold", "0"))
    finally:
        first.kill()
        first.communicate()
    assert rc == 1 and out == ""
    assert err.strip() == (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.00 GiB. "
        "GPU 0 has a total capacity of 24.00 GiB of which 4.00 GiB is free. "
        f"Process {first.pid} has 12.00 GiB memory in use. "
        "Including non-PyTorch memory, this process has 0 bytes memory in use."
    )


def test_job_that_fits_exactly_runs(sim_file: SimFileFactory) -> None:
    sim_file(gpus=1, memory="24GiB", base_used="4GiB")
    assert finish(start_sim_job("--vram", "20G", "--hold", "0", "--exit", "3")) == (3, "", "")


def test_torch_size_matches_pytorch_format() -> None:
    assert torch_size(0) == "0 bytes"
    assert torch_size(512 * MiB) == "512.00 MiB"
    assert torch_size(GiB) == "1024.00 MiB"
    assert torch_size(3 * GiB + GiB // 2) == "3.50 GiB"
    assert torch_size(2048) == "2.00 KiB"


# --- CUDA_VISIBLE_DEVICES and device order -----------------------------------------------------


@pytest.fixture
def three_cards(sim_file: SimFileFactory) -> SimConfig:
    # Fastest first: C (3.0), A (1.0), B (1.0): ties keep PCI order.
    path = sim_file(gpus=3, uuid=[UUID_A, UUID_B, UUID_C], speed=[1.0, 1.0, 3.0])
    return load_sim_file(path)


def visible(config: SimConfig, value: str | None, order: str | None = "PCI_BUS_ID") -> list[int]:
    env = {}
    if value is not None:
        env["CUDA_VISIBLE_DEVICES"] = value
    if order is not None:
        env["CUDA_DEVICE_ORDER"] = order
    return [gpu.index for gpu in cuda_visible_gpus(config, env)]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [0, 1, 2]),
        ("1", [1]),
        ("2,0", [2, 0]),
        (" 1 , 2 ", [1, 2]),
        (UUID_B, [1]),
        (f"{UUID_C},0", [2, 0]),
        ("GPU-cccc", [2]),
        ("GPU-aaaa2", [1]),
        ("GPU-aaaa", []),  # ambiguous prefix: invalid, parsing stops
        ("0,7,1", [0]),  # unknown index stops parsing
        ("0,-1,1", [0]),
        ("1,x,0", [1]),
        ("0,0,1", [0]),  # a repeat is invalid too
        (f"{UUID_A},0", [0]),  # 0 is the same card as UUID_A: a repeat
        ("0,,1", [0]),
        ("GPU-ffff", []),
        ("MIG-1", []),
        ("", []),
        ("  ", []),
    ],
)
def test_cuda_visible_devices(
    three_cards: SimConfig, value: str | None, expected: list[int]
) -> None:
    assert visible(three_cards, value) == expected


@pytest.mark.parametrize("order", [None, "FASTEST_FIRST", "bogus"])
def test_default_order_is_fastest_first(three_cards: SimConfig, order: str | None) -> None:
    assert visible(three_cards, None, order) == [2, 0, 1]
    assert visible(three_cards, "0", order) == [2]
    assert visible(three_cards, "1,2", order) == [0, 1]
    assert visible(three_cards, "GPU-aaaa2,0", order) == [1, 2]


@pytest.mark.parametrize(("order", "index"), [("PCI_BUS_ID", 0), (None, 1)])
def test_job_takes_cuda_device_zero(
    sim_file: SimFileFactory, tmp_path: Path, order: str | None, index: int
) -> None:
    sim_file(gpus=2, speed=[1.0, 2.0])
    out = tmp_path / "report.json"
    env = {"CUDA_DEVICE_ORDER": order, "CUDA_VISIBLE_DEVICES": "0"}
    assert (
        finish(start_sim_job("--vram", "1G", "--hold", "0", "--report", str(out), env=env))[0] == 0
    )
    assert report(out)["gpu_index"] == index
    assert report(out)["cuda_visible_devices"] == "0"


def test_job_by_uuid_prefix(three_cards: SimConfig, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = {"CUDA_VISIBLE_DEVICES": "GPU-aaaa2"}
    assert (
        finish(start_sim_job("--vram", "1G", "--hold", "0", "--report", str(out), env=env))[0] == 0
    )
    assert (report(out)["gpu_index"], report(out)["gpu_uuid"]) == (1, UUID_B)


@pytest.mark.parametrize("value", ["", "5", "nonsense"])
def test_job_without_visible_device(sim_file: SimFileFactory, tmp_path: Path, value: str) -> None:
    sim_file(gpus=2)
    out = tmp_path / "report.json"
    rc, stdout, err = finish(
        start_sim_job("--vram", "1G", "--report", str(out), env={"CUDA_VISIBLE_DEVICES": value})
    )
    assert (rc, stdout, err) == (1, "", "CUDA error: no CUDA-capable device is detected\n")
    assert report(out)["gpu_uuid"] is None


# --- stale records -----------------------------------------------------------------------------


def test_sigkilled_job_stops_counting(sim_file: SimFileFactory) -> None:
    path = sim_file(gpus=1, memory="24GiB")
    job = start_sim_job("--vram", "20G", "--hold", "30s")
    try:
        wait_for(lambda: snapshot(path)[0][1], timeout=15)
    finally:
        job.send_signal(signal.SIGKILL)
        job.communicate()
    assert job.returncode == -signal.SIGKILL
    # The record stays behind, as a killed process cannot clean up; it no longer counts.
    assert (state_dir_for(path) / f"{job.pid}.json").exists()
    assert snapshot(path) == {0: (0, {})}
    # A new job is not blocked by it, and its allocation pass clears the dead record.
    assert finish(start_sim_job("--vram", "20G", "--hold", "0")) == (0, "", "")
    assert not (state_dir_for(path) / f"{job.pid}.json").exists()


def one_card_for_this_process(sim_file: SimFileFactory) -> tuple[Path, Path, int, int, str]:
    """A simulated 24 GiB card with its records' directory made: the file, the directory,
    this process's pid and start time, and the card's UUID."""
    path = sim_file(gpus=1, memory="24GiB")
    directory = state_dir_for(path)
    directory.mkdir(mode=0o700)
    me = os.getpid()
    started = proc.start_time(me)
    assert started is not None
    return path, directory, me, started, load_sim_file(path).gpus[0].uuid


def test_record_of_reused_pid_does_not_count(sim_file: SimFileFactory) -> None:
    path, directory, me, started, uuid = one_card_for_this_process(sim_file)
    # Our pid, but a start time of some earlier process that had it.
    write_allocation(directory, Allocation(me, started - 1, uuid, 20 * GiB))
    assert snapshot(path) == {0: (0, {})}
    assert finish(start_sim_job("--vram", "20G", "--hold", "0")) == (0, "", "")
    # The same record with the right start time does count: it is this live process.
    write_allocation(directory, Allocation(me, started, uuid, 20 * GiB))
    assert snapshot(path) == {0: (20 * GiB, {me: 20 * GiB})}
    rc, _, err = finish(start_sim_job("--vram", "20G", "--hold", "0"))
    assert rc == 1 and f"Process {me} has 20.00 GiB memory in use." in err


def test_garbage_records_are_ignored(sim_file: SimFileFactory) -> None:
    path = sim_file(gpus=1)
    directory = state_dir_for(path)
    directory.mkdir()
    me = os.getpid()
    (directory / f"{me}.json").write_text('{"schema": 1, "pid": ')
    (directory / "12.json").write_text("[]")
    (directory / "notes.txt").write_text("hello")
    (directory / f"{me + 1}.json").write_text(
        json.dumps({"schema": 1, "pid": me, "start_time": 0, "gpu_uuid": "x", "bytes": 1})
    )
    assert snapshot(path) == {0: (0, {})}


def test_a_record_whose_name_ends_in_a_newline_is_no_jobs(sim_file: SimFileFactory) -> None:
    # In a shared simulation's directory anyone can add a file: one named `<pid>.json` and a
    # newline was read as that process's allocation, beside its real one.
    path, directory, me, started, uuid = one_card_for_this_process(sim_file)
    write_allocation(directory, Allocation(me, started, uuid, 20 * GiB))
    os.rename(directory / f"{me}.json", directory / f"{me}.json\n")
    assert snapshot(path) == {0: (0, {})}


# --- lost cards and bad files ------------------------------------------------------------------


def test_lost_gpu_is_skipped_then_back(sim_file: SimFileFactory) -> None:
    path = sim_file(gpus=2, lost=[False, True])
    snap = SimBackend(str(path)).snapshot()
    uuid = default_uuid(os.path.realpath(path), 1)
    assert [g.index for g in snap.gpus] == [0]
    assert snap.warnings == (f"GPU 1 ({uuid}): GPU is lost; skipped",)
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}
    assert finish(start_sim_job("--vram", "1G", env=env)) == (
        1,
        "",
        "CUDA error: unspecified launch failure\n",
    )
    sim_file(gpus=2, lost=False)
    snap = SimBackend(str(path)).snapshot()
    assert [g.index for g in snap.gpus] == [0, 1] and snap.warnings == ()


def test_a_sim_file_rewritten_within_one_tick_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gpuwait sim init --force` of 24 GiB cards in the tick after one of 48 GiB, on a file
    system with a coarse clock that gave the new file the old one's inode (as ext4 does): the
    same inode, size and times, and a waiter that read the first must not go on admitting
    jobs into 48 GiB."""
    import gpuwait.gpu.sim as sim
    from gpuwait.linux.stamp import FileStamp

    tick = time.time_ns()
    monkeypatch.setattr(sim, "stamp_of", lambda st: FileStamp(12, st.st_size, tick, tick))
    path = tmp_path / "sim.toml"
    write_sim_file(path, gpus=1, memory_bytes=48 * GiB)
    assert [g.total_bytes for g in load_sim_file(path).gpus] == [48 * GiB]
    write_sim_file(path, gpus=1, memory_bytes=24 * GiB, force=True)
    assert [g.total_bytes for g in load_sim_file(path).gpus] == [24 * GiB]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[gpu]]\nmemory = "24X"\n', "gpu 0: memory '24X' is not a size"),
        ("[[gpu]]\nmemory = 1\n[[gpu]]\nname = 'x'\n", "gpu 1: 'memory' is required"),
        ("[[gpu]]\nmemory = 0\n", "gpu 0: memory must be larger than zero"),
        ("[[gpu]]\nmemory = -5\n", "gpu 0: memory must not be negative"),
        ("[[gpu]]\nmemory = true\n", "gpu 0: memory must be a size"),
        ("[[gpu]]\nmemory = '1G'\nbase_used = '2G'\n", "base_used is larger than memory"),
        ("[[gpu]]\nmemory = '1G'\nmemroy = 1\n", "gpu 0: unknown key 'memroy'"),
        (
            "[[gpu]]\nmemory = '1G'\nbase_used = '0.5G'\ndriver_reserved = '0.6G'\n",
            "gpu 0: base_used and driver_reserved together are larger than memory",
        ),
        ("[[gpu]]\nmemory = '1G'\nspeed = 0\n", "gpu 0: speed 0 must be a number above zero"),
        ("[[gpu]]\nmemory = '1G'\nlost = 'yes'\n", "gpu 0: lost must be true or false"),
        ("[[gpu]]\nmemory = '1G'\nutilization = 150\n", "utilization 150 must be an integer"),
        ("[[gpu]]\nmemory = '1G'\nuuid = 'abc'\n", "gpu 0: uuid 'abc' must look like"),
        # A newline would go on into CUDA_VISIBLE_DEVICES.
        ("[[gpu]]\nmemory = '1G'\nuuid = \"GPU-1\\n\"\n", "gpu 0: uuid 'GPU-1\\n' must look"),
        ("[[gpu]]\nmemory = '1G'\ncompute_capability = 8.0\n", "compute_capability 8.0 must"),
        ("[[gpu]]\nmemory = '1G'\ncompute_capability = 'x'\n", "compute_capability 'x' must"),
        (
            f"[[gpu]]\nmemory = '1G'\nuuid = '{UUID_A}'\n" * 2,
            f"gpu 1: uuid '{UUID_A}' is also used by gpu 0",
        ),
        (
            "[[gpu]]\nmemory = '1G'\nuuid = 'GPU-1'\n[[gpu]]\nmemory = '1G'\nuuid = 'GPU-10'\n",
            "gpu 1: uuid 'GPU-10' begins with gpu 0's 'GPU-1'",
        ),
        (
            "[[gpu]]\nmemory = '1G'\nuuid = 'GPU-ab'\n[[gpu]]\nmemory = '1G'\nuuid = 'GPU-AB'\n",
            "gpu 1: uuid 'GPU-AB' begins with gpu 0's 'GPU-ab'",
        ),
        ("", "no [[gpu]] tables"),
        ("gpus = 2\n", "unknown top-level key 'gpus'"),
        ("gpu = 3\n", "'gpu' must be an array of tables"),
        ("[[gpu]\nmemory = 1\n", "not valid TOML"),
        (b"\xff\xfe".decode("latin-1"), "not valid TOML"),
    ],
)
def test_invalid_sim_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "sim.toml"
    path.write_text(text, encoding="latin-1")
    with pytest.raises(BackendUnavailable) as caught:
        SimBackend(str(path))
    assert caught.value.message.startswith(f"simulation file {path}: ")
    assert message in caught.value.message
    assert "\n" not in caught.value.message
    assert caught.value.hint


def test_missing_sim_file(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailable, match=r"simulation file .*/nope\.toml: not found"):
        SimBackend(str(tmp_path / "nope.toml"))


@pytest.mark.parametrize(
    ("name", "said"), [("a" * 300 + "/sim.toml", "File name too long"), ("x/sim.toml", "Not a")]
)
def test_a_sim_path_that_can_name_no_file_is_no_passing_failure(
    tmp_path: Path, gpuwait_cmd: list[str], name: str, said: str
) -> None:
    # GPUWAIT_SIM with a name too long for the file system (ENAMETOOLONG), or under a file
    # (ENOTDIR), was taken for a failure that may pass: retried for gpu_error_timeout (5
    # minutes by default, an hour here) where nothing would change. It is said at once, as a
    # file not found is, and on_no_gpu decides.
    (tmp_path / "x").write_text("")
    path = tmp_path / name
    with pytest.raises(BackendUnavailable, match=said) as caught:
        SimBackend(str(path))
    assert caught.value.lasting
    env = {
        **os.environ,
        "GPUWAIT_SIM": str(path),
        "GPUWAIT_ON_NO_GPU": "fail",
        "GPUWAIT_GPU_ERROR_TIMEOUT": "1h",
    }
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "1G", "--", "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 4, done.stderr
    error, hint = done.stderr.splitlines()
    assert error.startswith(f"gpuwait: error: simulation file {path}: cannot read it ({said}")
    assert "retrying" not in done.stderr and hint.startswith("gpuwait: hint: ")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_sim_file(sim_file: SimFileFactory) -> None:
    path = sim_file(gpus=1)
    path.chmod(0)
    with pytest.raises(BackendUnavailable, match="cannot read it"):
        SimBackend(str(path))


#: A user with no account, whom the test below runs gpuwait as.
USER = 47330


@pytest.mark.skipif(not can_switch_users(), reason="runs gpuwait as another user")
def test_a_launch_takes_a_simulation_file_it_may_not_read_as_no_gpu_at_once() -> None:
    # A file left so (chmod 000, another user's copy) is no save caught halfway: a launch
    # retried it for gpu_error_timeout (5 minutes) instead of telling at once, as for a file
    # that does not parse.
    root = shared_root()
    try:
        env = {**user_home(root, USER, USER), "PATH": os.environ["PATH"]}
        sim = root / "sim.toml"
        sim.write_text(sim_file_text(1, "24GiB"))
        os.chown(sim, USER, USER)
        sim.chmod(0)
        os.utime(sim, (time.time() - 60, time.time() - 60))
        env |= {"GPUWAIT_SIM": str(sim), "GPUWAIT_ON_NO_GPU": "fail"}
        done = run_as(USER, USER, [], ["--vram", "1G", "--", "true"], env, timeout=20)
        assert done.returncode == 4, done.stderr
        assert "cannot read it (Permission denied)" in done.stderr
        assert "retrying" not in done.stderr
    finally:
        clean_up(root, [])


def test_sim_path_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailable, match="is a directory, not a file") as refused:
        SimBackend(str(tmp_path))
    assert refused.value.lasting  # nothing a moment changes: not retried for minutes


def test_file_gone_bad_after_open(sim_file: SimFileFactory) -> None:
    path = sim_file(gpus=1)
    backend = SimBackend(str(path))
    path.write_text("[[gpu]]\nmemory = 'lots'\n")
    with pytest.raises(BackendUnavailable, match="memory 'lots' is not a size"):
        backend.snapshot()


def test_empty_machine_is_valid(sim_file: SimFileFactory) -> None:
    path = sim_file(gpus=0)
    assert SimBackend(str(path)).snapshot().gpus == ()


def test_a_job_with_a_relative_sim_in_the_environment_is_refused(sim_file: SimFileFactory) -> None:
    # Started beside sim.toml it used that one, elsewhere another file (or none) than its
    # gpuwait's: refused as gpuwait refuses it, whichever directory it runs in.
    path = sim_file(gpus=1)
    job = start_sim_job("--vram", "1G", env={"GPUWAIT_SIM": path.name}, cwd=path.parent)
    rc, out, err = finish(job)
    assert (rc, out) == (2, ""), err
    assert err == (
        f"gpuwait sim job: GPUWAIT_SIM {path.name!r} is relative; give an absolute path such "
        f"as {path}\n"
    )


def test_job_with_bad_or_missing_sim(tmp_path: Path) -> None:
    rc, out, err = finish(start_sim_job("--vram", "1G"))
    assert (rc, out) == (2, "")
    assert err == "gpuwait sim job: no simulation file; pass --sim FILE or set GPUWAIT_SIM\n"
    bad = tmp_path / "bad.toml"
    bad.write_text("[[gpu]]\n")
    # A file this fresh may be one caught half-saved: the job reads it again for a while
    # (simjob.LOAD_PATIENCE, 5 s) before it gives up. The same give-up, after half a second.
    impatient = "from gpuwait.gpu import simjob; "
    impatient += "assert simjob.LOAD_PATIENCE > 0.5; simjob.LOAD_PATIENCE = 0.5; "
    impatient += "sys.exit(simjob.main(sys.argv[1:]))"
    argv = [sys.executable, "-c", f"import sys; {impatient}", "--vram", "1G", "--sim", str(bad)]
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rc, out, err = finish(job)
    assert rc == 2 and err.startswith(f"gpuwait sim job: simulation file {bad}: gpu 0: ")
    assert len(err.splitlines()) == 1


def test_job_rejects_bad_size(sim_file: SimFileFactory) -> None:
    sim_file(gpus=1)
    rc, _, err = finish(start_sim_job("--vram", "lots"))
    assert rc == 2 and "gpuwait sim job: error: argument --vram: 'lots' is not a size" in err


# --- signals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_job_dies_by_signal_and_frees_memory(
    sim_file: SimFileFactory, tmp_path: Path, signum: signal.Signals
) -> None:
    path = sim_file(gpus=1)
    out = tmp_path / "report.json"
    job = start_sim_job("--vram", "4G", "--ramp", "0.2s", "--hold", "30s", "--report", str(out))
    try:
        wait_for(lambda: gpu_used(path, 0) == 4 * GiB, timeout=15)
        job.send_signal(signum)
        rc, stdout, err = finish(job, timeout=10)
    finally:
        if job.poll() is None:
            job.kill()
    assert (rc, stdout, err) == (-signum, "", "")
    assert snapshot(path) == {0: (0, {})}
    assert not (state_dir_for(path) / f"{job.pid}.json").exists()
    assert report(out)["peak_bytes"] == 4 * GiB


#: Runs the rest of its arguments with hangups ignored, as `nohup` does.
HANGUPS_IGNORED = (
    "import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def test_a_job_started_with_hangups_ignored_is_not_ended_by_one(sim_file: SimFileFactory) -> None:
    # `nohup gpuwait ... -- gpuwait sim job ...`, then the terminal closed: a real program
    # that does not handle SIGHUP runs on, the simulated job died of the hangup.
    path = sim_file(gpus=1)
    argv = [sys.executable, "-c", HANGUPS_IGNORED, *SIMJOB, "--vram", "1G", "--hold", "1s"]
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: gpu_used(path, 0) == GiB, timeout=15)
        job.send_signal(signal.SIGHUP)
        assert finish(job, timeout=10) == (0, "", "")
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_signal_during_ramp(sim_file: SimFileFactory) -> None:
    path = sim_file(gpus=1)
    job = start_sim_job("--vram", "8G", "--ramp", "5s")
    wait_for(lambda: gpu_used(path, 0), timeout=15)
    job.terminate()
    assert finish(job)[0] == -signal.SIGTERM
    assert gpu_used(path, 0) == 0


def test_state_dir_is_private(sim_file: SimFileFactory) -> None:
    path = sim_file(gpus=1)
    assert finish(start_sim_job("--vram", "1M", "--hold", "0"))[0] == 0
    assert state_dir_for(path).stat().st_mode & 0o777 == 0o700


# --- writing sim files -------------------------------------------------------------------------


def test_write_sim_file(tmp_path: Path) -> None:
    path = tmp_path / "sim.toml"
    write_sim_file(path, gpus=3, memory_bytes=24 * GiB, name='Sim "H100"', speeds=[1, 2, 1.5])
    text = path.read_text()
    assert text.startswith("#") and 'memory = "24GiB"' in text
    config = load_sim_file(path)
    assert [g.total_bytes for g in config.gpus] == [24 * GiB] * 3
    assert [g.speed for g in config.gpus] == [1.0, 2.0, 1.5]
    assert {g.name for g in config.gpus} == {'Sim "H100"'}
    with pytest.raises(UsageError, match="already exists"):
        write_sim_file(path, gpus=1, memory_bytes=GiB)
    write_sim_file(path, gpus=1, memory_bytes=GiB + 1, force=True)
    assert [g.total_bytes for g in load_sim_file(path).gpus] == [GiB + 1]
    write_sim_file(path, gpus=0, memory_bytes=GiB, force=True)
    assert load_sim_file(path).gpus == ()


def test_uuids_are_stable_and_distinct(tmp_path: Path) -> None:
    one, two = tmp_path / "one.toml", tmp_path / "two.toml"
    write_sim_file(one, gpus=2, memory_bytes=GiB)
    write_sim_file(two, gpus=2, memory_bytes=GiB)
    uuids = [g.uuid for g in load_sim_file(one).gpus]
    assert uuids == [g.uuid for g in load_sim_file(one).gpus]
    assert len(set(uuids + [g.uuid for g in load_sim_file(two).gpus])) == 4
    assert all(
        len(u) == 40 and [len(p) for p in u[4:].split("-")] == [8, 4, 4, 4, 12] for u in uuids
    )


def test_sim_module_has_no_stdout_noise() -> None:
    # The job is a program of its own; importing it must not print or need a GPU library.
    code = "import gpuwait.gpu.simjob, sys; print(sorted(m for m in sys.modules if 'pynvml' in m))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout == "[]\n"


# --- the file edited while jobs run ------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ({"base_used": "24GiB"}, "torch.OutOfMemoryError: CUDA out of memory."),
        ({"memory": "1MiB"}, "torch.OutOfMemoryError: CUDA out of memory."),
        ({"lost": True}, "CUDA error: unspecified launch failure"),
    ],
)
def test_a_growing_job_meets_the_card_as_the_file_now_describes_it(
    sim_file: SimFileFactory, edit: dict[str, object], said: str
) -> None:
    """The file is read again at every reading, so what gpuwait shows is the card as edited:
    a job still growing there gets what such a card gives (no room, or a failed card), never
    more memory than the card now has."""
    path = sim_file(gpus=1, memory="24GiB")
    job = start_sim_job("--vram", "20G", "--ramp", "60s", "--hold", "0")
    try:
        wait_for(lambda: gpu_used(path, 0) > 0 or job.poll() is not None, timeout=15)
        sim_file(gpus=1, **{"memory": "24GiB", **edit})
        rc, out, err = finish(job, timeout=10)
    finally:
        job.kill()
        job.communicate()
    assert (rc, out) == (1, ""), err
    assert err.startswith(said), err
    assert os.listdir(state_dir_for(path)) == ["lock"]


@pytest.mark.parametrize(
    ("framework", "said"),
    [
        ("torch", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.00 GiB. "),
        (
            "jax",
            "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while "
            f"trying to allocate {6 * GiB} bytes.\n",
        ),
        ("cuda", "CUDA error: out of memory\n"),
    ],
)
def test_a_full_card_fails_a_job_with_its_frameworks_error(
    sim_file: SimFileFactory, framework: str, said: str
) -> None:
    sim_file(gpus=1, memory="24GiB", base_used="20GiB")
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    rc, out, err = finish(
        start_sim_job("--framework", framework, "--vram", "6G", "--hold", "0", env=env)
    )
    assert (rc, out) == (1, ""), err
    assert err.startswith(said), err


def test_memory_the_driver_keeps_is_used_by_no_process(
    sim_file: SimFileFactory, run_gpuwait: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    """As NVML's v2 memory reading splits it out (drivers from R510 on), the driver's own memory
    is part of the card's used memory, room no job gets, but no process's: gpuwait shows it
    apart from `extern`, and a card that holds nothing else is idle for a whole-GPU job."""
    sim_file(gpus=1, memory="8GiB", driver_reserved="1GiB")
    (gpu,) = json.loads(run_gpuwait("status", "--json").stdout)["gpus"]
    assert (gpu["used_bytes"], gpu["driver_bytes"]) == (GiB, GiB)
    assert "the NVIDIA driver keeps 1.0G of the GPU" in run_gpuwait("status").stdout
    done = run_gpuwait("--timeout", "5s", "--", "true")  # no --vram: a whole GPU
    assert done.returncode == 0, done.stderr
    rc, _, err = finish(start_sim_job("--vram", "7.5G", "--hold", "0"))
    assert rc == 1 and "CUDA out of memory" in err, err


# --- data-parallel jobs: one process per GPU ---------------------------------------------------


def test_a_data_parallel_job_holds_its_memory_on_each_of_its_gpus(
    sim_file: SimFileFactory,
) -> None:
    # As torchrun's ranks: one process per GPU, each allocating on its own, all of them the
    # job's (gpuwait finds them in its process tree); a signal to the job ends them all.
    path = sim_file(gpus=2)
    job = start_sim_job("--gpus", "2", "--vram", "4G", "--hold", "30s")
    try:
        wait_for(lambda: gpu_used(path, 0) == gpu_used(path, 1) == 4 * GiB, timeout=15)
        ranks = [set(snapshot(path)[i][1]) for i in (0, 1)]
        assert all(len(pids) == 1 for pids in ranks) and ranks[0] != ranks[1]
        assert all(proc.parent_pid(pid) == job.pid for pids in ranks for pid in pids)
        job.terminate()
        assert finish(job) == (-signal.SIGTERM, "", "")
    finally:
        if job.poll() is None:
            job.kill()
    assert snapshot(path) == {0: (0, {}), 1: (0, {})}


def test_a_data_parallel_job_runs_out_of_memory_on_any_of_its_gpus(
    sim_file: SimFileFactory,
) -> None:
    # Over-admission on its second card shows up as an out-of-memory failure of the job, as it
    # would for a real gang, and its other rank is ended with it.
    path = sim_file(gpus=2)
    other = start_sim_job("--vram", "16G", "--hold", "30s", env={"CUDA_VISIBLE_DEVICES": "1"})
    try:
        wait_for(lambda: gpu_used(path, 1) == 16 * GiB, timeout=15)
        rc, out, err = finish(start_sim_job("--gpus", "2", "--vram", "16G", "--hold", "30s"))
    finally:
        other.kill()
        other.wait()
    assert (rc, out) == (1, "")
    (line,) = err.splitlines()
    assert line.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ")
    assert gpu_used(path, 0) == 0


def test_a_data_parallel_job_on_fewer_gpus_than_it_needs_fails_as_cuda_does(
    sim_file: SimFileFactory,
) -> None:
    sim_file(gpus=2)
    job = start_sim_job("--gpus", "2", "--vram", "1G", env={"CUDA_VISIBLE_DEVICES": "0"})
    assert finish(job) == (1, "", "CUDA error: invalid device ordinal\n")
