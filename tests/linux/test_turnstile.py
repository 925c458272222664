"""The start-up turnstile (gpuwait.linux.turnstile), on real launches.

A burst of launches loads a few at a time: each waits, asleep, for a turn, and gives it back
as soon as its command starts or it waits in the queue. A turn held too long (a stopped or hung
launch; here this test holds every slot) costs a launch WAIT_LIMIT at most. Subcommands never
wait for a turn: one of them may be the very command a launch starts.

Whether a process waits for a turn is read from /proc/locks, where the kernel lists every
process blocked on a record lock ("->"), so no assertion here rests on how fast this machine is.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_sim import wrapped_sim_job
from helpers.waiting import asleep_supervising, asleep_waiting, sleeping_in, wait_for

from gpuwait.cli import launches
from gpuwait.linux import cgroup
from gpuwait.linux.turnstile import FILE_NAME, WAIT_LIMIT, directories, slots

pytestmark = pytest.mark.usefixtures("sim")

Procs = Callable[..., "subprocess.Popen[Any]"]


def turnstile_file(base: str = "XDG_RUNTIME_DIR") -> Path:
    """The turnstile's file: in the runtime dir, which each test has (conftest), or in the
    state dir (`base="XDG_STATE_HOME"`), where it is without one."""
    directory = Path(os.environ[base]) / "gpuwait"
    directory.mkdir(mode=0o700, exist_ok=True)
    return directory / FILE_NAME


def _lock_whole(path: Path) -> int | None:
    """A descriptor of `path` with the whole file (every slot) locked by this process, or None
    when another process holds some of it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


@contextmanager
def every_slot_held(path: Path | None = None) -> Iterator[None]:
    """This test process holds the whole file (every slot), as a stuck launch would hold one."""
    fd = _lock_whole(path or turnstile_file())
    assert fd is not None, "a slot was held before the test held them all"
    try:
        yield
    finally:
        os.close(fd)


def nobody_holds_a_slot() -> bool:
    fd = _lock_whole(turnstile_file())
    if fd is None:
        return False
    os.close(fd)
    return True


def waiters(path: Path) -> set[int]:
    """Pids blocked on a record lock of `path`, as /proc/locks lists them."""
    st = os.stat(path)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    found = set()
    with open("/proc/locks") as locks:
        for line in locks:
            # "3: -> POSIX  ADVISORY  WRITE 1234 fd:01:5678 0 0": a process waiting for a lock.
            fields = line.split()
            if len(fields) > 6 and fields[1] == "->" and fields[6] == device:
                found.add(int(fields[5]))
    return found


