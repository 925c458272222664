"""How a running command's VRAM is sampled (what the history's peak can see), and how its
sampler keeps the job's entry in the ledger."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.jobs import TRUNCATED_LEDGER, live_job, replace_ledger

from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot, ProcessUsage
from gpuwait.linux import proc
from gpuwait.queue import lifecycle
from gpuwait.queue.ledger import Ledger
from gpuwait.runner.launch import spawn
from gpuwait.runner.supervise import UsageSampler, supervise

GiB = 2**30
UUID = "GPU-00000000-0000-0000-0000-000000000001"


class PeakInWindow:
    """One GPU on which `pid` holds 1 GiB only between `window` seconds after `reset`."""

    name = "fake"

    def __init__(self, pid: int, window: tuple[float, float]) -> None:
        self.pid, self.window = pid, window
        self.reset()

    def reset(self) -> None:
        self.started = time.monotonic()

    def snapshot(self) -> MachineSnapshot:
        elapsed = time.monotonic() - self.started
        used = GiB if self.window[0] <= elapsed < self.window[1] else 0
        processes = (ProcessUsage(self.pid, used),) if used else ()
        gpu = GpuSnapshot(0, UUID, "Fake GPU", 8 * GiB, used, processes)
        return MachineSnapshot("fake", (gpu,))

    def close(self) -> None:
        pass


def test_a_peak_late_in_the_first_second_is_seen(tmp_path: Path) -> None:
    # A short job whose allocation lives from 0.8 s to 1.2 s after its start (default
    # sample_interval 1 s): the first second is sampled densely, so its peak is recorded.
    child = spawn(["sleep", "1.5"], os.environ)
    backend = PeakInWindow(child, (0.8, 1.2))
    job = live_job("sampled", gpu_uuids=[UUID], state="running")
    backend.reset()
    result = supervise(child, job, Ledger(tmp_path), backend, sample_interval=1.0)
    assert result.returncode == 0
    assert result.peak_bytes.get(UUID) == GiB
    assert result.attributed == {UUID}


class DamagedRightAfterALook(Ledger):
    """A ledger that another process replaces with a damaged one just after this one has taken
    its fingerprint (`change_token`), once `armed`: the worst moment for the sampler."""

    armed = False

    def change_token(self) -> tuple[object, ...] | None:
        token = super().change_token()
        if self.armed:
            self.armed = False
            replace_ledger(self.path, TRUNCATED_LEDGER)
        return token


@pytest.fixture
def running() -> Iterator[Callable[[Ledger], UsageSampler]]:
    """Sets up a running job's entry in a ledger and the sampler of its command (a sleep,
    reaped afterwards), which holds nothing on the GPU."""
    children: list[int] = []

    def start(ledger: Ledger) -> UsageSampler:
        child = spawn(["sleep", "30"], os.environ)
        children.append(child)
        job = live_job("held", gpu_uuids=[UUID], state="running")
        with ledger.transaction() as data:
            data.jobs.append(job)
        return UsageSampler(child, job, ledger, PeakInWindow(child, (0.0, 0.0)), 0.2)

    yield start
    for child in children:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def failing_once(real: Callable[..., Any], error: OSError) -> tuple[Callable[..., Any], list[int]]:
    """`real`, but raising `error` at its first call; the list counts those failed calls."""
    failed: list[int] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(1)
            raise error
        return real(*args, **kwargs)

    return wrapper, failed


def entry_after_two_samples(sampler: UsageSampler, directory: Path) -> tuple[bool, bool]:
    """Is the running job's entry in the ledger after one sample, and after the next?"""
    seen = []
    now = time.monotonic()
    for later in (0.0, 1.0):
        sampler.sample_if_due(now + later)
        seen.append(Ledger(directory).read().find("held") is not None)
    return seen[0], seen[1]


def test_a_ledger_replaced_between_two_samples_gets_the_running_jobs_entry_back(
    tmp_path: Path, running: Callable[[Ledger], UsageSampler]
) -> None:
    # The running job's entry is its reservation: whenever its ledger is replaced without it
    # (a damaged one recovered), the job's gpuwait puts it back at its next sample, even when
    # the replacement lands right after the sampler last looked.
    ledger = DamagedRightAfterALook(tmp_path)
    sampler = running(ledger)
    ledger.armed = True
    # Replaced without it at the first sample, put back at the next.
    assert entry_after_two_samples(sampler, tmp_path) == (False, True)
    assert list(tmp_path.glob("ledger.json.damaged-*"))  # the evidence kept


