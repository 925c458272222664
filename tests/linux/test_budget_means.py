"""What a machine offers to hold a budget: a CUDA MPS daemon serving this user, and the cgroup
dmem controller (on a stand-in cgroup tree: no kernel here has dmem)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.users import clean_up, run_as, shared_root, user_home

from gpuwait.linux import dmem, mps, pidns, proc
from gpuwait.runner.budget import Held

GiB = 2**30


# --- MPS --------------------------------------------------------------------------------------


def test_a_live_daemon_serves(mps_daemon: Path) -> None:
    pid = int((mps_daemon / "nvidia-cuda-mps-control.pid").read_text())
    seen = (proc.command_name(pid), proc.owner_uid(pid), (mps_daemon / "control").stat())
    assert mps.daemon_serves({"CUDA_MPS_PIPE_DIRECTORY": str(mps_daemon)}), seen


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as two users")
def test_another_users_daemon_serves_nobody_else() -> None:
    # The pipe directory is /tmp/nvidia-mps by default, which any user may make. Bob made it,
    # with a control pipe everyone may write to and a pid file naming a program of his called
    # nvidia-cuda-mps-control: Alice's `--enforce limit` job took its budget for held by MPS,
    # which no daemon of Bob's holds for her (a daemon not root's runs servers for its own user
    # alone), and went without PyTorch's cap. Her job now gets the cap, as with no daemon.
    alice, bob = 2001, 2002
    root = shared_root()
    try:
        pipes = root / "nvidia-mps"
        pipes.mkdir()
        os.mkfifo(pipes / "control")
        program = root / "nvidia-cuda-mps-control"
        program.write_bytes(Path("/bin/sleep").read_bytes())
        os.chmod(program, 0o755)
        daemon = subprocess.Popen([str(program), "60"], user=bob, group=bob, extra_groups=[])
        try:
            deadline = time.monotonic() + 10
            while proc.command_name(daemon.pid) != "nvidia-cuda-mps":
                assert time.monotonic() < deadline
                time.sleep(0.01)
            (pipes / "nvidia-cuda-mps-control.pid").write_text(f"{daemon.pid}\n")
            for path in (pipes, pipes / "control", pipes / "nvidia-cuda-mps-control.pid"):
                os.chown(path, bob, bob)
            os.chmod(pipes, 0o777)
            os.chmod(pipes / "control", 0o666)
            (root / "sim.toml").write_text('[[gpu]]\nmemory = "24GiB"\n')
            env = {
                **user_home(root, alice, alice),
                "PATH": "/usr/bin:/bin",
                "GPUWAIT_SIM": str(root / "sim.toml"),
                "CUDA_MPS_PIPE_DIRECTORY": str(pipes),
            }
            done = run_as(
                alice, alice, [], ["--enforce", "limit", "--vram", "2G", "--", "env"], env
            )
            assert done.returncode == 0, done.stderr
            given = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
            assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in given
            assert "GPUWAIT_TORCH_MEMORY_FRACTION" in given
        finally:
            daemon.kill()
            daemon.wait()
    finally:
        clean_up(root, [])


def test_no_pipe_directory_no_daemon(tmp_path: Path) -> None:
    assert not mps.daemon_serves({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "none")})


def test_a_daemon_that_is_gone_serves_nobody(mps_daemon: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    (mps_daemon / "nvidia-cuda-mps-control.pid").write_text(f"{gone.pid}\n")
    assert not mps.daemon_serves({"CUDA_MPS_PIPE_DIRECTORY": str(mps_daemon)})


def test_a_pid_of_another_program_is_no_daemon(mps_daemon: Path) -> None:
    (mps_daemon / "nvidia-cuda-mps-control.pid").write_text(f"{os.getpid()}\n")
    assert not mps.daemon_serves({"CUDA_MPS_PIPE_DIRECTORY": str(mps_daemon)})


def test_in_a_container_a_daemon_is_told_by_its_socket(
    mps_daemon: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pid file names the daemon by the host's pid, no process here: the socket tells.
    monkeypatch.setattr(pidns, "in_initial_namespace", lambda: False)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (mps_daemon / "nvidia-cuda-mps-control.pid").write_text(f"{gone.pid}\n")
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(mps_daemon)}
    assert mps.daemon_serves(env)
    # A socket left by a daemon that is gone takes no connection: nobody serves.
    (mps_daemon / "control").unlink()
    left = socket.socket(socket.AF_UNIX)
    left.bind(str(mps_daemon / "control"))
    left.close()
    assert not mps.daemon_serves(env)


def test_a_fifo_for_a_pid_file_is_never_waited_on(mps_daemon: Path) -> None:
    pid_file = mps_daemon / "nvidia-cuda-mps-control.pid"
    pid_file.unlink()
    os.mkfifo(pid_file)
    began = time.monotonic()
    assert not mps.daemon_serves({"CUDA_MPS_PIPE_DIRECTORY": str(mps_daemon)})
    assert time.monotonic() - began < 5


# --- dmem -------------------------------------------------------------------------------------

PCI = "0000:3b:00.0"
UUID = "GPU-11111111-2222-3333-4444-555555555555"


def stand_in_tree(tmp_path: Path, *, dmem_enabled: bool = True) -> dict[str, str]:
    """A cgroup v2 tree with a GPU's dmem region, this process in /work.slice/shell, and the
    NVIDIA driver's /proc file for the GPU; the keyword arguments `dmem.locate` takes."""
    root = tmp_path / "cgroup"
    (root / "work.slice" / "shell").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory dmem\n")
    (root / "dmem.capacity").write_text(f"nvidia/{PCI}/vidmem 85899345920\ndrm/other/vram0 1\n")
    (root / "work.slice" / "cgroup.subtree_control").write_text(
        "memory dmem\n" if dmem_enabled else "memory\n"
    )
    (root / "work.slice" / "cgroup.procs").write_text("")
    (root / "work.slice" / "shell" / "cgroup.procs").write_text("")
    own = tmp_path / "self-cgroup"
    own.write_text("0::/work.slice/shell\n")
    gpus = tmp_path / "nvidia-gpus"
    (gpus / PCI).mkdir(parents=True)
    (gpus / PCI / "information").write_text(f"Model: \t H100\nGPU UUID: \t {UUID}\n")
    return {"roots": (str(root),), "proc_cgroup": str(own), "nvidia_gpus": str(gpus)}