def run_watching(argv: list[str], path: Path) -> tuple[subprocess.CompletedProcess[str], bool]:
    """Run `argv` to its end; also whether it ever waited for a lock of `path` meanwhile."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    waited = False
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            waited = waited or proc.pid in waiters(path)
            time.sleep(0.005)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), waited


def test_what_takes_a_turn() -> None:
    assert launches(["python", "train.py"])
    assert launches(["--vram", "6G", "--", "python", "train.py"])
    assert launches(["shell-hook", "--", "python", "train.py"])  # it usually launches
    # The other subcommands never queue; `sim job` is what launches start in tests and demos.
    assert not launches(["sim", "job", "--vram", "1G"])
    assert not launches(["status", "--watch"])
    assert not launches([])


def test_a_launch_waits_for_its_turn_and_a_stuck_turn_costs_it_the_limit_at_most(
    gpuwait_cmd: list[str],
) -> None:
    path = turnstile_file()
    with every_slot_held(path):
        started = time.monotonic()
        done, waited = run_watching([*gpuwait_cmd, "--vram", "1G", "--", "true"], path)
        took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert waited, "the launch did not wait for a turn while every slot was held"
    assert took >= WAIT_LIMIT  # it went on only once its wait for a turn ran out
    assert done.stderr == ""  # a slow turn is not worth a word


def test_the_turnstile_is_in_the_runtime_dir_else_in_the_state_dir(tmp_path: Path) -> None:
    state = "/home/u/.local/state/gpuwait"
    runtime = tmp_path / "run-user-1000"
    runtime.mkdir()
    assert directories({"XDG_RUNTIME_DIR": str(runtime)}, state) == [
        runtime / "gpuwait",
        Path(state),
    ]
    # Unset, relative (ignored, as the XDG rules say) or missing: the state dir alone.
    assert directories({}, state) == [Path(state)]
    assert directories({"XDG_RUNTIME_DIR": "run/user/1000"}, state) == [Path(state)]
    assert directories({"XDG_RUNTIME_DIR": str(tmp_path / "gone")}, state) == [Path(state)]


@pytest.mark.parametrize("runtime", ["unset", "a file"])
def test_without_a_usable_runtime_dir_the_turns_are_in_the_state_dir(
    gpuwait_cmd: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime: str
) -> None:
    if runtime == "unset":
        monkeypatch.delenv("XDG_RUNTIME_DIR")
    else:
        (tmp_path / "not-a-dir").touch()
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "not-a-dir"))
    path = turnstile_file("XDG_STATE_HOME")
    with every_slot_held(path):
        done, waited = run_watching([*gpuwait_cmd, "--vram", "1G", "--", "true"], path)
    assert done.returncode == 0, done.stderr
    assert waited


def test_subcommands_never_wait_for_a_turn(gpuwait_cmd: list[str]) -> None:
    path = turnstile_file()
    with every_slot_held(path):
        for args in (["sim", "job", "--vram", "1G", "--hold", "0.5s"], ["status"]):
            done, waited = run_watching([*gpuwait_cmd, *args], path)
            assert done.returncode == 0, done.stderr
            assert not waited, args


def test_a_running_command_holds_no_turn(gpuwait_cmd: list[str], procs: Procs) -> None:
    # stderr is a pipe, so gpuwait forks its stderr relay too: neither may keep a slot.
    job = procs([*gpuwait_cmd, "--vram", "1G", "--", "sleep", "60"])
    wait_for(lambda: asleep_supervising(job.pid), timeout=60)
    assert nobody_holds_a_slot()


def test_a_waiting_launch_holds_no_turn(
    gpuwait_cmd: list[str], procs: Procs, sim_file: Callable[..., Path]
) -> None:
    sim_file(gpus=1, memory="24GiB")
    holder = procs(
        wrapped_sim_job(gpuwait_cmd, ["--vram", "20G"], "--vram", "20G", "--hold", "60s")
    )
    wait_for(lambda: asleep_supervising(holder.pid), timeout=60)
    waiter = procs(wrapped_sim_job(gpuwait_cmd, ["--vram", "10G"], "--vram", "10G"))
    wait_for(lambda: asleep_waiting(waiter.pid), timeout=60)
    assert nobody_holds_a_slot()


def test_a_launch_retrying_failing_gpu_readings_holds_no_turn(
    gpuwait_cmd: list[str], procs: Procs, sim_file: Callable[..., Path], tmp_path: Path
) -> None:
    sim = sim_file(gpus=1, memory="24GiB")
    sim.write_text("[[gpu]\n")  # damaged, as when caught half-saved: a failure that may pass
    ran = tmp_path / "ran"
    launch = procs([*gpuwait_cmd, "--vram", "1G", "--", "touch", str(ran)])
    # Asleep between two tries (a launch sleeps in nanosleep only there; it waits in the queue
    # in sigtimedwait).
    wait_for(lambda: sleeping_in(launch.pid, "nanosleep"), timeout=30)
    assert nobody_holds_a_slot()
    assert not ran.exists()


def test_ctrl_c_while_waiting_for_a_turn_ends_the_launch_quietly(
    gpuwait_cmd: list[str], procs: Procs
) -> None:
    path = turnstile_file()
    with every_slot_held(path):
        # In a session of its own (as procs starts it), like a foreground job's Ctrl-C.
        launch = procs([*gpuwait_cmd, "--vram", "1G", "--", "true"])
        wait_for(lambda: launch.pid in waiters(path), timeout=30)
        launch.send_signal(signal.SIGINT)
        _, err = launch.communicate(timeout=30)
    # Ended by the signal (a shell shows 130 and stops its script), as while waiting for room.
    assert launch.returncode == -signal.SIGINT
    assert err == ""


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_a_turnstile_file_that_is_not_a_plain_file_of_ours_is_passed_by(
    gpuwait_cmd: list[str], tmp_path: Path, kind: str
) -> None:
    path = turnstile_file()
    elsewhere = tmp_path / "elsewhere.lock"
    elsewhere.touch()
    if kind == "symlink":
        path.symlink_to(elsewhere)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    with every_slot_held(elsewhere):
        done, waited = run_watching([*gpuwait_cmd, "--vram", "1G", "--", "true"], elsewhere)
    assert done.returncode == 0, done.stderr
    assert not waited  # the link was not followed
    assert done.stderr == ""


def test_a_cpu_quota_found_at_or_above_the_processs_cgroup_bounds_the_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A container run with --cpus 1.5 (a Kubernetes pod's CPU limit) on a machine of 64 cores:
    # its affinity names every core, so 64 launches of a burst loaded at once on 1.5 CPUs' time,
    # as if there were no turnstile.
    own = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    (v2 / "pod" / "job").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu\n")
    (v2 / "pod" / "cpu.max").write_text("150000 100000\n")
    (v2 / "pod" / "job" / "cpu.max").write_text("max 100000\n")
    own.write_text("0::/pod/job\n")
    assert cgroup.cpu_limit([str(v2)], [], str(own)) == 1.5
    # cgroup v1 (beside a v2 hierarchy without the cpu controller): the quota of the cpu one.
    v1 = tmp_path / "cpu"
    (v1 / "docker" / "c0").mkdir(parents=True)
    for directory, quota in ((v1, "-1"), (v1 / "docker", "-1"), (v1 / "docker" / "c0", "150000")):
        (directory / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        (directory / "cpu.cfs_period_us").write_text("100000\n")
    (v2 / "pod" / "cpu.max").write_text("max 100000\n")
    own.write_text("4:cpu,cpuacct:/docker/c0\n0::/pod/job\n")
    assert cgroup.cpu_limit([str(v2)], [str(v1)], str(own)) == 1.5
    own.write_text("4:cpu,cpuacct:/\n0::/\n")
    assert cgroup.cpu_limit([str(v2)], [str(v1)], str(own)) is None

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    for limit, turns in ((None, 64), (1.5, 2), (0.1, 1)):
        monkeypatch.setattr(cgroup, "cpu_limit", lambda limit=limit: limit)
        assert slots() == turns
