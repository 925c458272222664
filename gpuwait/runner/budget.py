"""Holding a job's budget (gpuwait.core.budget decides; this finds the means and applies them).

With enforce = limit it looks for what this machine offers (the cgroup dmem controller, a CUDA
MPS daemon serving this user, a Python program for the PyTorch hook) and, with dmem, makes the
job's cgroup and starts the command inside it. Nothing here may fail a launch: a way that does
not work is left out, and the budget is held by the others (or only hinted).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence

from gpuwait.core import budget as policy
from gpuwait.core.budget import Budget, Means
from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.core.wrappers import runs_apptainer
from gpuwait.linux import dmem
from gpuwait.queue.conditions import reserved_less
from gpuwait.queue.entries import Job
from gpuwait.runner.launch import python_program

#: gpuwait's PyTorch hook: a directory holding only sitecustomize.py. (os.path, not
#: Path.resolve(): this module is imported by every launch, and resolving costs system calls.)
HOOK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyhook")


class Held:
    """A job's budget as applied: the plan, and its cgroup while it has one."""

    def __init__(
        self,
        plan: Budget,
        cgroup: str | None = None,
        home: str | None = None,
        problem: str | None = None,
    ) -> None:
        self.plan = plan
        self.cgroup = cgroup
        self.problem = problem
        self._home = home

    def _drop(self, way: str) -> None:
        held = tuple(w for w in self.plan.held_by if w != way) or (policy.HELD_HINT,)
        self.plan = self.plan._replace(held_by=held)

    @contextlib.contextmanager
    def spawning(self) -> Iterator[None]:
        """Around the command's start: with a dmem cgroup, gpuwait steps into it so that the
        command is born there (no moment outside its limit), and steps back out after."""
        if self.cgroup is None:
            yield
            return
        try:
            dmem.move(self.cgroup, os.getpid())
        except OSError as exc:
            self.problem = f"cannot enter the dmem cgroup {self.cgroup}: {exc.strerror}"
            self.close()
            self._drop(policy.HELD_DMEM)
            yield
            return
        try:
            yield
        finally:
            if self._home is not None:
                with contextlib.suppress(OSError):
                    dmem.move(self._home, os.getpid())

    def close(self) -> None:
        """After the job: its cgroup goes (once empty)."""
        if self.cgroup is not None:
            dmem.remove(self.cgroup)
            self.cgroup = None


def prepare(
    mode: str,
    job: Job,
    gpus: Sequence[GpuSnapshot],
    command: Sequence[str],
    env: Mapping[str, str],
) -> Held:
    """The job's budget on `gpus`, with the means found where enforce = limit asks for them."""
    means = Means()
    cgroup = home = problem = None
    by_gpu = reserved_less(job, gpus)
    if mode == policy.LIMIT and job.request:
        from gpuwait.linux import mps  # only limit mode looks for a daemon

        place, why_not = dmem.locate(job.gpu_uuids)
        if place is not None:
            dmem.remove_left(place.parent)
            try:
                cgroup = dmem.create(place, f"gpuwait-{job.id}", job.reserved_bytes, by_gpu)
                home = place.home
            except OSError as exc:
                problem = f"cannot make a dmem cgroup in {place.parent}: {exc.strerror}"
                why_not = problem
        # In an Apptainer container the hook's directory is the host's: a container that
        # cleans its environment gets no PYTHONPATH, another only what is bound in.
        contained = runs_apptainer(command)
        means = Means(
            dmem=cgroup is not None,
            dmem_why_not=why_not,
            mps=mps.daemon_serves(env),
            python=python_program(command) and not contained,
            python_why_not=(
                "the PyTorch hook does not reach into an Apptainer container (its directory is "
                "the host's), for the PyTorch cap"
                if contained
                else Means().python_why_not
            ),
            hook_dir=HOOK_DIR,
        )
    plan = policy.plan(
        mode,
        job.reserved_bytes,
        {g.uuid: g.total_bytes for g in gpus},
        env,
        means,
        whole_gpus=not job.request,
        by_gpu=by_gpu,
    )
    return Held(plan, cgroup, home, problem)
