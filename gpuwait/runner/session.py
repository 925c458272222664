"""One wrapped command, from request to exit status: `run(request, config, reporter)`.

    choose the request (--vram, history, default_vram) ─> submit ─> wait ─> start ─> supervise
        ─> finish (or step aside and wait again) ─> record the run ─> retry after an OOM

The request (what the user asked) and the config (the settings, as plain values) are built by
gpuwait.commands.run; everything said to the user goes through the `Reporter` it passes in.
Changes of the job's state are gpuwait.queue.lifecycle's; the waiting is gpuwait.queue.wait's.
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from gpuwait.core.budget import (
    DEFAULT_ENFORCE,
    LIMIT,
    OOM_CARD_FULL,
    OOM_OWN_LIMIT,
    Budget,
    near_limit,
    oom_cause,
    sizes_itself,
)
from gpuwait.core.errors import (
    EXIT_CANCELLED,
    EXIT_DEPENDENCY_FAILED,
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    EXIT_TIMEOUT,
    BackendUnavailable,
    GpuwaitError,
    ImpossibleRequest,
    NoGpuTakesJobs,
    StateError,
    StuckBehind,
    UsageError,
)
from gpuwait.core.estimate import looks_like_oom, near_full
from gpuwait.core.policy import (
    NO_CANDIDATE,
    NO_MATCH,
    OVER_LIMIT,
    PROHIBITED_NOTE,
    TOO_FEW,
    Requirements,
    WaitReason,
    impossible_reason,
)
from gpuwait.core.record import Record
from gpuwait.core.sizes import (
    MemoryRequest,
    format_duration,
    format_setting_duration,
    format_size,
)
from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot
from gpuwait.core.text import columns, command_line, entry_command
from gpuwait.gpu import open_backend
from gpuwait.history import record as run_record
from gpuwait.history.learn import (
    FLAG,
    Learned,
    RecordedThenSignalled,
    RequestChoice,
    cap_to_cards,
    choose_request,
    kept_command,
    learn,
    save_record,
)
from gpuwait.linux import proc, signals, turnstile
from gpuwait.linux.lock import Patience
from gpuwait.queue import lifecycle
from gpuwait.queue.bookkeeping import FAILED, INTERRUPTED, OK, TIMED_OUT
from gpuwait.queue.conditions import claim_of, reserved_on_each
from gpuwait.queue.entries import WAITING, Job, requirements_of
from gpuwait.queue.ledger import LEAVE_PATIENCE, Ledger, LockBusy, LockPastDeadline
from gpuwait.queue.lifecycle import Admitted, Cancelled, DependencyFailed
from gpuwait.queue.stuck import Surroundings, stuck_behind
from gpuwait.queue.wait import (
    GpuRetry,
    Interrupted,
    Stuck,
    TimedOut,
    WaitPolicy,
    no_gpu_answers,
    wait_for_admission,
)
from gpuwait.runner import budget
from gpuwait.runner.bare import run_bare
from gpuwait.runner.launch import (
    SHORT_OF_PROCESSES,
    START_RETRY_SECONDS,
    CommandProblem,
    StartInterrupted,
    check_command,
    check_keeps_gpus,
    check_launcher_gpus,
    check_not_srun,
    check_pausable_container,
    check_script,
    command_env,
    container_copies,
    drop_inherited,
    spawn_when_possible,
)
from gpuwait.runner.stderrwatch import StderrWatch
from gpuwait.runner.supervise import RunResult, supervise

if TYPE_CHECKING:
    from gpuwait.gpu.backend import Backend
    from gpuwait.runner.frozen import FreezeResponder
    from gpuwait.runner.paused import PauseResponder

    # Only the type checker needs the protocol; creating one at run time slows every launch.
    class Reporter(Protocol):
        """How a run speaks to the user (gpuwait.commands.output gives the terminal's)."""

        def warn(self, message: str) -> None:
            """Something the user should know; the run goes on."""

        def info(self, message: str) -> None:
            """What is happening (not said with --quiet)."""

        def error(self, message: str) -> None:
            """Why the run ends without the command's own status."""

        def waiting(self, reason: WaitReason, job: str) -> None:
            """Why the job still waits (its line is rewritten in place on a terminal); `job`
            names it (its --name, else its id), for a terminal where several wait."""

        def waited(self) -> None:
            """The wait is over: clear the waiting line."""


class Pausable(Record, frozen=True):
    """`--pausable`: how the job is asked to step aside."""

    checkpoint_signal: str
    grace_seconds: float
    grace_kill: bool


class RunRequest(Record, frozen=True):
    """What the user asked for one command (validated by the command line)."""

    command: tuple[str, ...]
    #: --vram; None: learned from the history, else default_vram.
    vram: MemoryRequest | None = None
    #: --exclusive: whole GPUs.
    exclusive: bool = False
    key: str | None = None
    retry_oom: int = 0
    gpus: int = 1
    #: --devices as given (indices or UUIDs), resolved against the GPUs once they are read.
    devices: str | None = None
    #: Capability requests as a ledger entry stores them (min_total_bytes, name_pattern, ...).
    requirements: Mapping[str, Any] = MappingProxyType({})
    name: str | None = None
    batch: str | None = None
    #: --after and --after-ok references (ids, names, batches).
    after: tuple[str, ...] = ()
    after_ok: tuple[str, ...] = ()
    pausable: Pausable | None = None
    #: --freezable: frozen (CUDA checkpointing) rather than asked, where it must step aside.
    freezable: bool = False
    verbose: bool = False
    #: --once: queue nothing while a job of the user's with this key waits or runs.
    once: str | None = None
    #: Started by the shell hook, which runs a command bare rather than have it wait for ever.
    from_hook: bool = False


class RunConfig(Record, frozen=True):
    """The settings a run reads, as plain values."""

    state_dir: Path
    ledger_dir: Path
    #: An explicitly configured ledger dir must exist (an administrator creates a shared one).
    ledger_must_exist: bool
    lock_timeout: float
    sim: Path | None
    nvml_timeout: float
    on_no_gpu: str
    on_state_error: str
    default_vram: MemoryRequest | None
    estimate_margin: float
    history_commands: str
    history_max_size: int
    pick: str
    priority: int
    timeout: float | None
    gpu_weights: Mapping[str, float]
    wait: WaitPolicy
    #: --prefer / prefer: GPUs (NVML indices or UUIDs) taken first where the job fits.
    prefer: tuple[str, ...]
    sample_interval: float
    resume_exit: int
    watch_stderr: bool
    enforce: str = DEFAULT_ENFORCE
    #: visible_devices = index: CUDA_VISIBLE_DEVICES names NVML indices instead of UUIDs.
    visible_by_index: bool = False


_T = TypeVar("_T")


class _Ended(Record, frozen=True):
    """One attempt: the status to end with (< 0: killed by that signal) and whether it OOMed
    (not a run that was stopped, whatever it said: it is not run again)."""

    returncode: int
    oom: bool = False
    reserved_bytes: int = 0
    #: How the OOM came about (gpuwait.core.budget: own limit, card full, unknown).
    oom_cause: str | None = None
    #: The command checkpointed on request and is queued again (cooperative pausing); the
    #: run time of that run.
    paused: bool = False
    run_seconds: float = 0.0
    #: The paused run's peak (None: unknown), and whether it is approximate.
    peak: tuple[int | None, bool] = (None, False)
    #: An out-of-memory run that may be retried: its entry, still in the ledger as running
    #: (so nobody waiting on it takes the attempt for its end), and how to finish it if not.
    pending: Job | None = None
    finish_how: Mapping[str, Any] = MappingProxyType({})
    #: What it reserved on each GPU where that differs between them (`12.0 GiB on GPU0, ...`).
    reserved_each: str | None = None
    #: A pending run's job stepped aside before: what a retry, which goes on from its
    #: checkpoint, counts of those runs (see _SteppedAside).
    stepped_aside: _SteppedAside | None = None
    #: Where it stepped aside: how to record that run, should the job never run again (it is
    #: stopped or cancelled while it waits to resume), given the job as it then is and the
    #: time it spent stepped aside in all.
    record: Callable[[Job, float], None] | None = None
    #: False where the command never started (a signal while it could not start yet).
    started: bool = True


def run(request: RunRequest, config: RunConfig, reporter: Reporter) -> int:
    """Run the command as a job; return the status gpuwait ends with (or end by its signal)."""
    try:
        return _run(request, config, reporter)
    except KeyboardInterrupt:
        # Ctrl-C before the job queued, while gpuwait takes its signals as they come (the GPUs
        # not answering yet, a long history read): gpuwait ends by it, as while it waits for
        # room, so that a shell stops its script (not on a child that exited 130).
        sys.stdout.flush()
        signals.die_by_signal(signal.SIGINT)
        return 128 + signal.SIGINT


#: Where the refusals of command lines before waiting are written up, by kind.
REFUSED_LINES_DOC = "docs/usage.md, 'Command lines refused before waiting'"


def _run(request: RunRequest, config: RunConfig, reporter: Reporter) -> int:
    # --timeout counts from here, on the boot clock: the wait for the ledger's lock to queue
    # the job counts as waiting, as `timeout 30m gpuwait ...` would count it.
    launched = proc.boot_clock()
    choice = _request(request, config, reporter)
    # A line refused for what it runs is refused whether or not its program is installed
    # here: the refusal says how to write it, "command not found" would not.
    try:
        check_not_srun(request.command)
        check_keeps_gpus(request.command, by_index=config.visible_by_index)
        check_launcher_gpus(request.command)
        if request.pausable is not None:
            check_pausable_container(request.command)
    except UsageError as exc:
        # The hint is the line to type; why such a line is refused is written up in one place.
        raise UsageError(f"{exc.message} (see {REFUSED_LINES_DOC})", exc.hint) from None
    check_command(request.command)
    missing = check_script(request.command, bool(request.after or request.after_ok))
    if missing is not None:
        reporter.warn(missing)
    _load_what_comes_after_the_wait(request, config)
    try:
        backend = _read_gpus(
            lambda: open_backend(config.sim, config.nvml_timeout), config, reporter, launched
        )
    except BackendUnavailable as exc:
        # Only where no GPU can ever be read here (no driver, no simulation file) may the
        # command run uncoordinated; a failure that may pass was retried, never run around.
        if config.on_no_gpu == "fail" or not exc.run_without:
            raise
        reporter.warn(f"{exc.message}; running the command without waiting (on_no_gpu = run)")
        return run_bare(request.command)
    try:
        return _run_with_retries(request, config, reporter, backend, choice, launched)
    except signals.SignalPending as exc:
        # A signal that came while gpuwait waited for a lock with no command of its own to
        # pass it to (it had ended, or stepped aside): gpuwait ends by it, as it would bare.
        signals.die_by_signal(exc.signum)
        return 128 + exc.signum
    finally:
        backend.close()


def _load_what_comes_after_the_wait(request: RunRequest, config: RunConfig) -> None:
    """Import now what this launch imports only once it is admitted, or when it waits again
    after its command ran (it stepped aside, or is retried after running out of memory).
    Package managers replace gpuwait's files under running processes (`pip uninstall`, and
    `pip install -U`, which removes the old files before it writes the new ones): a launch
    that waited meanwhile found them gone, or another version's, once its command had started,
    and ended in a traceback while the command ran on without it. A launch that asks for none
    of these pays nothing."""
    import importlib

    later = []
    if request.pausable is not None:
        later.append("gpuwait.runner.paused")
    if request.freezable:
        later.append("gpuwait.runner.frozen")
    if request.pausable is not None or request.freezable or request.retry_oom:
        later += ["gpuwait.queue.pausing", "gpuwait.linux.inotify"]
    if config.enforce == LIMIT:
        later.append("gpuwait.linux.mps")
    for name in later:
        importlib.import_module(name)


class _GaveUp(GpuwaitError):
    """The --timeout ran out while the GPUs could not be read, before the job queued."""

    exit_code = EXIT_TIMEOUT


def _read_gpus(
    read: Callable[[], _T],
    config: RunConfig,
    reporter: Reporter,
    counted_from: float | None = None,
) -> _T:
    """`read()`, retried with back-off while it fails in a way that may pass (see GpuRetry);
    a lasting failure, or one past gpu_error_timeout, is raised. The retries are waiting too:
    they end with the --timeout (counted from `counted_from` on the boot clock, else from
    now), exit 124, where that comes first."""
    retry = GpuRetry(config.wait.gpu_error_timeout)
    counted_from = proc.boot_clock() if counted_from is None else counted_from
    deadline = None if config.timeout is None else counted_from + config.timeout
    while True:
        try:
            return read()
        except BackendUnavailable as exc:
            if exc.lasting:
                raise
            first = retry.since is None
            pause = retry.failed(exc)
            if deadline is not None:
                left = deadline - proc.boot_clock()
                if left <= 0:
                    raise _GaveUp(
                        gave_up(proc.boot_clock() - counted_from, exc.message), hint=exc.hint
                    ) from None
                pause = min(pause, left)
            if first:
                reporter.warn(
                    f"{exc.message}; retrying for up to gpu_error_timeout = "
                    f"{format_setting_duration(config.wait.gpu_error_timeout)}"
                )
            # Waiting for the GPUs, not loading: the next launch in the turnstile goes ahead.
            turnstile.leave()
            time.sleep(pause)


def _choose(request: RunRequest, config: RunConfig, vram: MemoryRequest | None) -> RequestChoice:
    """`vram` when given; else what the history says of the command; else default_vram."""
    return choose_request(
        vram,
        config.default_vram,
        config.state_dir,
        request.command,
        os.getcwd(),
        key=request.key,
        margin=config.estimate_margin,
        max_bytes=config.history_max_size,
        gpus=request.gpus,
    )


def _request(request: RunRequest, config: RunConfig, reporter: Reporter) -> RequestChoice:
    if request.exclusive:
        return RequestChoice(None, FLAG)
    choice = _choose(request, config, request.vram)
    if choice.learned is not None:
        for message in choice.learned.warnings:
            reporter.warn(message)
    return choice


def _run_with_retries(
    request: RunRequest,
    config: RunConfig,
    reporter: Reporter,
    backend: Backend,
    choice: RequestChoice,
    launched: float,
) -> int:
    """Run once; after an out-of-memory failure, queue again with the raised estimate.
    `launched`: when gpuwait started (the boot clock), which the first wait's --timeout counts
    from; each retry's wait counts from its own start."""
    retries = 0
    requeued: Job | None = None
    stepped_aside: _SteppedAside | None = None
    while True:
        ended = _attempt(
            request,
            config,
            reporter,
            backend,
            choice,
            requeued,
            retries,
            stepped_aside,
            launched=launched if retries == 0 else None,
        )
        returncode = ended.returncode
        if not ended.oom:
            break
        pending, requeued, stepped_aside = ended.pending, None, ended.stepped_aside
        # Sent once the command had ended (a USR1 for it), a signal not asking gpuwait to end
        # is no retry's, nor gives up a wait for a lock on the way to one. A --pausable job's
        # checkpoint signal asks it to leave instead, as while it waits (below), TERM too.
        checkpoint = _checkpoint_signals(request)
        dropped = signals.drop_pending(also=checkpoint)
        asked = any(signum in checkpoint for signum in dropped)
        dropped = [signum for signum in dropped if signum not in checkpoint]
        how = _ran_out(ended)
        try:
            raised = _choose(request, config, None)
            # Capped as the next attempt will be: a run that already had the largest card
            # cannot be helped by a bigger estimate.
            snapshot = backend.snapshot()
            raised = _capped(raised, request, config, snapshot, _candidates(request, snapshot))
        except GpuwaitError:
            _end_pending(ended, config, reporter)
            if retries < request.retry_oom:
                raise
            # Only the summary needed the GPUs: the run's own exit status still stands.
            reporter.warn(f"the command ran out {how}")
            break
        after = raised.request.bytes if raised.request is not None else None
        stop = signals.stop_pending() if retries < request.retry_oom else None
        if (
            stop is None
            and asked
            and retries < request.retry_oom
            and pending is not None
            and lifecycle.was_cancelled(_ledger(config, reporter), pending)
        ):
            # `gpuwait cancel` sends TERM, which may be the checkpoint signal: a cancel all
            # the same.
            stop, asked = signal.SIGTERM, False
        if stop is not None:
            # Told to end once the command had (`kill`, an older `gpuwait cancel`, which only
            # sends TERM): the signal is no retry's to take. Said before any want of a larger
            # size, which a run left unrecorded by it (the history lock held) also shows.
            why = f"gpuwait got {signals.signal_name(stop)}"
            if pending is not None:
                if lifecycle.was_cancelled(_ledger(config, reporter), pending):
                    why = f"job {pending.id} was cancelled"
                _end_pending(ended, config, reporter)
            reporter.warn(f"the command ran out {how}; {why}, so it is not retried")
            break
        if (
            asked
            and retries < request.retry_oom
            and after is not None
            and after > ended.reserved_bytes
        ):
            # Asked to checkpoint (Slurm's warning before the time limit) with no command
            # running: nothing to save, and the resume status tells the batch script to
            # requeue the job, as one asked while it waits.
            _end_pending(ended, config, reporter)
            reporter.warn(
                f"the command ran out {how}; asked to checkpoint once it had, the job is "
                f"not retried: it leaves with the resume status {config.resume_exit}, to "
                "be started again later"
            )
            returncode = config.resume_exit
            break
        if pending is not None and (
            retries >= request.retry_oom or after is None or after <= ended.reserved_bytes
        ):
            _end_pending(ended, config, reporter)
            pending = None
        if retries >= request.retry_oom:
            # The exit summary: what ended the run, and what the next run will ask for.
            if after is None or after <= ended.reserved_bytes:
                reporter.warn(f"the command ran out {how}")
            else:
                without = " without --vram" if request.vram is not None else ""
                reporter.warn(
                    f"the command ran out {how}; the next run{without} asks for "
                    f"{format_size(after)}"
                )
            break
        retries += 1
        if after is None or after <= ended.reserved_bytes:
            reporter.warn(f"the command ran out {how}; no larger size to retry with")
            break
        if pending is not None:
            # The same entry queues again, in its place: a job waiting on it (--after,
            # --after-ok, its batch) waits for the retry, not for the attempt that ran out.
            assert raised.request is not None
            requeued = lifecycle.retry(
                _ledger(config, reporter),
                pending,
                raised.request.to_json(),
                size_source=raised.note,
                **ended.finish_how,
            )
            if requeued is None:
                # Cancelled (gpuwait cancel) as its run ran out: it never starts again.
                _end_pending(ended, config, reporter)
                reporter.warn(
                    f"the command ran out {how}; job {pending.id} was cancelled, "
                    "so it is not retried"
                )
                break
        for signum in dropped:
            reporter.info(
                f"gpuwait got {signals.signal_name(signum)} once the command had ended; "
                "the command started again does not get it"
            )
        reporter.info(
            f"the command ran out {how}; retrying with {format_size(after)} "
            f"(retry {retries} of {request.retry_oom})"
        )
        choice = raised
    if returncode < 0:
        sys.stdout.flush()
        signals.die_by_signal(-returncode)
        return 128 - returncode
    return returncode


def _end_pending(ended: _Ended, config: RunConfig, reporter: Reporter) -> None:
    """Finish the entry an out-of-memory run left for a retry that is not made after all."""
    if ended.pending is not None:
        _ended_run(_ledger(config, reporter), ended.pending, FAILED, reporter, **ended.finish_how)


def _ran_out(ended: _Ended) -> str:
    """How a run ran out of memory, after "the command ran out "."""
    if ended.oom_cause == OOM_OWN_LIMIT:
        if ended.reserved_each:
            return f"at its own limit, {ended.reserved_each}"
        return f"at its own {format_size(ended.reserved_bytes)} limit"
    if ended.oom_cause == OOM_CARD_FULL:
        return "of memory on a full card"
    return "of GPU memory"


def _candidates(request: RunRequest, snapshot: MachineSnapshot) -> list[str] | None:
    """The GPUs the job may use: --devices, within an inherited CUDA_VISIBLE_DEVICES."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is None and "SLURMD_NODENAME" in os.environ:
        from gpuwait.linux.slurm import job_without_gpus

        conf = job_without_gpus(os.environ)
        job_gpus = os.environ.get("SLURM_JOB_GPUS")
        # SLURM_JOB_GPUS is in the node's numbering; CUDA's counts only the GPUs a device cgroup
        # (ConstrainDevices) lets it open.
        given = job_gpus
        if conf is not None and job_gpus and snapshot.hidden:
            from gpuwait.core.devices import as_cuda_numbers

            given = as_cuda_numbers(job_gpus, snapshot.hidden)
        # The shell hook's line may need no GPU (`python prep.py` in an `srun --pty bash`): the
        # hook runs it bare, on the CPU, once CUDA_VISIBLE_DEVICES hides every GPU.
        line = command_line(request.command, 200)
        on_cpu = f"; or on the CPU: CUDA_VISIBLE_DEVICES= {line}" if request.from_hook else ""
        if conf is not None and job_gpus:
            # A step run with --gres=none in a job that has GPUs, or CUDA_VISIBLE_DEVICES
            # unset in the job (see gpuwait.linux.slurm).
            raise ImpossibleRequest(
                f"this Slurm job has GPUs (SLURM_JOB_GPUS={job_gpus}) but this step none of "
                "them: no CUDA_VISIBLE_DEVICES (srun --gres=none or --gpus=0, or the variable "
                f"unset); {conf} hands this node's GPUs out as GRES, so every GPU here may be "
                "another job's",
                hint="run the step with the job's GPUs (srun without --gres=none or --gpus=0), "
                f"or set CUDA_VISIBLE_DEVICES={given}{on_cpu}",
            )
        if conf is not None:
            # Every GPU here may be another Slurm job's (see gpuwait.linux.slurm).
            raise ImpossibleRequest(
                f"Slurm gave this job no GPU ({conf} hands this node's GPUs out as GRES), so "
                "every GPU here may be another job's",
                hint="ask Slurm for one (sbatch or srun --gres=gpu:1, or --gpus=1), or set "
                f"CUDA_VISIBLE_DEVICES to the GPUs this job may use{on_cpu}",
            )
    if request.devices is None and inherited is None:
        return None  # any GPU (and a plain launch need not import the parsing below)
    from gpuwait.core.devices import (
        first_in_mig_mode,
        parse_devices_option,
        parse_inherited_visible,
    )
    from gpuwait.core.wrap import hides_every_gpu

    candidates: list[str] | None = None
    if request.devices is not None:
        try:
            candidates = parse_devices_option(request.devices, snapshot.gpus, reading=snapshot)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        mig = None if candidates else first_in_mig_mode(request.devices, snapshot.in_mig_mode)
        if mig is not None:
            raise ImpossibleRequest(
                f"--devices {request.devices!r} names no GPU but GPU {mig}, which is in MIG "
                "mode; gpuwait places jobs on whole GPUs only",
                hint="name whole GPUs (see gpuwait status)",
            )
        if not candidates:
            # Each GPU it names left out of this reading: one that did not answer is retried.
            raise ImpossibleRequest(f"--devices {request.devices!r} names no GPU that answers")
    if inherited is not None:
        visible = parse_inherited_visible(
            inherited, snapshot.gpus, snapshot.in_mig_mode, snapshot.hidden
        )
        if not visible and inherited.strip().upper().startswith("MIG-"):
            raise ImpossibleRequest(
                f"CUDA_VISIBLE_DEVICES={inherited!r} names a MIG instance; gpuwait places jobs "
                "on whole GPUs only",
                hint="run the command without gpuwait, or from where a whole GPU is visible",
            )
        mig = (
            None if visible else first_in_mig_mode(inherited, snapshot.in_mig_mode, snapshot.hidden)
        )
        if mig is not None:
            raise ImpossibleRequest(
                f"CUDA_VISIBLE_DEVICES={inherited!r} makes visible no GPU but GPU {mig}, which "
                "is in MIG mode; gpuwait places jobs on whole GPUs only",
                hint="run the command without gpuwait, or from where a whole GPU is visible",
            )
        if not visible and hides_every_gpu(inherited):
            # CUDA's way to run on the CPU (empty, -1, none), as the shell hook reads it.
            raise ImpossibleRequest(
                f"CUDA_VISIBLE_DEVICES={inherited!r} hides every GPU: no GPU visible to this "
                "command, which runs on the CPU",
                hint="run the command without gpuwait, or unset CUDA_VISIBLE_DEVICES for "
                "gpuwait to give it a GPU",
            )
        if not visible:
            raise ImpossibleRequest(
                f"CUDA_VISIBLE_DEVICES={inherited!r} makes no GPU visible to this command",
                hint="unset it, or list GPU indices or UUIDs that exist (see gpuwait status)",
            )
        candidates = visible if candidates is None else [u for u in candidates if u in visible]
        if not candidates:
            raise ImpossibleRequest(
                f"--devices {request.devices} names no GPU visible through "
                f"CUDA_VISIBLE_DEVICES={inherited}"
            )
    return candidates


def _preferred(config: RunConfig, snapshot: MachineSnapshot) -> list[str]:
    """The `prefer` GPUs as UUIDs; one not on this machine is a usage error, as for --devices.
    One the reading left out (lost, in MIG mode) is no preference now: it never keeps a job
    waiting, nor a launch retrying for it."""
    if not config.prefer:
        return []
    from gpuwait.core.devices import parse_devices_option

    try:
        return parse_devices_option(",".join(config.prefer), snapshot.gpus, "prefer", snapshot)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _weights(config: RunConfig, snapshot: MachineSnapshot) -> dict[str, float]:
    """gpu_weights by UUID: each key an NVML index, a UUID or a UUID's prefix, as for
    --devices and prefer; one not on this machine is a usage error, one the reading left out
    (lost, in MIG mode) weighs nothing now."""
    from gpuwait.core.devices import parse_devices_option

    weights: dict[str, float] = {}
    for key, weight in config.gpu_weights.items():
        try:
            named = parse_devices_option(key, snapshot.gpus, "gpu_weights", snapshot)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        weights.update(dict.fromkeys(named, weight))
    return weights


def _new_job(
    request: RunRequest,
    config: RunConfig,
    choice: RequestChoice,
    snapshot: MachineSnapshot,
    candidates: list[str] | None,
) -> Job:
    pausable = request.pausable
    now = time.time()
    job = Job(
        id=os.urandom(4).hex(),
        pid=os.getpid(),
        start_time=proc.start_time(os.getpid()) or 0,
        uid=os.getuid(),
        command=entry_command(request.command),
        cwd=os.getcwd(),
        request=choice.request.to_json() if choice.request is not None else {},
        gpus=request.gpus,
        candidates=candidates,
        pick=config.pick,
        priority=config.priority,
        state=WAITING,
        submitted_at=now,
        updated_at=now,
        name=request.name,
        batch=request.batch,
        requirements=dict(request.requirements),
        weights=_weights(config, snapshot) if config.pick == "weighted" else {},
        once=request.once,
        key=request.key,
        prefer=_preferred(config, snapshot),
        freezable=request.freezable,
        safety=config.wait.safety,
        safety_from_site=config.wait.fair.safety_from_site,
        history_dir=str(config.state_dir),
        history_commands=config.history_commands,
        size_source=choice.note,
        from_hook=request.from_hook,
    )
    rules = config.wait.pause_rules
    if (pausable is not None or request.freezable) and rules is not None:
        # Its owner's protection against being asked to step aside, whoever asks.
        job = job._replace(pause_min_runtime=rules.min_runtime, pause_max=rules.max_pauses)
    if pausable is not None:
        job = job._replace(
            pausable=True,
            checkpoint_signal=pausable.checkpoint_signal,
            grace_seconds=pausable.grace_seconds,
            grace_kill=pausable.grace_kill,
        )
    return job


def _with_run_times(
    job: Job,
    config: RunConfig,
    learned: Learned | None,
    snapshot: MachineSnapshot,
    command: Sequence[str],
    key: str | None,
) -> tuple[Job, list[str]]:
    """`job` with what the history says of its run times: for backfill, ETAs, the cost of
    pausing it and adaptive-throughput; and the history's warnings.

    Run times are learned as its size is, from the runs of its --key where it has one (what
    `gpuwait estimate --key` shows); `learned` is that look-up when the request already made
    it (its warnings were said then).
    """
    warnings: list[str] = []
    if learned is None:
        try:
            learned = learn(
                config.state_dir, command, job.cwd, key=key, max_bytes=config.history_max_size
            )
        except Exception as exc:  # an unreadable history must not stop a launch
            if signals.raised_by_a_handler(exc):
                raise  # the program's own timeout (gpuwait.reserve), to reach it
            return job, []
        warnings = list(learned.warnings)
    expected = None if learned.run_time is None else learned.run_time.median
    load = None if learned.load_time is None else learned.load_time.median
    by_gpu = (
        learned.run_seconds_on(g.uuid for g in snapshot.gpus)
        if job.pick == "adaptive-throughput"
        else {}
    )
    updated = job._replace(
        expected_seconds=expected,
        expected_by_gpu=by_gpu,
        # Pausing this job costs its reload: waiters weigh it against their own wait.
        load_seconds=load if job.pausable else None,
    )
    return updated, warnings


def _ledger(config: RunConfig, reporter: Reporter | None = None) -> Ledger:
    return Ledger(
        config.ledger_dir,
        must_exist=config.ledger_must_exist,
        lock_timeout=config.lock_timeout,
        on_slow_lock=None if reporter is None else reporter.warn,
        fair_half_life=config.wait.fair.half_life,
    )


def submit(ledger: Ledger, job: Job, request: RunRequest, config: RunConfig) -> Job:
    """`job` entered in the queue as `request` asks: its dependencies, and its command as the
    history keeps it."""
    return lifecycle.submit(
        ledger,
        job,
        request.after,
        request.after_ok,
        config.state_dir,
        kept_command(request.command, job.cwd, config.history_commands),
    )


def _show_warnings(ledger: Ledger, reporter: Reporter) -> None:
    for message in ledger.take_warnings():
        reporter.warn(message)


def prepare_job(
    request: RunRequest,
    config: RunConfig,
    reporter: Reporter,
    backend: Backend,
    choice: RequestChoice,
    spell: Callable[[str], str],
    around: Surroundings,
    counted_from: float | None = None,
) -> tuple[Job, RequestChoice]:
    """The job as it is submitted, and its request capped to the cards: the GPUs read once, a
    request that can never fit refused (ImpossibleRequest, with a hint naming the caller's
    options as `spell` does: `--vram`, or `vram` in Python; StuckBehind inside a job, `around`, it could never start beside), run
    times from history added. A wrapped run and a reservation from
    Python (runner/hold) both start here. Readings that fail are retried until the timeout,
    counted from `counted_from` (the boot clock; else from now), at most."""
    said: set[str] = set()

    def read_and_judge() -> tuple[MachineSnapshot, Job, RequestChoice]:
        snapshot = backend.snapshot()
        if request.from_hook and config.on_no_gpu == "run":
            from gpuwait.core.devices import none_usable

            if (nothing := none_usable(snapshot)) is not None:
                # The hook runs the line bare, as on a machine with no driver: one warning,
                # not the reading's own for each card as well.
                raise NoGpuTakesJobs(nothing[0], hint=nothing[1])
        for message in snapshot.warnings:
            if message not in said:
                said.add(message)
                reporter.warn(message)
        if (silent := no_gpu_answers(snapshot)) is not None:
            raise silent
        try:
            return snapshot, *_judge(request, config, choice, snapshot, spell)
        except (UsageError, ImpossibleRequest) as exc:
            if (
                not snapshot.unanswered
                or isinstance(exc, StuckBehind)
                or exc.message.startswith(OVER_LIMIT)
                # Not even every GPU there is could serve it.
                or len(snapshot.gpus) + len(snapshot.unanswered) < request.gpus
            ):
                raise
            # A GPU that did not answer this time may be the one the request needs (named by
            # CUDA_VISIBLE_DEVICES or --devices, or one of --gpus N): refused now, a hiccup of
            # the driver would end the launch. Retried as a failed reading is.
            which = ", ".join(str(i) for i in snapshot.unanswered)
            raise BackendUnavailable(
                f"GPU {which} did not answer, and without it {exc.message}", hint=exc.hint
            ) from None

    snapshot, job, choice = _read_gpus(read_and_judge, config, reporter, counted_from)
    if around.outer_id:
        # Inside a job, refused before it queues. A pipeline's stages are looked at by the
        # waiting loop, where one has to wait (a launch that fits at once pays nothing).
        stuck = stuck_behind(job, _ledger(config).read(), snapshot.gpus, config.wait.safety, around)
        if stuck is not None:
            raise StuckBehind(stuck, hint=STUCK_HINT)
    job, warnings = _with_run_times(
        job, config, choice.learned, snapshot, request.command, request.key
    )
    for message in warnings:
        reporter.warn(message)
    return job, choice


def _capped(
    choice: RequestChoice,
    request: RunRequest,
    config: RunConfig,
    snapshot: MachineSnapshot,
    candidates: list[str] | None,
) -> RequestChoice:
    """`choice` capped to what the cards the job may have give (history.learn.cap_to_cards)."""
    return cap_to_cards(
        choice,
        snapshot.gpus,
        candidates,
        config.wait.safety,
        request.gpus,
        _max_vram(config),
        requirements=requirements_of(request.requirements),
    )


def _max_vram(config: RunConfig) -> int | None:
    """The site's per-user VRAM limit (user_max_vram), which a learned size is capped at."""
    limits = config.wait.fair.limits
    return None if limits is None else limits.max_vram


def _judge(
    request: RunRequest,
    config: RunConfig,
    choice: RequestChoice,
    snapshot: MachineSnapshot,
    spell: Callable[[str], str],
) -> tuple[Job, RequestChoice]:
    """The job on these GPUs and its request capped to them; UsageError or ImpossibleRequest
    where the GPUs read cannot serve it (its hint naming options as `spell` does)."""
    candidates = _candidates(request, snapshot)
    choice = _capped(choice, request, config, snapshot, candidates)
    job = _new_job(request, config, choice, snapshot, candidates)
    impossible = impossible_reason(
        claim_of(job, snapshot.gpus), snapshot.gpus, config.wait.safety, config.wait.fair.limits
    )
    if impossible is not None:
        from gpuwait.core.devices import none_usable

        if impossible == NO_CANDIDATE and (nothing := none_usable(snapshot)) is not None:
            # Not for want of a card of the right kind: the machine has none to offer.
            why, hint = nothing
            raise NoGpuTakesJobs(why, hint=hint)
        claim = claim_of(job, snapshot.gpus)
        # Raising safety helps only a request some card would hold whole: 1 is the most.
        raising = impossible_reason(claim, snapshot.gpus, 1.0, config.wait.fair.limits) is None
        hint = impossible_hint(impossible, job.requirements_for_policy(), spell, raising)
        raise ImpossibleRequest(impossible, hint=hint + _left_by_inherited(request, snapshot))
    return job, choice


def _left_by_inherited(request: RunRequest, snapshot: MachineSnapshot) -> str:
    """What to add to the hint of a request that can never fit where the CUDA_VISIBLE_DEVICES
    gpuwait was started with (a Slurm allocation's, a container's) leaves it some of the GPUs
    only: --devices and --gpu-name choose among those, and cannot reach the others."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is None or request.devices is not None or not snapshot.gpus:
        return ""
    visible = _candidates(request, snapshot)
    if visible is None or len(visible) >= len(snapshot.gpus):
        return ""
    where = (
        ": ask Slurm for others (sbatch or srun --gres=gpu:N, or --gpus=N)"
        if "SLURM_JOB_ID" in os.environ
        else ""
    )
    return (
        f"; CUDA_VISIBLE_DEVICES={inherited} leaves gpuwait {len(visible)} of this machine's "
        f"{len(snapshot.gpus)} GPUs{where}"
    )


def cli_option(name: str) -> str:
    """How the command line names an option in a hint: `--min-total-vram`."""
    return "--" + name.replace("_", "-")


def impossible_hint(
    reason: str,
    requirements: Requirements,
    spell: Callable[[str], str],
    raising: bool = True,
) -> str:
    """What would help a request that can never fit, by why it cannot (`reason`, from
    impossible_reason), its options named as the caller names them (`spell`); `raising`: would
    a higher safety let it fit (False: one larger than any card, whatever the safety)."""
    asked = [
        spell(name)
        for name, value in (
            ("gpu_name", requirements.name_pattern),
            ("min_total_vram", requirements.min_total_bytes),
            ("min_compute_capability", requirements.min_compute_capability),
        )
        if value is not None
    ]
    relax = f"change or leave out {' and '.join(asked)} (`gpuwait status` lists the GPUs)"
    if reason.startswith(OVER_LIMIT):
        # Nothing about the cards would help: the site's limit is on the request itself.
        return f"ask for less ({spell('vram')}) or fewer GPUs ({spell('gpus')}): the limit is the site's"
    reopen = (
        "have an administrator set the card's compute mode back to default (nvidia-smi -c DEFAULT)"
    )
    if reason.startswith(NO_CANDIDATE):
        # Cards in prohibited mode, or none left by --devices and CUDA_VISIBLE_DEVICES.
        return f"use other GPUs ({spell('devices')}), or {reopen}"
    # Cards in prohibited mode that would serve it, named at the reason's end.
    shut = f", or {reopen}" if PROHIBITED_NOTE in reason else ""
    if reason.startswith(NO_MATCH):
        return relax + shut
    if TOO_FEW in reason:
        fewer = f"ask for fewer GPUs ({spell('gpus')})"
        matching_fewer = " match" in reason.split(TOO_FEW, 1)[1]  # not "can be used"
        return (f"{fewer}, or {relax}" if asked and matching_fewer else fewer) + shut
    # A share past what the safety factor leaves of any card (`--vram 100%`): most often a
    # whole GPU is meant, which is what --exclusive gives.
    share = reason.partition(" can never fit")[0].endswith("% of a GPU")
    whole = (
        f"for a whole GPU, {spell('exclusive')} in place of {spell('vram')}; else " if share else ""
    )
    safety = (
        f" raise safety ({spell('safety')}, or `safety =` in the config file)," if raising else ""
    )
    return (
        f"{whole}ask for less ({spell('vram')}),{safety} or use other GPUs "
        f"({spell('devices')}, {spell('gpu_name')}){shut}"
    )


def _attempt(
    request: RunRequest,
    config: RunConfig,
    reporter: Reporter,
    backend: Backend,
    choice: RequestChoice,
    requeued: Job | None = None,
    retries: int = 0,
    stepped_aside: _SteppedAside | None = None,
    launched: float | None = None,
) -> _Ended:
    """One run of the command: submitted and waited for, or, `requeued`, an entry queued again
    after running out of memory (`retries` made so far) that waits for its turn again, having
    stepped aside before as `stepped_aside` says. Its --timeout counts from `launched` (the
    boot clock), else from when it asks to queue."""
    around = Surroundings()
    if requeued is not None:
        ledger, job, counted_from = _ledger(config, reporter), requeued, None
        before = stepped_aside
    else:
        before = None
        try:
            job, choice = prepare_job(
                request,
                config,
                reporter,
                backend,
                choice,
                spell=cli_option,
                around=around,
                counted_from=launched,
            )
        except (StuckBehind, NoGpuTakesJobs) as exc:
            if not request.from_hook or (
                isinstance(exc, NoGpuTakesJobs) and config.on_no_gpu != "run"
            ):
                raise
            return _Ended(_bare_for_the_hook(request, reporter, exc.message))

        # From here on, signals queue up for the waiting loop instead of killing gpuwait midway.
        signals.block_handled()
        ledger = _ledger(config, reporter)
        counted_from = proc.boot_clock() if launched is None else launched
        try:
            deadline = None if config.timeout is None else counted_from + config.timeout
            with ledger.lock_deadline(deadline):
                job = submit(ledger, job, request, config)
        except LockPastDeadline as exc:
            # Not queued: another process kept the ledger's lock all through the --timeout.
            reporter.error(gave_up(proc.boot_clock() - counted_from, exc.message))
            return _Ended(EXIT_TIMEOUT)
        except StateError as exc:
            if config.on_state_error != "run":
                raise
            signals.unblock_all()
            reporter.warn(
                f"{exc.message}; running the command without coordination (on_state_error = run)"
            )
            return _Ended(run_bare(request.command))
        _show_warnings(ledger, reporter)
    return _wait_and_run(
        request,
        config,
        reporter,
        backend,
        choice,
        ledger,
        job,
        around,
        retries,
        before,
        counted_from,
    )


def gave_up(waited_seconds: float, why: WaitReason | str | None) -> str:
    """What a wait that ran out of its --timeout ends with, the command line's and reserve()'s
    alike: how long it waited in all and, where known, what for (the policy's reason, or who
    kept the ledger's lock all the while)."""
    if isinstance(why, WaitReason):
        why = why.describe()
    said = f" ({why})" if why else ""
    return f"gave up after waiting {format_duration(waited_seconds)}{said}"


def _wait_and_run(
    request: RunRequest,
    config: RunConfig,
    reporter: Reporter,
    backend: Backend,
    choice: RequestChoice,
    ledger: Ledger,
    job: Job,
    around: Surroundings,
    retries: int,
    before: _SteppedAside | None = None,
    counted_from: float | None = None,
) -> _Ended:
    """Wait for the job's turn and run it, again each time it steps aside; `before`: what its
    earlier attempts' runs that stepped aside count for (a retry goes on from the checkpoint).
    The first wait's --timeout counts from `counted_from` (the boot clock: the launch, or
    when it asked to queue), else from its start."""
    before = before or _SteppedAside()
    #: The wait before the first start, and the waits after stepping aside (what pausing cost).
    queued_seconds: float | None = None
    paused_seconds = before.paused_seconds
    #: The run time of the runs that ended stepping aside, and their peak (see _Earlier).
    paused_runs_seconds = before.runs_seconds
    earlier = before.earlier
    #: How the waiting line names the job, where several wait in one terminal.
    label = job.name or job.id
    #: Records the last run that stepped aside, where the job leaves without running again.
    unrecorded: Callable[[Job, float], None] | None = None
    while True:
        timeout = config.timeout
        waited_from = time.monotonic()
        # The timeout counts a suspend (see wait_for_admission); the wait learned does not.
        waited_from_boot = proc.boot_clock()

        def said(reason: WaitReason) -> None:
            # The ledger's warnings from the wait so far (a damaged file, an ignored edit) come
            # first; the line says where a request without --vram came from.
            _show_warnings(ledger, reporter)
            if choice.note:
                reason = reason._replace(source=choice.note)
            reporter.waiting(reason, label)

        # --timeout bounds each attempt's first wait only: a paused job always comes back, and
        # a retry after running out of memory waits at most that long again.
        timed_from = waited_from_boot if counted_from is None else counted_from
        deadline = None if timeout is None or queued_seconds is not None else timed_from + timeout
        #: Why it timed out, where another process kept the ledger's lock past the deadline.
        locked_out: str | None = None
        try:
            with ledger.lock_deadline(deadline):
                job, outcome = wait_for_admission(
                    ledger,
                    backend,
                    job,
                    config.wait,
                    deadline=deadline,
                    on_reason=said,
                    around=around,
                )
        except LockPastDeadline as exc:
            outcome, locked_out = TimedOut(None), exc.message
        except BaseException:
            resumed_wait = time.monotonic() - waited_from if queued_seconds is not None else 0.0
            paused = _pauses_so_far(job, paused_seconds + resumed_wait)
            _finish(ledger, job, INTERRUPTED, reporter, paused=paused)
            if unrecorded is not None:
                unrecorded(job, paused_seconds + resumed_wait)
            raise
        finally:
            reporter.waited()
            _show_warnings(ledger, reporter)
        wait_seconds = time.monotonic() - waited_from
        waited_in_all = proc.boot_clock() - timed_from
        # Where it leaves the queue waiting to resume: how often it stepped aside, and how long.
        paused = _pauses_so_far(
            job, paused_seconds + (wait_seconds if queued_seconds is not None else 0.0)
        )
        if unrecorded is not None and not isinstance(outcome, Admitted):
            # It never runs again: the run that stepped aside is its last, recorded as any
            # run that was stopped.
            unrecorded(job, paused_seconds + wait_seconds)
        if isinstance(outcome, TimedOut):
            with ledger.lock_deadline(deadline):
                _finish(ledger, job, TIMED_OUT, reporter, paused=paused)
            reporter.error(gave_up(waited_in_all, locked_out or outcome.reason))
            return _Ended(EXIT_TIMEOUT)
        if isinstance(outcome, Interrupted):
            # Leaving the queue must not keep a TERM or Ctrl-C waiting for the ledger lock: a
            # process holding it longer than LEAVE_PATIENCE costs this entry, which is reaped
            # once gpuwait is gone.
            if _asks_to_checkpoint(job, outcome.signum):
                return _leave_to_checkpoint(
                    ledger, job, reporter, config.resume_exit, "still waiting", paused=paused
                )
            signals.keep_pending(outcome.signum)
            _finish(ledger, job, INTERRUPTED, reporter, paused=paused)
            # Ended by the signal, as the command would have been: a shell stops its script on a
            # child that Ctrl-C killed (not on one that exited 130), systemd counts a TERM
            # death as a clean stop.
            return _Ended(-outcome.signum)
        if isinstance(outcome, Cancelled):
            # `gpuwait cancel` already took the entry out and recorded the outcome.
            by = outcome.by_uid
            someone = "" if by is None or by == job.uid else f" by uid {by}"
            reporter.info(f"job {job.id} cancelled while waiting{someone}")
            return _Ended(EXIT_CANCELLED)
        if isinstance(outcome, DependencyFailed):
            reporter.error(f"job {job.id} will not start: {outcome.message}")
            return _Ended(EXIT_DEPENDENCY_FAILED)
        if isinstance(outcome, Stuck):
            _finish(ledger, job, INTERRUPTED, reporter, paused=paused)
            if request.from_hook:
                signals.unblock_all()  # as the command would have them bare
                return _Ended(_bare_for_the_hook(request, reporter, outcome.reason))
            raise StuckBehind(outcome.reason, hint=STUCK_HINT)
        if queued_seconds is None:
            queued_seconds = wait_seconds
        else:
            paused_seconds += wait_seconds
        try:
            job, ended = _start(
                request,
                config,
                reporter,
                backend,
                ledger,
                outcome,
                wait_seconds,
                choice,
                queued_seconds,
                paused_seconds,
                may_retry=retries < request.retry_oom,
                paused_runs_seconds=paused_runs_seconds,
                earlier=earlier,
            )
        except CommandProblem:
            # Its command could not start again (its script removed meanwhile, say).
            if unrecorded is not None:
                unrecorded(job, paused_seconds)
            raise
        if not ended.paused:
            if not ended.started and unrecorded is not None:
                unrecorded(job, paused_seconds)
            return ended
        unrecorded = ended.record
        paused_runs_seconds += ended.run_seconds
        earlier = _Earlier.of(earlier, ended.peak)
        reporter.info(f"job {job.id} checkpointed and stepped aside; it waits to resume")


def _pauses_so_far(job: Job, paused_seconds: float) -> tuple[int, float] | None:
    """A --pausable job's pauses and the time it spent stepped aside (`paused_seconds`), as
    its `finish` or `leave` says them; None for any other job."""
    return (job.pauses, paused_seconds) if job.pausable else None


def _checkpoint_signals(request: RunRequest) -> tuple[int, ...]:
    """A --pausable request's checkpoint signal (none where it names none that parses)."""
    if request.pausable is None:
        return ()
    from gpuwait.linux.checkpoint_signal import parse_signal

    try:
        return (parse_signal(request.pausable.checkpoint_signal),)
    except ValueError:
        return ()


def _asks_to_checkpoint(job: Job, signum: int) -> bool:
    """Is `signum`, taken while `job` waits, the checkpoint signal of a --pausable job?"""
    if not job.pausable:
        return False
    from gpuwait.linux.checkpoint_signal import parse_signal

    try:
        return parse_signal(job.checkpoint_signal) == signum
    except ValueError:
        return False


#: What to do where a job would wait behind one that ends only after it.
STUCK_HINT = (
    "run this command without gpuwait (it shares that job's GPUs), or start the other one"
    " without it (`command python ...`, or GPUWAIT_DISABLE=1 for the shell hook)"
)


def _bare_for_the_hook(request: RunRequest, reporter: Reporter, why: str) -> int:
    """The shell hook's answer to a job that would wait for ever: run it bare, as the hook runs
    a command inside a gpuwait job (it is part of that job's work, or of its pipeline); and,
    where on_no_gpu = run, to a machine with no GPU that takes a job (each in MIG mode)."""
    reporter.warn(f"{why}; the shell hook runs it bare")
    return run_bare(request.command)


def _leave_to_checkpoint(
    ledger: Ledger, job: Job, reporter: Reporter, resume_exit: int, when: str, **how: Any
) -> _Ended:
    """A --pausable job asked to checkpoint before its command started: Slurm's warning before
    the time limit (--signal=B:USR1@N) may come while the job still waits, or while its
    command cannot start yet. Nothing started, nothing to save; the resume status tells the
    batch script to requeue it, as after a checkpoint."""
    _finish(ledger, job, INTERRUPTED, reporter, **how)
    reporter.info(
        f"job {job.id} asked to checkpoint while {when}; it leaves the queue with the "
        f"resume status {resume_exit}, to be started again later"
    )
    return _Ended(resume_exit)


def _finish(ledger: Ledger, job: Job, outcome: str, reporter: Reporter, **how: Any) -> None:
    """lifecycle.finish, for a process that is about to end: a failure is only said, since the
    entry is reaped by the next gpuwait anyway."""
    try:
        with ledger.leaving():
            lifecycle.finish(ledger, job, outcome, **how)
    except (signals.SignalPending, LockPastDeadline):
        # Ending because of a signal, or at its --timeout (which says who holds the lock): the
        # entry is reaped once this process is gone, as it ended, by the word left of it.
        lifecycle.leave_word(ledger, job, outcome, **how)
    except Exception as exc:
        reporter.warn(str(exc))


def _ended_run(ledger: Ledger, job: Job, outcome: str, reporter: Reporter, **how: Any) -> None:
    """_finish for a run that has ended, its gpuwait about to end too: where another process
    keeps the ledger's lock longer than LEAVE_PATIENCE, the run's end does not wait for it (a
    minute of lock_timeout before the prompt came back); the entry is left, with word of how
    the run ended, for the next gpuwait to reap as it ended once this one is gone."""
    try:
        with ledger.leaving(), ledger.lock_wait(LEAVE_PATIENCE):
            lifecycle.finish(ledger, job, outcome, **how)
    except (signals.SignalPending, LockBusy) as exc:
        if not lifecycle.leave_word(ledger, job, outcome, **how) and isinstance(exc, LockBusy):
            reporter.warn(exc.message)
    except Exception as exc:
        reporter.warn(str(exc))


#: The columns a line of -v fills at most: an 80-column terminal shows it on one row.
VERBOSE_COLUMNS = 79


def _phrase_lines(text: str, lead: int) -> list[str]:
    """`text` as lines that each fit VERBOSE_COLUMNS after `lead` columns, broken after a
    comma or a semicolon; a phrase longer than that begins a line and is broken between its
    words, never inside parentheses ("(other arguments)")."""
    lines: list[str] = []
    for phrase in re.split(r"(?<=[,;]) ", text) if text else []:
        if lines and lead + columns(f"{lines[-1]} {phrase}") <= VERBOSE_COLUMNS:
            lines[-1] = f"{lines[-1]} {phrase}"
            continue
        words = re.split(r" (?![^(]*\))", phrase)
        lines.append(words[0])
        for word in words[1:]:
            if lead + columns(f"{lines[-1]} {word}") <= VERBOSE_COLUMNS:
                lines[-1] = f"{lines[-1]} {word}"
            else:
                lines.append(word)
    return lines


def _start(
    request: RunRequest,
    config: RunConfig,
    reporter: Reporter,
    backend: Backend,
    ledger: Ledger,
    admitted: Admitted,
    wait_seconds: float,
    choice: RequestChoice,
    queued_seconds: float,
    paused_seconds: float,
    may_retry: bool = False,
    paused_runs_seconds: float = 0.0,
    earlier: _Earlier | None = None,
) -> tuple[Job, _Ended]:
    job = admitted.job
    chosen = list(admitted.gpus)
    env = command_env(job, chosen, config.resume_exit, by_index=config.visible_by_index)
    held = budget.prepare(config.enforce, job, chosen, request.command, env)
    drop_inherited(env, held.plan.unset)
    env.update(held.plan.env)
    env.update(container_copies(held.plan.env))
    for message in (held.plan.fallback, held.problem):
        _say_once(reporter, message)
    if request.verbose:
        where = ", ".join(f"GPU{g.index}" for g in chosen)
        each = reserved_on_each(job, chosen) or format_size(job.reserved_bytes)
        reporter.info(
            f"job {job.id} starts on {where} after {format_duration(wait_seconds)}, {each} reserved"
        )
        # Where the size came from on lines of its own: after the size, in parentheses, it
        # made the line 111 columns and more.
        for line in _phrase_lines(choice.note or "", columns(f"gpuwait: job {job.id}: ")):
            reporter.info(f"job {job.id}: {line}")
        # Each UUID on a line of its own: with it, the line above took 108 columns.
        for gpu in chosen:
            reporter.info(f"job {job.id}: GPU{gpu.index} is {gpu.uuid}")
    started_at = time.time()
    watch = StderrWatch(enabled=config.watch_stderr)
    name = request.command[0]
    # In the group before the command: a signal sent to the whole group once the command is
    # there (while gpuwait still records it in the ledger, say) is one the witness shows too,
    # and the command does not get it twice.
    witness = signals.GroupWitness()

    def short_of_processes(exc: OSError) -> list[tuple[int, int, int]]:
        reporter.warn(
            f"{name} cannot start yet: {exc.strerror} (too many processes, ulimit -u, or too "
            f"little memory); trying again for up to {format_duration(START_RETRY_SECONDS)}"
        )
        # The stderr relay and the witness are processes too: the command comes first.
        watch.give_up()
        witness.close()
        return watch.file_actions()

    try:
        with held.spawning():
            child = spawn_when_possible(
                request.command, env, watch.file_actions(), short_of_processes, witness
            )
    except StartInterrupted as exc:
        witness.close()
        held.close()
        watch.abandon()
        if _asks_to_checkpoint(job, exc.signum):
            return job, _leave_to_checkpoint(
                ledger, job, reporter, config.resume_exit, "its command could not start yet"
            )._replace(started=False)
        # Ended by the signal, as while waiting (and as the command would have been).
        signals.keep_pending(exc.signum)
        _finish(ledger, job, INTERRUPTED, reporter, paused=_pauses_so_far(job, paused_seconds))
        return job, _Ended(-exc.signum, started=False)
    except OSError as exc:
        witness.close()
        held.close()
        watch.abandon()
        code = EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_NOT_EXECUTABLE
        paused = _pauses_so_far(job, paused_seconds)
        _finish(ledger, job, FAILED, reporter, exit_status=code, paused=paused)
        tried = (
            ""
            if exc.errno not in SHORT_OF_PROCESSES
            else f" (tried for {format_duration(START_RETRY_SECONDS)})"
        )
        raise CommandProblem(f"{name}: {exc.strerror}{tried}", code) from None
    watch.started()
    _say_once(reporter, held.problem)
    recorded = True
    try:
        job = lifecycle.started(ledger, job, child, held.plan.held_by)
    except Exception as exc:  # the command is running: never abandon it over bookkeeping
        reporter.warn(str(exc))
        # Recorded by the first sample the ledger takes: until then, a gpuwait killed would
        # leave an entry that names no command, reaped while its command runs in its room.
        job = job._replace(
            child_pid=child,
            child_start_time=proc.start_time(child),
            pids=[child],
            held_by=list(held.plan.held_by),
        )
        recorded = False
    responder: PauseResponder | FreezeResponder | None = None
    if job.pausable:
        # Here, not at the top: only a --pausable job's launch pays for the pausing machinery.
        from gpuwait.runner.paused import PauseResponder

        responder = PauseResponder(ledger, job)
    elif job.freezable:
        from gpuwait.runner.frozen import FreezeResponder

        responder = FreezeResponder(ledger, job, backend, config.wait, reporter)
    result = supervise(
        child,
        job,
        ledger,
        backend,
        config.sample_interval,
        baseline_used={g.uuid: g.used_bytes for g in chosen},
        responder=responder,
        margin=config.estimate_margin,
        baseline_pids={g.uuid: frozenset(p.pid for p in g.processes) for g in chosen},
        warn=reporter.warn,
        recorded=recorded,
        started_at=started_at,
        witness=witness,
    )
    held.close()
    said_oom = watch.finish()
    if watch.scanner.numbers and result.returncode != 0 and not config.visible_by_index:
        _say_once(
            reporter,
            "the command read CUDA_VISIBLE_DEVICES as numbers and stopped at a GPU UUID; "
            "visible_devices = index (GPUWAIT_VISIBLE_DEVICES=index) gives it NVML indices "
            "(docs/usage.md)",
        )
    _say_left_behind(reporter, backend, job, result.pids_seen - {child})
    code = result.returncode
    given_up = getattr(responder, "given_up", None)
    if given_up is not None:
        # Frozen, its memory could not come back (docs/freezing.md): its command was ended.
        _ended_run(
            ledger,
            job,
            FAILED,
            reporter,
            exit_status=code if code >= 0 else None,
            signal=-code if code < 0 else None,
            run_seconds=result.run_seconds,
        )
        raise given_up
    # Its run time leaves out any time it was frozen, its room another job's: not charged.
    vram_seconds = job.reserved_in_all() * result.run_seconds
    # Stopped meanwhile (gpuwait cancel, Ctrl-C, a service stopped), or sent the checkpoint
    # signal itself (Slurm's warning before the time limit), a job that checkpointed ends with
    # the resume status, as it would bare, rather than queue to run again.
    stopped = result.checkpoint_asked or (
        result.stopped_by is not None and result.stopped_by != getattr(responder, "signum", None)
    )
    if result.paused and code == config.resume_exit and not stopped:
        ran = job
        job = lifecycle.step_aside(
            ledger, job, result.run_seconds, (vram_seconds, config.wait.fair.half_life)
        )
        peaks, approximate = result.peaks()
        peak = max(peaks.values()) if peaks else None

        def record(left: Job, paused_in_all: float) -> None:
            _record(
                request,
                config,
                reporter,
                # Its pauses as they are now, and what this run had reserved: stepped aside,
                # or admitted again, the job holds nothing of it, or another run's room.
                left._replace(
                    reserved_bytes=ran.reserved_bytes, reserved_by_gpu=ran.reserved_by_gpu
                ),
                chosen,
                result,
                queued_seconds,
                started_at,
                choice,
                None,
                watch.mode,
                paused_in_all,
                held.plan,
                paused_runs_seconds=paused_runs_seconds,
                earlier=earlier,
            )

        return job, _Ended(
            code,
            paused=True,
            run_seconds=result.run_seconds,
            peak=(peak, approximate),
            record=record,
        )
    card_full = any(
        near_full(result.free_at_peak_bytes.get(u), total)
        for u, total in result.total_bytes.items()
    )
    peaks, _ = result.peaks()
    # Only where stderr was not watched (a terminal): a watched job that ran out said so, and
    # one that failed without saying it did not run out, however close to its limit it held.
    # Nor for a command that sizes itself from its reservation: it holds all of it by design.
    # Each card against its own limit: on cards of different sizes, less on the smaller.
    at_limit = (
        said_oom is None
        and held.plan.enforced
        and not sizes_itself(request.command)
        and any(near_limit(peak, job.reserved_on(uuid)) for uuid, peak in peaks.items())
    )
    # A run stopped (gpuwait cancel, Ctrl-C, a service stopped) ended by being asked to, not
    # for want of memory, however full its card was; and it is not run again.
    oom = looks_like_oom(code, bool(said_oom), (card_full or at_limit) and not stopped)
    retried = oom and not stopped
    cause = oom_cause(held.plan.enforced, card_full) if oom else None
    evidence = "message" if said_oom else "card full" if card_full else "at its limit"
    how: dict[str, Any] = {
        "exit_status": code if code >= 0 else None,
        "signal": -code if code < 0 else None,
        "run_seconds": result.run_seconds,
        "charge_usage": (vram_seconds, config.wait.fair.half_life),
        "paused": _pauses_so_far(job, paused_seconds),
        "oom": cause,
    }
    pending = retried and may_retry
    if not pending:
        _ended_run(ledger, job, OK if code == 0 else FAILED, reporter, **how)
    _record(
        request,
        config,
        reporter,
        job,
        chosen,
        result,
        queued_seconds,
        started_at,
        choice,
        (cause, evidence) if cause else None,
        watch.mode,
        paused_seconds,
        held.plan,
        paused_runs_seconds=paused_runs_seconds,
        earlier=earlier,
        oom_wanted=watch.scanner.wanted_bytes if cause and said_oom else None,
        ends_on_signal=not pending,
    )
    reserved_each = reserved_on_each(job, chosen)
    if pending:
        return job, _Ended(
            result.returncode,
            oom,
            job.reserved_bytes,
            cause,
            pending=job,
            finish_how=how,
            reserved_each=reserved_each,
            stepped_aside=_SteppedAside(paused_seconds, paused_runs_seconds, earlier),
        )
    return job, _Ended(
        result.returncode, retried, job.reserved_bytes, cause, reserved_each=reserved_each
    )


def _say_left_behind(
    reporter: Reporter, backend: Backend, job: Job, started: AbstractSet[int]
) -> None:
    """Name the processes the command started that still hold memory on its GPUs now that it
    has ended (a server or worker it did not end): from now on in no reservation."""
    if not started:
        return
    try:
        gpus = [g for g in backend.snapshot().gpus if g.uuid in job.gpu_uuids]
    except Exception:  # a failing reading must never fail a finished run
        return
    held = [
        f"pid {p.pid} ({format_size(p.used_bytes)} on GPU {g.index})"
        for g in gpus
        for p in g.processes
        if p.pid in started and p.used_bytes and proc.is_alive(p.pid, None)
    ]
    if held:
        reporter.warn(
            "the command ended, but processes it started still hold GPU memory, in no "
            "reservation now: " + ", ".join(held)
        )


class _Earlier(Record, frozen=True):
    """The peak of a job's runs that ended stepping aside: what is left of its work after a
    resume may take less memory than what it did before, and the next run of the command does
    it all. None: some run's peak is unknown, and so is the job's."""

    peak: int | None
    approximate: bool

    @classmethod
    def of(cls, before: _Earlier | None, run: tuple[int | None, bool]) -> _Earlier:
        """`before` with one more run's (peak, approximate)."""
        peak, approximate = run
        if before is None:
            return cls(peak, approximate)
        if before.peak is None or peak is None:
            return cls(None, False)
        return cls(max(before.peak, peak), before.approximate or approximate)

    def with_last(self, peaks: dict[str, int], approximate: bool) -> tuple[dict[str, int], bool]:
        """The last run's peaks per GPU and their approximation, made those of all the runs. Only
        single-GPU jobs are paused: an earlier peak is one on the GPU the last run had."""
        if self.peak is None or not peaks:
            return {}, False  # unknown: too small a figure would size the next run too small
        if len(peaks) != 1:
            return peaks, approximate
        ((uuid, last),) = peaks.items()
        if self.peak <= last:
            return peaks, approximate
        return {uuid: self.peak}, self.approximate


class _SteppedAside(Record, frozen=True):
    """A job's runs that ended stepping aside, as its next record counts them: the time it
    waited to resume, their run time and their peak. A retry after running out of memory goes
    on from their checkpoint, so the run that succeeds did their work and its own."""

    paused_seconds: float = 0.0
    runs_seconds: float = 0.0
    earlier: _Earlier | None = None


#: Notes already said by this gpuwait (a retried or resumed job says each once).
_SAID: set[str] = set()


def _say_once(reporter: Reporter, message: str | None) -> None:
    if message and message not in _SAID:
        _SAID.add(message)
        reporter.warn(message)


def _record(
    request: RunRequest,
    config: RunConfig,
    reporter: Reporter,
    job: Job,
    chosen: Sequence[GpuSnapshot],
    result: RunResult,
    wait_seconds: float,
    started_at: float,
    choice: RequestChoice,
    oom: tuple[str, str] | None,
    stderr_watched: str,
    paused_seconds: float,
    held: Budget,
    exit_known: bool = True,
    paused_runs_seconds: float = 0.0,
    earlier: _Earlier | None = None,
    oom_wanted: int | None = None,
    ends_on_signal: bool = True,
) -> None:
    """Leave the run's record in the history (`exit_known` False: a reservation's process
    that ended with a status nothing could see, recorded as None).

    A signal asking gpuwait to end (TERM, INT, HUP, QUIT) that comes while another process
    holds the history lock, held LEAVE_PATIENCE after it still, ends gpuwait by it
    (SignalPending); `ends_on_signal` False, only the record is given up, and said: the run
    ran out and may be retried, which the signal, left pending, stops. Another (USR1, ALRM),
    the command's to take, leaves the record to wait for the lock as it would without it.

    `oom`: how an out-of-memory failure came about and how it was told ("message", "card
    full"); None for a run that did not run out. `oom_wanted`: what its message said it
    needed at the least. `wait_seconds` is the wait before the first
    start; a --pausable job's record also says how often it stepped aside and how long it then
    waited to resume (`paused_seconds`); its peak is that of all its runs (`earlier`: those
    that ended stepping aside)."""
    peaks, approximate = result.peaks()
    if earlier is not None:
        peaks, approximate = earlier.with_last(peaks, approximate)
    record = run_record.build(
        job_id=job.id,
        name=job.name,
        batch=job.batch,
        # Whole, as the launch looked it up: the entry's may be cut short.
        command=request.command,
        shown=job.command,
        cwd=job.cwd,
        key=request.key,
        history_commands=config.history_commands,
        request=job.request,
        request_source=choice.source,
        reserved_bytes=job.reserved_bytes,
        reserved_by_gpu=job.reserved_by_gpu,
        gpus=chosen,
        measured=run_record.Measured(
            peak_by_gpu=peaks,
            peak_approximate=approximate,
            time_to_peak=result.time_to_peak(),
            samples=result.samples,
            free_at_peak_bytes=result.free_at_peak_bytes,
            run_seconds=result.run_seconds,
            returncode=result.returncode if exit_known else None,
            oom=oom is not None,
            oom_evidence=None if oom is None else oom[1],
            oom_cause=None if oom is None else oom[0],
            oom_wanted_bytes=None if oom is None else oom_wanted,
            stderr_watched=stderr_watched,
            stopped_by=result.stopped_by,
        ),
        held=held,
        wait_seconds=wait_seconds,
        started_at=started_at,
        pauses=_pauses_so_far(job, paused_seconds),
        margin=config.estimate_margin,
        paused_runs_seconds=paused_runs_seconds,
    )
    try:
        # A signal asking gpuwait to end waits a moment for the lock, as a job leaving the
        # queue does: a record or a compaction holds it for milliseconds, and giving up there
        # loses the run's. Another, the command's to take, costs the record nothing.
        patience = Patience(stop=LEAVE_PATIENCE, other=math.inf)
        warnings = save_record(config.state_dir, record, config.history_max_size, patience)
    except OSError as exc:
        if signals.raised_by_a_handler(exc):
            raise
        # The run itself is over and its status stands; only the record is lost.
        warnings = [f"could not record the run in the history: {exc.strerror or exc}"]
    except signals.SignalPending as exc:
        if ends_on_signal:
            raise
        if isinstance(exc, RecordedThenSignalled):
            warnings = exc.warnings  # the record is written: only the index is behind
        else:
            warnings = [f"could not record the run in the history: {exc}"]
    except MemoryError:
        # The same where memory ran out (a long history compacted under `ulimit -v`): not
        # gpuwait's end, said as before any command ran (cli.entry_point).
        warnings = ["could not record the run in the history: out of memory"]
    for message in warnings:
        reporter.warn(message)
