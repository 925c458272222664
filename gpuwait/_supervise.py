"""Run the admitted command as gpuwait's child and watch it until it ends.

The child stays in gpuwait's process group, so the terminal's Ctrl-C, Ctrl-Z and job control reach
it exactly as if it ran bare, and its stdin/stdout/stderr are gpuwait's own. Signals sent to
gpuwait's pid are forwarded. Every `sample_interval` the VRAM of the command's whole process tree
is read and published in the ledger.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuwait import _proc, _signals
from gpuwait._backend import Backend
from gpuwait._ledger import Job, Ledger

#: Publish usage only when it moved by this much (or the tree changed): fewer ledger writes mean
#: fewer wake-ups of the waiters, and the policy reads live usage from NVML anyway.
_PUBLISH_STEP = 64 * 2**20


@dataclass
class RunResult:
    """How the command ended and what it used."""

    #: As os.waitstatus_to_exitcode: >= 0 an exit status, < 0 killed by that signal.
    returncode: int
    peak_bytes: dict[str, int] = field(default_factory=dict)
    run_seconds: float = 0.0
    samples: int = 0


def spawn(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Start the command with a clean signal mask (gpuwait blocks its own signals)."""
    return os.posix_spawnp(
        argv[0],
        list(argv),
        dict(env),
        setsigmask=(),
        # Python ignores SIGPIPE for itself; the command gets the default, as in a shell.
        # Handlers gpuwait installed are reset by exec; signals ignored by gpuwait's own caller
        # (nohup, `&` in a script) stay ignored, as they would for the bare command.
        setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
    )


def supervise(
    child: int,
    job: Job,
    ledger: Ledger,
    backend: Backend | None,
    sample_interval: float,
    on_warning: Callable[[str], None] = lambda _m: None,
) -> RunResult:
    """Forward signals, sample VRAM, and return once `child` has exited."""
    started = time.monotonic()
    result = RunResult(returncode=0)
    published: dict[str, int] = {}
    published_pids: list[int] = [child]
    next_sample = started
    seen_token = ledger.change_token()
    while True:
        waited_pid, status = os.waitpid(child, os.WNOHANG)
        if waited_pid == child:
            result.returncode = os.waitstatus_to_exitcode(status)
            result.run_seconds = time.monotonic() - started
            return result
        now = time.monotonic()
        if backend is not None and now >= next_sample:
            # Sample densely at first (0.1, 0.2, 0.4 s ...) so short runs still get a peak,
            # then settle at the configured interval.
            next_sample = now + min(sample_interval, 0.1 * 2**result.samples)
            pids, usage = _sample(child, job, backend)
            result.samples += 1
            for uuid, used in usage.items():
                result.peak_bytes[uuid] = max(result.peak_bytes.get(uuid, 0), used)
            moved = any(abs(usage.get(u, 0) - published.get(u, 0)) >= _PUBLISH_STEP for u in usage)
            if moved or sorted(pids) != sorted(published_pids):
                published, published_pids = usage, sorted(pids)
                _publish(ledger, job, usage, published_pids)
            elif ledger.change_token() != seen_token and not _entry_present(ledger, job):
                # Someone replaced the ledger (recovered a damaged one, or wrote it wrongly):
                # our reservation must not stay lost while the command runs.
                _publish(ledger, job, published, published_pids)
            seen_token = ledger.change_token()
        info = _signals.next_signal(max(0.0, min(next_sample - time.monotonic(), 0.25)))
        if info is None or info.si_signo == signal.SIGCHLD:
            continue
        if _signals.came_from_terminal(info):
            continue  # the terminal already sent it to the command's process group
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, info.si_signo)


def _sample(child: int, job: Job, backend: Backend) -> tuple[list[int], dict[str, int]]:
    tree = _proc.process_tree([child])
    try:
        snapshot = backend.snapshot()
    except Exception:  # a failing reading must never take the command down with it
        return sorted(tree), {}
    usage = {g.uuid: g.process_bytes(tree) for g in snapshot.gpus if g.uuid in job.gpu_uuids}
    return sorted(tree), usage


def _entry_present(ledger: Ledger, job: Job) -> bool:
    try:
        return ledger.read().find(job.id) is not None
    except Exception:
        return True  # cannot tell; the next change is looked at again


def _publish(ledger: Ledger, job: Job, usage: dict[str, int], pids: list[int]) -> None:
    try:
        with ledger.transaction() as data:
            mine = data.find(job.id)
            if mine is None:
                data.jobs.append(job)
                mine = job
            mine.observed = dict(usage)
            mine.pids = list(pids)
            mine.updated_at = time.time()
            job.observed, job.pids = mine.observed, mine.pids
    except Exception:
        # The command runs on even when the state dir misbehaves; its reservation stays as it was.
        pass
