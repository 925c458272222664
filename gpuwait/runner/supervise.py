"""Run the admitted command as gpuwait's child and watch it until it ends.

The child stays in gpuwait's process group, so the terminal's Ctrl-C, Ctrl-Z and job control reach
it exactly as if it ran bare, and its stdin/stdout/stderr are gpuwait's own. Signals sent to
gpuwait's pid are forwarded. Every `sample_interval` the VRAM of the command's whole process tree
is read and published in the ledger.

The peak that goes into the history is the tree's own, from NVML's per-process figures (with
the processes on the job's GPUs that the command started and that left the tree, told by the job
id in their environment). Where
NVML has none for the tree (inside containers it lists host pids, or no figures at all), the
growth of the card's used memory over what it held at admission stands in, and the peak is marked
approximate. That growth is the job's only while nothing else on the card changed: where another
gpuwait job ran on that card during the run, or memory held there at admission was freed (a
process listed then ended, or the card came to hold less than it did then), the job's own growth
is hidden by the others' and the peak is unknown: a figure too small would size the next run too
small. When NVML accounting mode is on, its per-process maximum (which sees between samples) is
taken at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from gpuwait.core.budget import HELD_DMEM, HELD_MPS, HELD_TORCH
from gpuwait.core.estimate import DEFAULT_MARGIN, time_to_peak
from gpuwait.core.overuse import overuse
from gpuwait.core.record import Record, field
from gpuwait.core.sizes import format_size
from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot
from gpuwait.linux import proc, signals
from gpuwait.linux.checkpoint_signal import deliver
from gpuwait.queue import lifecycle
from gpuwait.queue.entries import RUNNING, Job
from gpuwait.queue.ledger import Ledger
from gpuwait.runner.bare import (
    command_has_it,
    ended,
    stop_with,
    subshell_ended_with_its_job,
    take_stops,
)
from gpuwait.runner.launch import JOB_ID_VARIABLE

if TYPE_CHECKING:
    from gpuwait.gpu.backend import Backend
    from gpuwait.runner.frozen import FreezeResponder
    from gpuwait.runner.paused import PauseResponder

#: Signals that ask a program to stop: a run that got one may have ended early, exit 0 or not.
_STOPPING = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})

#: Publish usage only when it moved by this much (or the tree changed): fewer ledger writes mean
#: fewer wake-ups of the waiters, and the policy reads live usage from NVML anyway.
_PUBLISH_STEP = 64 * 2**20
#: How long a sample waits for the ledger's lock before it leaves what it would write to the
#: next sample (the wait for a command's end, and for signals to pass on, goes on meanwhile).
SAMPLE_LOCK_WAIT = 0.5


class RunResult(Record):
    """How the command ended and what it used."""

    #: As os.waitstatus_to_exitcode: >= 0 an exit status, < 0 killed by that signal.
    returncode: int
    #: Peak of the process tree per GPU UUID, from per-process figures (exact).
    peak_bytes: dict[str, int] = field(default_factory=dict)
    run_seconds: float = 0.0
    samples: int = 0
    #: The command was sent the checkpoint signal (cooperative pausing).
    paused: bool = False
    #: The first signal asking it to stop (TERM, INT, HUP, QUIT) that reached the command,
    #: through gpuwait or its process group: the run may have been cut short.
    stopped_by: int | None = None
    #: The checkpoint signal was sent to gpuwait itself (Slurm's --signal=B:USR1@N before the
    #: time limit, a kill): a run that steps aside then ends gpuwait, and is not queued again.
    checkpoint_asked: bool = False
    #: Peak growth of the card's used memory per GPU, while the job ran alone there.
    growth_bytes: dict[str, int] = field(default_factory=dict)
    #: GPUs whose growth is not the job's own: another job ran there, or memory held there at
    #: admission was freed during the run. Their peak is unknown.
    growth_mixed: set[str] = field(default_factory=set)
    #: GPUs where NVML gave a figure for a process of the tree.
    attributed: set[str] = field(default_factory=set)
    #: Free memory per GPU at the sample where the job used the most there (once it used any),
    #: and the card sizes: a card full at the job's peak hints at an out-of-memory failure.
    free_at_peak_bytes: dict[str, int] = field(default_factory=dict)
    total_bytes: dict[str, int] = field(default_factory=dict)
    #: (seconds since start, bytes on the fullest GPU) per sample.
    series: list[tuple[float, int]] = field(default_factory=list)
    #: Every pid the tree ever had, for NVML accounting at the end.
    pids_seen: set[int] = field(default_factory=set)
    #: Per-GPU maximum from NVML accounting mode, where it is on.
    accounting_bytes: dict[str, int] = field(default_factory=dict)

    def peaks(self) -> tuple[dict[str, int], bool]:
        """The best peak per GPU, and whether any of them is approximate.

        Where the peak of one of its GPUs is unknown (neither per-process figures nor a growth
        of the job's own), none is known: the others' could be far below it, and the run's peak
        (the most on any GPU) would size the next run too small.
        """
        known = set(self.attributed) | set(self.accounting_bytes)
        if self.growth_mixed - known:
            return {}, False  # unknown: too small a figure would size the next run too small
        peaks: dict[str, int] = {}
        approximate = False
        for uuid in known | set(self.growth_bytes):
            if uuid in self.accounting_bytes:
                peaks[uuid] = max(self.accounting_bytes[uuid], self.peak_bytes.get(uuid, 0))
            elif uuid in self.attributed:
                peaks[uuid] = self.peak_bytes.get(uuid, 0)
            else:
                peaks[uuid] = self.growth_bytes[uuid]
                approximate = True
        return peaks, approximate

    def time_to_peak(self) -> float | None:
        if not self.peaks()[0]:
            return None  # no peak known, so no time to reach it either
        return time_to_peak(self.series)


def supervise(
    child: int,
    job: Job,
    ledger: Ledger,
    backend: Backend | None,
    sample_interval: float,
    baseline_used: Mapping[str, int] | None = None,
    responder: PauseResponder | FreezeResponder | None = None,
    margin: float = DEFAULT_MARGIN,
    baseline_pids: Mapping[str, frozenset[int]] | None = None,
    warn: Callable[[str], None] | None = None,
    recorded: bool = True,
    started_at: float | None = None,
    witness: signals.GroupWitness | None = None,
) -> RunResult:
    """Forward signals, sample VRAM, and return once `child` has exited.

    `baseline_used`: each GPU's used memory at admission, for the approximate peak, and
    `baseline_pids` the processes NVML listed on it then. `margin`:
    how far past its reservation the job may go before it is called out (estimate_margin).
    `warn` is told, once per GPU, of memory the command holds on a GPU it was not given.
    `recorded`: the ledger knows `child` as the job's command; otherwise samples put it there.
    `started_at`: when (wall clock) `child` was started, before which no process of its tree
    ran (for NVML accounting's figures). `witness`: the GroupWitness started before `child`
    (one is started here where none is given); closed on return.
    """
    started = time.monotonic()
    sampler = UsageSampler(
        child, job, ledger, backend, sample_interval, baseline_used, margin, baseline_pids
    )
    sampler.recorded = recorded
    sampler.warn = warn
    sampler.accounting_since = started_at
    result = sampler.result
    witness = witness or signals.GroupWitness()
    # A pausable job's checkpoint signal sent to gpuwait (Slurm's --signal=B:USR1@N, a user's
    # kill) waits here until a process of the command catches it: delivered before its handler
    # is installed, the signal's default action would kill the job it asks to checkpoint.
    checkpoint_pending = False
    # Ctrl-Z (SIGTSTP) is taken here too: sent to gpuwait's pid alone (`kill -TSTP PID`), it
    # would stop gpuwait and leave the command running, unwatched. The terminal's reaches the
    # command by itself.
    stops, held = take_stops()
    woken = False
    try:
        while True:
            returncode = ended(child)
            if returncode is not None:
                _drop_stops_sent_by(child, sampler.last_tree)
                result.returncode = returncode
                # The time it was frozen is no run time: it did no work, and held no room.
                frozen = 0.0 if responder is None else responder.frozen_seconds
                result.run_seconds = max(0.0, time.monotonic() - started - frozen)
                sampler.finish()
                result.paused = responder is not None and responder.signalled_at is not None
                if result.paused and result.stopped_by is None and responder is not None:
                    # Asked to checkpoint and step aside (and, with --grace-kill, TERMed):
                    # a run that ends now rather than stepping aside may have ended early.
                    result.stopped_by = responder.signum
                return result
            if woken:
                # SIGCHLD, the command still running: a wake-up (gpuwait.queue.wake.kick).
                sampler.look_if_changed()
                woken = False
            sampler.sample_if_due(time.monotonic())
            if responder is not None:
                responder.check(child)
                if checkpoint_pending:
                    checkpoint_pending = not deliver(responder.tree(child), responder.signum)
            info = signals.next_signal(
                max(0.0, min(sampler.next_sample - time.monotonic(), 0.25)),
                also=stops,
            )
            if info is None or info.si_signo == signal.SIGCHLD:
                woken = info is not None
                continue
            if info.si_signo == signal.SIGTSTP:
                stop_with(child, info, witness)
                continue
            if subshell_ended_with_its_job(info, witness):
                continue
            if (
                info.si_signo in _STOPPING
                and result.stopped_by is None
                and not _sent_by_the_command(info, child, False, sampler.last_tree)
            ):
                # Not one the command sent itself: a script's `trap 'kill 0' EXIT` ends its
                # own process group, gpuwait's too, and nobody stopped the run.
                result.stopped_by = info.si_signo
            if (
                responder is not None
                and info.si_signo == responder.signum
                and not _sent_by_the_command(
                    info, child, responder.signalled_at is not None, sampler.last_tree
                )
            ):
                # Sent to gpuwait itself, or to the whole group (the command has it then).
                result.checkpoint_asked = True
            if command_has_it(info, witness):
                continue
            if responder is not None and info.si_signo == responder.signum:
                checkpoint_pending = not deliver(responder.tree(child), info.si_signo)
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, info.si_signo)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        witness.close()


def _drop_stops_sent_by(child: int, seen: Collection[int] = ()) -> None:
    """Take the stopping signals still pending that the command under `child`, now ended, sent
    (its last act, a script's `trap 'kill 0' EXIT`): they asked nobody to stop gpuwait. Any
    other is put back, for the caller to see (signals.stop_pending). `seen`: the processes
    of its tree at its last sample (`_gone_from`)."""
    for signum in _STOPPING & signal.sigpending():
        info = signal.sigtimedwait([signum], 0)
        if info is None:
            continue
        if not (info.si_code <= 0 and (info.si_pid == child or _gone_from(info, seen))):
            signals.keep_pending(signum)


def _gone_from(info: signal.struct_siginfo, seen: Collection[int]) -> bool:
    """Whether `info`'s sender was a process of the command's tree at its last sample (`seen`)
    that has ended since: a script run by a process of the command (make's recipe, a launcher that
    forks), gone by the time its `kill 0` is looked at. A pid that runs again is another
    process's, and one outside the tree now is not the command's."""
    return info.si_pid > 0 and info.si_pid in seen and not proc.is_alive(info.si_pid, None)


def _sent_by_the_command(
    info: signal.struct_siginfo, child: int, asked: bool, seen: Collection[int] = ()
) -> bool:
    """Whether `info`'s signal was sent (kill(2)) by a process of the command under `child`: a
    launcher that passes its checkpoint signal on to its process group, gpuwait's too, to
    reach its workers. That is no ask to checkpoint from outside (Slurm's warning before a
    time limit).

    `asked`: the command was sent its checkpoint signal, to step aside. A sender gone by the
    time it is looked for (`sh -c 'kill -USR1 0'`, reaped at once) is then taken for one of
    the command's, passing it on: Slurm's slurmstepd lasts as long as its step. `seen`: the
    processes of the command's tree at its last sample; one of them gone since sent it as
    the command's (`_gone_from`)."""
    if info.si_code > 0 or info.si_pid <= 0:
        return False
    if info.si_pid in proc.process_tree([child]) or _gone_from(info, seen):
        return True
    return asked and not proc.is_alive(info.si_pid, None)


class UsageSampler:
    """Samples the VRAM of the process tree under `root` on the job's GPUs, and publishes it.

    Every 0.1 s through the first second, so short runs and quick loads still get their peak
    (and a load time to the tenth), then every `sample_interval`. `result` gathers what the
    history wants; its returncode and run time are the caller's to fill in. Used by `supervise`
    for a command, and by gpuwait.runner.hold for a process that holds room for itself.
    """

    def __init__(
        self,
        root: int,
        job: Job,
        ledger: Ledger,
        backend: Backend | None,
        sample_interval: float,
        baseline_used: Mapping[str, int] | None = None,
        margin: float = DEFAULT_MARGIN,
        baseline_pids: Mapping[str, frozenset[int]] | None = None,
    ) -> None:
        self.root = root
        self.job = job
        self.ledger = ledger
        self.backend = backend
        self.sample_interval = sample_interval
        self.baseline_used = baseline_used or {}
        self.baseline_pids = baseline_pids or {}
        self.margin = margin
        self.result = RunResult(returncode=0)
        self.started = time.monotonic()
        self.next_sample = self.started
        self._published: dict[str, int] = {}
        self._published_pids: list[int] = [root]
        self._published_at = self.started
        self._seen_gpus: frozenset[str] | None = None
        self._seen_token = ledger.change_token()
        #: The ledger's entry names the command (lifecycle.started): until it does, every
        #: sample publishes, which records it.
        self.recorded = True
        #: Told, once per GPU, of memory the tree holds on a GPU the job was not given.
        self.warn: Callable[[str], None] | None = None
        #: When (wall clock) the first process of the tree started, where known: accounting
        #: stats of a process that started before are an earlier holder's of its pid.
        self.accounting_since: float | None = None
        self._strayed: set[str] = set()
        #: The command's processes at the last sample: one gone since is no other's sender.
        self.last_tree: frozenset[int] = frozenset()
        self._shared: set[str] = set()

    def sample_if_due(self, now: float) -> None:
        if self.backend is None or now < self.next_sample:
            return
        step = 0.1 if now - self.started < 1.0 else self.sample_interval
        self.next_sample = now + min(self.sample_interval, step)
        result, job, ledger = self.result, self.job, self.ledger
        pids, usage, gpus, snapshot = _sample(self.root, job, self.backend)
        self.last_tree = frozenset(pids)
        if snapshot is not None:
            answering = frozenset(g.uuid for g in snapshot.gpus)
            if self._seen_gpus is not None and answering != self._seen_gpus:
                # Bookkeeping only: the command runs on whatever the ledger says.
                with contextlib.suppress(Exception), ledger.lock_wait(SAMPLE_LOCK_WAIT):
                    lifecycle.note_health(ledger, snapshot)
            self._seen_gpus = answering
            if self.warn is not None:
                self._call_out_strays(snapshot, pids)
                self._call_out_shared(gpus, pids)
        result.samples += 1
        for uuid, used in usage.items():
            result.peak_bytes[uuid] = max(result.peak_bytes.get(uuid, 0), used)
        _note_sample(
            result,
            job,
            ledger,
            gpus,
            pids,
            self.baseline_used,
            now - self.started,
            self.baseline_pids,
        )
        moved = any(
            abs(usage.get(u, 0) - self._published.get(u, 0)) >= _PUBLISH_STEP for u in usage
        )
        # The ledger's fingerprint before looking at it: a change after this look shows at
        # the next sample (taken after the look, it would be taken for one already seen).
        token = ledger.change_token()
        handled = True
        # Others plan with the tree's pids (they read its memory from NVML themselves), so a
        # new tree is published at once; a usage figure only informs, so it is published at
        # the configured interval at most, not at every sample of the first second (which
        # are for this run's own peak and load time).
        if (
            not self.recorded
            or sorted(pids) != sorted(self._published_pids)
            or (moved and now - self._published_at >= self.sample_interval)
        ):
            self._published, self._published_pids = usage, sorted(pids)
            self._published_at = now
            handled = _publish(ledger, job, usage, self._published_pids, self.margin)
            self.recorded = self.recorded or handled
        elif token != self._seen_token:
            handled = self._put_back_if_lost()
        if handled:
            # Otherwise (the ledger could not be read or written) the change stays unseen,
            # and the next sample looks again.
            self._seen_token = token

    def look_if_changed(self) -> None:
        """Between two samples: where the ledger changed, put the entry back if it is lost. A
        gpuwait that recovers a damaged ledger wakes the holders of the entries it lost, and
        admits nobody into their room for RECOVERY_GRACE only; a sample_interval longer than
        that would leave the reservation lost past it."""
        if self.backend is None:
            return
        token = self.ledger.change_token()
        if token != self._seen_token and self._put_back_if_lost():
            self._seen_token = token

    def _put_back_if_lost(self) -> bool:
        """Put the job's entry back where the ledger lacks it; False where the ledger could
        not be read or written."""
        present = _entry_present(self.ledger, self.job)
        if present is None:
            return False
        if present:
            return True
        # Someone replaced the ledger (recovered a damaged one, or wrote it wrongly): our
        # reservation must not stay lost while the command runs (publishing puts the entry
        # back).
        return _publish(self.ledger, self.job, self._published, self._published_pids, self.margin)

    def _call_out_strays(self, snapshot: MachineSnapshot, pids: list[int]) -> None:
        """Memory the tree holds on a GPU the job was not given: something in the command set
        CUDA_VISIBLE_DEVICES again (deepspeed does with --num_gpus), and runs in others' room."""
        assert self.warn is not None
        tree = frozenset(pids)
        given = [g.index for g in snapshot.gpus if g.uuid in self.job.gpu_uuids]
        theirs: dict[str, frozenset[int]] | None = None
        for gpu in snapshot.gpus:
            if gpu.uuid in self.job.gpu_uuids or gpu.uuid in self._strayed:
                continue
            if gpu.process_bytes(tree) <= 0:
                continue
            if theirs is None:
                theirs = _others_pids(self.ledger, self.job) or {}
            # A job of its own started inside the command (a gpuwait of its own) runs there
            # in its own reservation.
            used = gpu.process_bytes(tree - theirs.get(gpu.uuid, frozenset()))
            if used <= 0:
                continue
            self._strayed.add(gpu.uuid)
            self.warn(
                f"the command uses {format_size(used)} on GPU {gpu.index}, which it was not "
                f"given (its GPUs: {', '.join(map(str, given)) or '-'}): something in it set "
                "CUDA_VISIBLE_DEVICES again (as deepspeed --num_gpus, --include or --exclude, "
                "and accelerate --gpu_ids do), and jobs on that GPU may run out of memory"
            )

    def _call_out_shared(self, gpus: list[GpuSnapshot], pids: list[int]) -> None:
        """Several processes of the tree on one GPU, together past the reservation, where
        only per-process caps hold the budget (the PyTorch cap, the MPS limit): each is held
        to the reservation, not all of them together (docs/budgets.md)."""
        assert self.warn is not None
        held = [way for way in self.job.held_by if way in (HELD_TORCH, HELD_MPS)]
        if not held or HELD_DMEM in self.job.held_by:
            return
        tree = frozenset(pids)
        for gpu in gpus:
            if gpu.uuid in self._shared:
                continue
            mine = [p for p in gpu.processes if p.pid in tree and p.used_bytes]
            if len(mine) < 2:
                continue
            used = sum(p.used_bytes or 0 for p in mine)
            reserved = self.job.reserved_on(gpu.uuid)
            if overuse(reserved, used, gpu.total_bytes, self.margin) is None:
                continue
            self._shared.add(gpu.uuid)
            self.warn(
                f"{len(mine)} processes of the command use {format_size(used)} on GPU "
                f"{gpu.index}, past its {format_size(reserved)} reservation: "
                f"the {' and the '.join(held)} hold{'s' if len(held) == 1 else ''} each "
                "process to the reservation, not all of them together; jobs on that GPU may "
                "run out of memory (docs/budgets.md)"
            )

    def finish(self) -> None:
        """After the last sample: NVML accounting mode's figures, where it is on."""
        if self.backend is not None:
            _read_accounting(self.backend, self.job, self.result, self.accounting_since)


def _sample(
    child: int, job: Job, backend: Backend
) -> tuple[list[int], dict[str, int], list[GpuSnapshot], MachineSnapshot | None]:
    tree = proc.process_tree([child])
    try:
        snapshot = backend.snapshot()
    except Exception:  # a failing reading must never take the command down with it
        return sorted(tree), {}, [], None
    gpus = [g for g in snapshot.gpus if g.uuid in job.gpu_uuids]
    tree -= _other_jobs(tree, job, snapshot)
    tree |= _detached(tree, job, gpus)
    usage = {g.uuid: g.process_bytes(tree) for g in gpus}
    return sorted(tree), usage, gpus, snapshot


def _other_jobs(tree: set[int], job: Job, snapshot: MachineSnapshot) -> set[int]:
    """Processes of the tree on a GPU that are another gpuwait job's command or below it (a
    job started from within this one, as `!gpuwait ...` from a notebook holding a
    reservation), told by the job id in their environment: their memory is that job's, under
    its own reservation, and counted as this one's too it would be counted twice."""
    return {
        p.pid
        for g in snapshot.gpus
        for p in g.processes
        if p.pid in tree
        and proc.environ_value(p.pid, JOB_ID_VARIABLE.encode()) not in (None, "", job.id)
    }


def _detached(tree: set[int], job: Job, gpus: list[GpuSnapshot]) -> set[int]:
    """Processes on the job's GPUs that the command started but that left its tree (a server
    that daemonised: its parent is init now), told by the job id every command's environment
    carries, with their own descendants. Their memory is the job's. Only this user's: root
    reads every process's environment, and another user's program may carry the job's id
    (`status` shows it) to pass its memory off as the job's, inside the job's reservation."""
    me = os.getuid()
    found = {
        p.pid
        for g in gpus
        for p in g.processes
        if p.pid not in tree
        and proc.environ_value(p.pid, JOB_ID_VARIABLE.encode()) == job.id
        and proc.owner_uid(p.pid) == me
    }
    return proc.process_tree(found) if found else set()


def _note_sample(
    result: RunResult,
    job: Job,
    ledger: Ledger,
    gpus: list[GpuSnapshot],
    pids: list[int],
    baseline_used: Mapping[str, int],
    elapsed: float,
    baseline_pids: Mapping[str, frozenset[int]] | None = None,
) -> None:
    """Everything besides the per-process peak that the history wants from one sample."""
    tree = set(pids)
    result.pids_seen |= tree
    others: set[str] | None = None
    fullest = 0
    for gpu in gpus:
        result.total_bytes[gpu.uuid] = gpu.total_bytes
        if any(p.pid in tree and p.used_bytes is not None for p in gpu.processes):
            result.attributed.add(gpu.uuid)
        if gpu.uuid in result.attributed:
            used = gpu.process_bytes(tree)
            peak_so_far = result.peak_bytes.get(gpu.uuid, 0)
        else:
            if gpu.uuid not in baseline_used:
                continue
            if others is None:
                others = _gpus_shared_with_others(ledger, job)
            if gpu.uuid in others or _freed_since_admission(
                gpu, baseline_used[gpu.uuid], (baseline_pids or {}).get(gpu.uuid), result
            ):
                # Another job's memory would be taken for ours, or memory freed by others
                # would hide ours: the growth is no longer the job's own, at any sample.
                result.growth_mixed.add(gpu.uuid)
                continue
            used = max(0, gpu.used_bytes - baseline_used[gpu.uuid])
            peak_so_far = result.growth_bytes.get(gpu.uuid, 0)
            result.growth_bytes[gpu.uuid] = max(peak_so_far, used)
        if used > 0 and used >= peak_so_far:
            result.free_at_peak_bytes[gpu.uuid] = gpu.free_bytes
        fullest = max(fullest, used)
    if gpus:
        result.series.append((round(elapsed, 3), fullest))


#: The card's used memory may wander this much below what it held at admission (the driver's
#: own) before memory held by others counts as freed.
_FREED_SLACK = 64 * 2**20


def _freed_since_admission(
    gpu: GpuSnapshot, baseline: int, listed: frozenset[int] | None, result: RunResult
) -> bool:
    """Was memory that others held on `gpu` at admission freed since: a process NVML listed
    there then is gone (not one of the job's own), or the card holds less than it did then?"""
    if gpu.used_bytes < baseline - _FREED_SLACK:
        return True
    if not listed:
        return False
    now = {p.pid for p in gpu.processes}
    return bool(listed - now - result.pids_seen)


def _others_pids(ledger: Ledger, job: Job) -> dict[str, frozenset[int]] | None:
    """The processes of the other running jobs, per GPU they were given; None where the ledger
    cannot be read."""
    try:
        data = ledger.read()
    except Exception:
        return None
    found: dict[str, set[int]] = {}
    for other in data.jobs:
        if other.id != job.id and other.state == RUNNING:
            for uuid in other.gpu_uuids:
                found.setdefault(uuid, set()).update(other.pids)
    return {uuid: frozenset(pids) for uuid, pids in found.items()}


def _gpus_shared_with_others(ledger: Ledger, job: Job) -> set[str]:
    others = _others_pids(ledger, job)
    # Where it cannot be told, assume shared, so no approximate figure.
    return set(job.gpu_uuids) if others is None else set(others)


def _read_accounting(
    backend: Backend, job: Job, result: RunResult, since: float | None = None
) -> None:
    """NVML accounting mode's per-process maximum, where the backend offers it (guarded), of
    processes started from `since` (wall clock) on where given."""
    reader = getattr(backend, "accounting_peak", None)
    if reader is None or not result.pids_seen:
        return
    for uuid in job.gpu_uuids:
        try:
            value = reader(uuid, frozenset(result.pids_seen), since)
        except Exception:
            continue
        if isinstance(value, int) and value >= 0:
            result.accounting_bytes[uuid] = value


def _entry_present(ledger: Ledger, job: Job) -> bool | None:
    """Is the job's entry in the ledger? None: the ledger cannot be read now."""
    try:
        return ledger.read().find(job.id) is not None
    except Exception:
        return None


def _publish(
    ledger: Ledger, job: Job, usage: dict[str, int], pids: list[int], margin: float
) -> bool:
    """Publish the job's usage and pids (putting its entry back where it is missing); False
    where the ledger could not be written."""
    # The command runs on even when the state dir misbehaves; its reservation stays as it was.
    # A lock another process keeps is not waited for long: the next sample tries again, and
    # the command's end (or a signal to pass on) is not held up meanwhile.
    try:
        with ledger.lock_wait(SAMPLE_LOCK_WAIT):
            lifecycle.publish_usage(ledger, job, usage, pids, margin=margin)
    except Exception:
        return False
    return True
