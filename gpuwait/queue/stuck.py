"""Running jobs a waiter could wait behind for ever: those that end only after it does.

Two kinds, both this user's own:
- the gpuwait job whose command started this process (`GPUWAIT_JOB_ID`, and that job's command
  among this process's ancestors): it ends only once what it started has ended;
- a job of this process's own pipeline (its process group) joined to it by pipes, directly or
  through other stages (`python gen.py | tee log | python filter.py`): it may be waiting for
  this one to read its output (or to write its input), as a writer blocks once a pipe is full.
  Jobs that only write to the same pipe (the recipes of `make -j`, all writing to make's
  output) are not joined: neither waits for the other.
Where the waiter can never start beside them (`core.policy.fits_beside`), it would wait for
ever, and hold GPUs from everyone meanwhile.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from gpuwait.core.policy import fits_beside
from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.core.text import command_line
from gpuwait.linux import proc
from gpuwait.queue.conditions import claim_of
from gpuwait.queue.entries import RUNNING, Job, LedgerData


class Surroundings:
    """What may tie this process to running jobs, read once: its ancestors (inside a job only)
    and whether its stdin or stdout is a pipe. Most launches have neither, and pay for two
    fstat calls."""

    def __init__(self) -> None:
        self.outer_id = os.environ.get("GPUWAIT_JOB_ID") or None
        self.ancestors = frozenset(proc.ancestors(os.getpid())) if self.outer_id else frozenset()
        self.piped = _std_is_pipe()
        self.group = os.getpgrp()

    @property
    def tied(self) -> bool:
        return bool(self.outer_id or self.piped)

    def inside(self, job: Job) -> bool:
        """Whether this process runs inside the running `job` (its command started it)."""
        return (
            job.state == RUNNING
            and job.uid == os.getuid()
            and job.id == self.outer_id
            and job.child_pid in self.ancestors
            and proc.is_alive(job.child_pid, job.child_start_time)
        )

    def in_group(self, job: Job) -> bool:
        """Whether the running `job` is another of this process's group (a pipeline's stage)."""
        if not self.piped or job.state != RUNNING or job.uid != os.getuid():
            return False
        if job.pid == os.getpid() or job.child_pid is None:
            return False
        try:
            return os.getpgid(job.pid) == self.group
        except OSError:
            return False

    def joined(self, jobs: Sequence[Job]) -> list[Job]:
        """Those of `jobs` (of this process group) joined to this process by pipes: a stage's
        stdout (or stderr) is the next one's stdin, through any stages between."""
        members = proc.group_members(self.group)
        ends = {pid: proc.std_pipes(pid) for pid in members}
        readers: dict[int, list[int]] = {}
        writers: dict[int, list[int]] = {}
        for pid, (stdin, stdout, stderr) in ends.items():
            if stdin is not None:
                readers.setdefault(stdin, []).append(pid)
            for out in {stdout, stderr} - {None}:
                assert out is not None
                writers.setdefault(out, []).append(pid)
        links: dict[int, set[int]] = {pid: set() for pid in members}
        for pipe, ins in readers.items():
            for reader in ins:
                for writer in writers.get(pipe, []):
                    if writer != reader:
                        links[reader].add(writer)
                        links[writer].add(reader)
        reached = {os.getpid()}
        frontier = [os.getpid()]
        while frontier:
            for nxt in links.get(frontier.pop(), ()):
                if nxt not in reached:
                    reached.add(nxt)
                    frontier.append(nxt)
        return [j for j in jobs if j.pid in reached or j.child_pid in reached]


def _std_is_pipe() -> bool:
    import stat  # only a launch tied to others pays for it

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
