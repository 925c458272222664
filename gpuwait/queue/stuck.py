"""Running jobs a waiter could wait behind for ever: those that end only after it does.

Two kinds, both this user's own:
- the gpuwait job whose command started this process, or is this process (`GPUWAIT_JOB_ID`, and
  that job's command among this process and its ancestors): it ends only once what it started
  has ended;
- a job of this process's own pipeline (its process group) joined to it by pipes, directly or
  through other stages (`python gen.py | tee log | python filter.py`): upstream of it, it
  waits for this one to read its output, as a writer blocks once a pipe is full; downstream,
  it waits for this one's output. Jobs that only write to the same pipe (the recipes of
  `make -j | tee log`) are not joined: neither waits for the other.
Where the waiter can never start beside them (`core.policy.fits_beside`), it would wait for
ever, and hold GPUs from everyone meanwhile.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from gpuwait.core.policy import fits_beside
from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.core.text import command_line
from gpuwait.linux import proc, userns
from gpuwait.queue.conditions import claim_of
from gpuwait.queue.entries import RUNNING, Job, LedgerData, elsewhere


class Surroundings:
    """What may tie this process to running jobs, read once: its lineage (inside a job only)
    and whether its stdin or stdout is a pipe. Most launches have neither, and pay for two
    fstat calls."""

    def __init__(self) -> None:
        self.outer_id = os.environ.get("GPUWAIT_JOB_ID") or None
        # This process and its ancestors: a job's command may be this process itself (`gpuwait
        # -- gpuwait ...`, a job script that ends `exec gpuwait ...`).
        self.lineage = (
            frozenset([os.getpid(), *proc.ancestors(os.getpid())]) if self.outer_id else frozenset()
        )
        self.piped = _std_is_pipe()
        self.group = os.getpgrp()

    @property
    def tied(self) -> bool:
        return bool(self.outer_id or self.piped)

    def inside(self, job: Job) -> bool:
        """Whether this process runs inside the running `job` (its command started it)."""
        return (
            job.state == RUNNING
            and _here(job)
            and job.id == self.outer_id
            and job.child_pid in self.lineage
            and proc.is_alive(job.child_pid, job.child_start_time)
        )

    def in_group(self, job: Job) -> bool:
        """Whether the running `job` is another of this process's group (a pipeline's stage)."""
        if not self.piped or job.state != RUNNING or not _here(job):
            return False
        if job.pid == os.getpid() or job.child_pid is None:
            return False
        try:
            return os.getpgid(job.pid) == self.group
        except OSError:
            return False

    def joined(self, jobs: Sequence[Job]) -> list[Job]:
        """Those of `jobs` (of this process group) that wait for this process through pipes:
        those it writes to, through any stages between (they wait for its output, or for the
        end of it), and, once the pipe on its stdin is full, those that write to it (they wait
        for it to read: a writer whose output fits the pipe ends without). A pipe joins a
        stage's stdout or stderr to the next one's stdin, as a shell's pipeline does; a program
        that reads its children's output on other descriptors (a driver script, make, the
        shell's `$(...)`) is no stage between them. Two that only write to the same pipe, as the
        recipes of `make -j | tee log` do, wait for neither."""
        members = proc.group_members(self.group)
        readers: dict[int, list[int]] = {}
        writers: dict[int, list[int]] = {}
        for pid in members:
            stdin, stdout, stderr = proc.std_pipes(pid)
            if stdin is not None:
                readers.setdefault(stdin, []).append(pid)
            for out in {stdout, stderr} - {None}:
                assert out is not None
                writers.setdefault(out, []).append(pid)
        downstream: dict[int, set[int]] = {pid: set() for pid in members}
        upstream: dict[int, set[int]] = {pid: set() for pid in members}
        for pipe, ins in readers.items():
            for writer in writers.get(pipe, []):
                for reader in ins:
                    if writer != reader:
                        downstream[writer].add(reader)
                        upstream[reader].add(writer)
        near = _reach(downstream, os.getpid())
        if proc.pipe_full(0):
            near |= _reach(upstream, os.getpid())
        return [j for j in jobs if j.pid in near or j.child_pid in near]


def _here(job: Job) -> bool:
    """Is `job` this user's, of this pid namespace? Another namespace's pids name other
    processes here (containers number theirs alike, from 1): none of this process's lineage
    or pipeline."""
    return userns.same_user(os.getuid(), job.uid, job.kuid) and not elsewhere(job)


def _reach(links: dict[int, set[int]], start: int) -> set[int]:
    """Every process reached from `start` along `links`."""
    reached = {start}
    frontier = [start]
    while frontier:
        for nxt in links.get(frontier.pop(), ()):
            if nxt not in reached:
                reached.add(nxt)
                frontier.append(nxt)
    return reached


def _std_is_pipe() -> bool:
    for fd in (0, 1):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                return True
        except OSError:
            continue
    return False


def stuck_behind(
    job: Job, data: LedgerData, gpus: Sequence[GpuSnapshot], safety: float, around: Surroundings
) -> str | None:
    """Why `job` would wait for ever behind running jobs that end only after it (a one-line
    reason naming them), or None where it would not."""
    if not around.tied:
        return None
    claim = claim_of(job, gpus)

    def fits(beside: Sequence[Job]) -> bool:
        return fits_beside(claim, gpus, safety, [claim_of(j, gpus) for j in beside])

    holding = [j for j in data.jobs if around.inside(j)]
    grouped = [j for j in data.jobs if around.in_group(j) and j not in holding]
    # Which stages are joined by pipes takes a look at the whole group: only where it matters.
    if grouped and not fits([*holding, *grouped]):
        holding += around.joined(grouped)
    if not holding or fits(holding):
        return None
    first = holding[0]
    where = ",".join(f"GPU{g.index}" for g in gpus if any(g.uuid in j.gpu_uuids for j in holding))
    request = job.memory_request()
    what = "a whole GPU" if request is None else request.describe()
    how = "runs inside" if first.id == around.outer_id else "is in a pipeline with"
    return (
        f"this {how} gpuwait job {first.id} ({command_line(first.command, 60)}), which keeps"
        f" {where} until this ends: {what} can never start beside it"
    )