@pytest.mark.parametrize(
    ("owner", "name", "error"),
    [
        # The entry's put-back is refused (a full disk for a moment).
        (lifecycle, "publish_usage", OSError(errno.ENOSPC, "No space left on device")),
        # The look at the replaced ledger fails: whether the entry is there cannot be told.
        (Ledger, "read", OSError(errno.EMFILE, "Too many open files")),
    ],
    ids=["write", "read"],
)
def test_a_ledger_replaced_while_the_state_dir_fails_once_is_looked_at_again(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    running: Callable[[Ledger], UsageSampler],
    owner: object,
    name: str,
    error: OSError,
) -> None:
    # The ledger is replaced without the running job's entry, and the sampler's first attempt
    # to see to it fails: the next sample tries again instead of taking the change as handled.
    ledger = Ledger(tmp_path)
    sampler = running(ledger)
    replace_ledger(ledger.path, b"")
    failing, failed = failing_once(getattr(owner, name), error)
    monkeypatch.setattr(owner, name, failing)
    assert entry_after_two_samples(sampler, tmp_path) == (False, True)
    assert failed


class OnTheCard:
    """One GPU on which each of `holders` (pid -> bytes) holds its memory, as NVML lists it."""

    name = "fake"

    def __init__(self, holders: dict[int, int]) -> None:
        self.holders = holders

    def snapshot(self) -> MachineSnapshot:
        processes = tuple(ProcessUsage(pid, used) for pid, used in self.holders.items())
        used = sum(self.holders.values())
        gpu = GpuSnapshot(0, UUID, "Fake GPU", 24 * GiB, used, processes)
        return MachineSnapshot("fake", (gpu,))

    def close(self) -> None:
        pass


def test_a_process_the_command_left_to_run_on_its_own_counts_for_its_peak(
    tmp_path: Path,
) -> None:
    # The command holds 1 GiB itself and starts a server that detaches from it (a double fork,
    # as daemons do: the server's parent becomes init). The server's 6 GiB were the command's
    # too: a peak of 1 GiB would size its next run without --vram at 1.1 GiB, and the 6 GiB it
    # then takes would come out of its neighbours' room. A process of someone else's on the
    # card still counts for nobody's peak but its own.
    pid_file = tmp_path / "server.pid"
    job = live_job("detaching", gpu_uuids=[UUID], state="running")
    script = f"(sleep 30 & echo $! > {pid_file}); sleep 30"
    child = spawn(["sh", "-c", script], {**os.environ, "GPUWAIT_JOB_ID": job.id})
    stranger = spawn(["sleep", "30"], os.environ)
    server = None
    try:
        deadline = time.monotonic() + 5
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server = int(pid_file.read_text())
        # Sampled once, so only once the server is as the test says: detached (the subshell
        # that started it gone) and carrying the job id (its exec done: in between, on a busy
        # machine, its environment reads empty). A later sample of a run would catch it anyway.
        while not (
            proc.parent_pid(server) not in proc.process_tree([child])
            and proc.environ_value(server, b"GPUWAIT_JOB_ID") == job.id
        ):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        backend = OnTheCard({child: GiB, server: 6 * GiB, stranger: 2 * GiB})
        sampler = UsageSampler(child, job, Ledger(tmp_path), backend, 0.2)
        sampler.sample_if_due(time.monotonic())
        assert sampler.result.peak_bytes == {UUID: 7 * GiB}
    finally:
        for pid in (child, stranger):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        if server is not None:
            os.kill(server, signal.SIGKILL)  # init reaps it


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a process as another user")
def test_another_users_process_that_says_it_is_the_job_counts_for_nobodys_peak(
    tmp_path: Path,
) -> None:
    # A job of root's holds 1 GiB; another user's program, started without gpuwait, takes
    # 8 GiB on the same card with the job's id (shown by `gpuwait status`) in its environment.
    # Root's gpuwait reads every process's environment, and took the program for a server the
    # job had left running: its 8 GiB went into the job's peak, and the job's entry named it
    # among the job's processes, whose memory the queue counts inside the job's reservation;
    # the queue then saw 8 GiB less outside gpuwait than the card held, and admitted a waiter
    # into memory that was taken.
    job = live_job("rooted", gpu_uuids=[UUID], state="running", reserved_bytes=10 * GiB)
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.jobs.append(job)
    child = spawn(["sleep", "30"], {**os.environ, "GPUWAIT_JOB_ID": job.id})
    stranger = subprocess.Popen(
        ["sleep", "30"], env={"GPUWAIT_JOB_ID": job.id}, user=2002, group=2002, extra_groups=[]
    )
    try:
        deadline = time.monotonic() + 5
        while proc.environ_value(stranger.pid, b"GPUWAIT_JOB_ID") != job.id:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        backend = OnTheCard({child: GiB, stranger.pid: 8 * GiB})
        sampler = UsageSampler(child, job, ledger, backend, 0.2)
        sampler.sample_if_due(time.monotonic())
        assert sampler.result.peak_bytes == {UUID: GiB}
        # Other gpuwaits count the processes the entry names as the job's.
        entry = Ledger(tmp_path).read().find(job.id)
        assert entry is not None and stranger.pid not in entry.pids
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        stranger.kill()
        stranger.wait()