def test_a_gpus_region_and_a_cgroup_for_the_job_are_found(tmp_path: Path) -> None:
    where = stand_in_tree(tmp_path)
    place, why = dmem.locate([UUID], **where)  # type: ignore[arg-type]
    assert why == ""
    assert place is not None
    assert place.parent == str(tmp_path / "cgroup" / "work.slice")
    assert place.regions == {UUID: f"nvidia/{PCI}/vidmem"}


def test_the_jobs_cgroup_gets_its_limit_and_is_removed_after(tmp_path: Path) -> None:
    where = stand_in_tree(tmp_path)
    place, _ = dmem.locate([UUID], **where)  # type: ignore[arg-type]
    assert place is not None
    path = dmem.create(place, "gpuwait-job1", 6 * GiB)
    assert Path(path, "dmem.max").read_text() == f"nvidia/{PCI}/vidmem {6 * GiB}\n"
    dmem.move(path, 4242)
    assert Path(path, "cgroup.procs").read_text() == "4242\n"
    for name in ("dmem.max", "cgroup.procs"):  # the kernel's files go with the cgroup
        Path(path, name).unlink()
    dmem.remove(path)
    assert not Path(path).exists()


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (lambda t: (t / "cgroup" / "dmem.capacity").unlink(), "no cgroup dmem controller"),
        (lambda t: (t / "nvidia-gpus" / PCI / "information").unlink(), "no cgroup dmem region"),
        (
            lambda t: (t / "cgroup" / "work.slice" / "cgroup.subtree_control").write_text("cpu\n"),
            "no cgroup with dmem enabled",
        ),
        (lambda t: (t / "cgroup" / "cgroup.controllers").unlink(), "no cgroup v2"),
    ],
)
def test_each_missing_piece_is_named(tmp_path: Path, spoil: object, why: str) -> None:
    where = stand_in_tree(tmp_path)
    spoil(tmp_path)  # type: ignore[operator]
    place, reason = dmem.locate([UUID], **where)  # type: ignore[arg-type]
    assert place is None
    assert why in reason


