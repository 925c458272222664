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


#: Python's options that keep the hook from running: -E and -I ignore PYTHONPATH, -S imports no
#: sitecustomize. Those taking a value (the rest of the word, or the next one) end a word.
_NO_HOOK = frozenset("EIS")
_TAKES_VALUE = frozenset("WX")
_ENDS_OPTIONS = frozenset("cm")


def ignores_hook(command: Sequence[str]) -> str | None:
    """The option (`-I`) by which the Python interpreter `command` runs (named first, or on its
    script's `#!` line) never runs gpuwait's hook; None where it runs it."""
    words = list(command[1:])
    if not python_program(command[:1]):
        return None
    if not os.path.basename(command[0]).startswith(("python", "pypy")):
        words = _shebang_options(command[0])
    waiting = False
    for word in words:
        if waiting:
            waiting = False
        elif word.startswith("--") and word != "--":
            continue  # --help, --version, ...
        elif word in ("-", "--") or not word.startswith("-"):
            return None  # the script, or the program read from stdin: no more options
        else:
            for at, letter in enumerate(word[1:], start=1):
                if letter in _NO_HOOK:
                    return f"-{letter}"
                if letter in _ENDS_OPTIONS:
                    return None
                if letter in _TAKES_VALUE:
                    waiting = at == len(word) - 1
                    break
    return None


def _shebang_options(name: str) -> list[str]:
    """The words after the interpreter on the `#!` line of the script `name`
    (`#!/usr/bin/python3 -E`, `#!/usr/bin/env -S python3 -I`)."""
    from shutil import which

    path = name if "/" in name else which(name)
    try:
        with open(path or "", "rb") as handle:
            first = handle.readline(256)
    except OSError:
        return []
    words = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    for at, word in enumerate(words):
        if os.path.basename(word).startswith(("python", "pypy")):
            return words[at + 1 :]
    return []


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
        bare = ignores_hook(command)
        means = Means(
            dmem=cgroup is not None,
            dmem_why_not=why_not,
            mps=mps.daemon_serves(env),
            python=python_program(command) and not contained and bare is None,
            python_why_not=(
                "the PyTorch hook does not reach into an Apptainer container (its directory is "
                "the host's), for the PyTorch cap"
                if contained
                else f"python {bare} runs without the PyTorch hook (PYTHONPATH's "
                "sitecustomize), for the PyTorch cap"
                if bare is not None
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