UUID_2 = "GPU-00000000-0000-0000-0000-000000000002"


class NoProcessFigures:
    """Two GPUs whose used memory is `used` (per UUID), listing no processes (a container)."""

    name = "fake"

    def __init__(self, used: dict[str, int]) -> None:
        self.used = used

    def snapshot(self) -> MachineSnapshot:
        gpus = tuple(
            GpuSnapshot(i, uuid, "Fake GPU", 24 * GiB, used, (), per_process=False)
            for i, (uuid, used) in enumerate(self.used.items())
        )
        return MachineSnapshot("fake", gpus)

    def close(self) -> None:
        pass


def test_a_job_on_two_gpus_whose_peak_is_unknown_on_one_has_no_peak(tmp_path: Path) -> None:
    # No per-process figures (a container): the growth of each card stands in, but another job
    # ran on the second card, so the 9 GiB grown there are not known to be this job's. The 3
    # GiB of the first card are no peak of the job: its next run would reserve 3.4 GiB a card.
    ledger = Ledger(tmp_path)
    neighbour = live_job("neighbour", gpu_uuids=[UUID_2], state="running")
    with ledger.transaction() as data:
        data.jobs.append(neighbour)
    job = live_job("gang", gpu_uuids=[UUID, UUID_2], state="running")
    child = spawn(["sleep", "30"], os.environ)
    try:
        backend = NoProcessFigures({UUID: 3 * GiB, UUID_2: 13 * GiB})
        sampler = UsageSampler(
            child, job, ledger, backend, 0.2, baseline_used={UUID: 0, UUID_2: 4 * GiB}
        )
        sampler.sample_if_due(time.monotonic())
        assert sampler.result.peaks() == ({}, False)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


@pytest.mark.parametrize("failing", ["read", "lock_wait"])
def test_a_lost_entry_not_put_back_for_want_of_file_descriptors_is_put_back_at_the_next_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    # A running job's entry lost with its ledger, replaced meanwhile: the look between two
    # samples that finds the ledger changed could not read it, or not write the entry back,
    # for want of file descriptors. The next look puts the entry back, though the ledger has
    # not changed again: its room is not left to others until something else writes it.
    job = live_job("held", gpu_uuids=[UUID], state="running", reserved_bytes=10 * GiB)
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.jobs.append(job)
    sampler = UsageSampler(os.getpid(), job, ledger, OnTheCard({}), 0.2)
    ledger.path.unlink()
    with ledger.transaction():
        pass  # started afresh, without the entry
    real = getattr(ledger, failing)

    def short_of_descriptors(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(ledger, failing, short_of_descriptors)
    sampler.look_if_changed()
    monkeypatch.setattr(ledger, failing, real)
    assert Ledger(tmp_path).read().find(job.id) is None
    sampler.look_if_changed()
    assert Ledger(tmp_path).read().find(job.id) is not None