def test_this_machine_without_dmem_never_fails_a_launch() -> None:
    place, reason = dmem.locate([UUID])
    if place is not None:
        pytest.skip("this machine has a GPU in the dmem controller")
    assert reason


def located_in_stand_in_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpuwait looks for dmem in the stand-in tree instead of this machine's."""
    where = stand_in_tree(tmp_path)
    real_locate = dmem.locate
    monkeypatch.setattr(dmem, "locate", lambda uuids: real_locate(uuids, **where))  # type: ignore[arg-type]


def prepared(command: list[str]) -> Held:
    """The budget of a job reserving 6 GiB of the stand-in tree's 80 GiB GPU under limit."""
    from helpers.jobs import live_job

    from gpuwait.core.budget import LIMIT
    from gpuwait.core.snapshot import GpuSnapshot
    from gpuwait.runner import budget as runner_budget

    job = live_job("job1", request={"bytes": 6 * GiB}, reserved_bytes=6 * GiB, gpu_uuids=[UUID])
    gpu = GpuSnapshot(index=0, uuid=UUID, name="H100", total_bytes=80 * GiB, used_bytes=0)
    return runner_budget.prepare(LIMIT, job, [gpu], command, {})


def test_a_job_whose_cgroup_cannot_be_made_is_held_another_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    from gpuwait.core.budget import HELD_TORCH

    located_in_stand_in_tree(tmp_path, monkeypatch)
    Path(tmp_path, "cgroup", "work.slice", "gpuwait-job1").write_text("")  # in the way: mkdir fails
    held = prepared([sys.executable, "train.py"])
    assert held.cgroup is None
    assert held.plan.held_by == (HELD_TORCH,)
    assert held.problem is not None and "dmem cgroup" in held.problem
    with held.spawning():
        pass


def test_the_cgroups_of_jobs_whose_gpuwait_was_killed_go_with_the_next_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A gpuwait killed (SIGKILL, the OOM killer) never removes its job's cgroup: once the
    # command has ended, it stays empty. The next job's gpuwait takes such cgroups away, so
    # that they do not pile up across crashes; never one that holds processes, nor one made a
    # moment ago (another launch's, which it is about to step into).
    located_in_stand_in_tree(tmp_path, monkeypatch)
    parent = tmp_path / "cgroup" / "work.slice"
    left, fresh, busy = (parent / f"gpuwait-{n}" for n in ("dead01", "f7e5a1", "b05e01"))
    for cgroup in (left, fresh, busy):
        cgroup.mkdir()
    (busy / "cgroup.procs").write_text("4242\n")  # the stand-in's way of being in use
    old = time.time() - 3600
    for cgroup in (left, busy):
        os.utime(cgroup, (old, old))
    held = prepared(["./a.out"])
    assert held.cgroup == str(parent / "gpuwait-job1")
    assert not left.exists()
    assert fresh.is_dir() and busy.is_dir()


def test_a_jobs_cgroup_is_made_and_entered_around_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    from gpuwait.core.budget import HELD_DMEM

    located_in_stand_in_tree(tmp_path, monkeypatch)
    held = prepared(["./a.out"])
    assert held.plan.held_by == (HELD_DMEM,)
    assert held.cgroup == str(tmp_path / "cgroup" / "work.slice" / "gpuwait-job1")
    assert Path(held.cgroup, "dmem.max").read_text() == f"nvidia/{PCI}/vidmem {6 * GiB}\n"
    with held.spawning():
        # gpuwait stands in the job's cgroup while the command is born.
        assert Path(held.cgroup, "cgroup.procs").read_text() == f"{os.getpid()}\n"
    # ... and steps back into its own once it has.
    home = tmp_path / "cgroup" / "work.slice" / "shell" / "cgroup.procs"
    assert home.read_text() == f"{os.getpid()}\n"
    held.close()
