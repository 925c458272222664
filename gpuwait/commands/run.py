"""The default command: `gpuwait [OPTIONS] [--] COMMAND [ARGS...]`."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpuwait import _events, _output, _proc, _signals
from gpuwait._backend import Backend, open_backend
from gpuwait._bookkeeping import FAILED, INTERRUPTED, OK, TIMED_OUT, Finished
from gpuwait._checkpoint_signal import parse_signal
from gpuwait._config import Settings
from gpuwait._devices import parse_devices_option, parse_inherited_visible
from gpuwait._errors import (
    EXIT_CANCELLED,
    EXIT_DEPENDENCY_FAILED,
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    EXIT_TIMEOUT,
    BackendUnavailable,
    ImpossibleRequest,
    StateError,
    UsageError,
)
from gpuwait._estimate import looks_like_oom, near_full
from gpuwait._fairness import FairShare, charge
from gpuwait._learn import (
    FLAG,
    RequestChoice,
    build_record,
    cap_to_cards,
    choose_request,
    kept_command,
    learn,
    save_record,
)
from gpuwait._ledger import MAX_ENTRIES_PER_UID, RUNNING, WAITING, Job, Ledger, ledger_for
from gpuwait._pause_runtime import PauseResponder, requeue
from gpuwait._pausing import PauseRules
from gpuwait._policy import WaitReason, impossible_reason
from gpuwait._queue import resolve_references
from gpuwait._record import Record
from gpuwait._runtimes import run_time_estimates
from gpuwait._sizes import (
    MemoryRequest,
    format_duration,
    format_size,
    parse_duration,
    parse_request,
    parse_size,
)
from gpuwait._snapshot import GpuSnapshot, MachineSnapshot
from gpuwait._stderrwatch import StderrWatch
from gpuwait._supervise import RunResult, spawn, supervise
from gpuwait._wait import (
    Admitted,
    Cancelled,
    DependencyFailed,
    Interrupted,
    TimedOut,
    wait_for_admission,
)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,99}$")


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """Options of the default command (their defaults are shown from the settings table)."""
    parser.add_argument(
        "--vram",
        metavar="SIZE",
        help="VRAM per GPU: 6G or 6GiB (2^30 bytes), 6GB (10^9), 512M, or 50%% of a card "
        "(default: learned from earlier runs of the command, else default_vram)",
    )
    parser.add_argument(
        "--key",
        metavar="NAME",
        help="name the command for the history: runs with the same --key share their estimate",
    )
    parser.add_argument(
        "--retry-oom",
        type=int,
        default=0,
        metavar="N",
        help="if the command runs out of GPU memory, queue it again up to N times, "
        "with a raised estimate (default: 0)",
    )
    parser.add_argument(
        "--pausable",
        action="store_true",
        help="the command may be asked to checkpoint and step aside for more urgent work; it "
        "is then resumed (see README, 'Cooperative pausing')",
    )
    parser.add_argument(
        "--checkpoint-signal",
        metavar="SIG",
        help="signal asking a --pausable command to checkpoint (default: USR1)",
    )
    parser.add_argument(
        "--grace",
        metavar="DURATION",
        help="how long a --pausable command has to step aside once asked (default: 120s)",
    )
    parser.add_argument(
        "--grace-kill",
        action="store_true",
        help="send TERM to a --pausable command that has not stepped aside after --grace",
    )
    parser.add_argument(
        "--gpus", type=int, default=1, metavar="N", help="number of GPUs, all at once (default: 1)"
    )
    parser.add_argument(
        "--timeout", metavar="DURATION", help="give up waiting after this long, e.g. 30m (exit 124)"
    )
    parser.add_argument(
        "--pick",
        metavar="STRATEGY",
        help="best-fit, most-free, round-robin, least-loaded, weighted or adaptive-throughput",
    )
    parser.add_argument(
        "--devices", metavar="LIST", help="only these GPUs: NVML indices or UUIDs, e.g. 0,2"
    )
    parser.add_argument("--priority", metavar="1-5", help="queue priority, 5 is most urgent")
    parser.add_argument(
        "--safety", metavar="FRACTION", help="fill each GPU up to this fraction of its VRAM"
    )
    parser.add_argument(
        "--exclusive",
        action="store_true",
        help="whole GPUs: no other gpuwait job is admitted there while this one runs",
    )
    parser.add_argument("--name", metavar="NAME", help="name the job (for --after, status, log)")
    parser.add_argument(
        "--batch", metavar="NAME", help="group jobs; status shows the batch's progress as a line"
    )
    parser.add_argument(
        "--after",
        metavar="JOB",
        action="append",
        default=[],
        help="start only after these jobs ended (ids, names or batches; repeat or use commas)",
    )
    parser.add_argument(
        "--after-ok",
        metavar="JOB",
        action="append",
        default=[],
        help="start only after these jobs succeeded; if one fails, give up (exit 6)",
    )
    parser.add_argument(
        "--min-total-vram", metavar="SIZE", help="only GPUs with at least this much VRAM in all"
    )
    parser.add_argument(
        "--gpu-name", metavar="PATTERN", help="only GPUs whose name matches, e.g. A100 or '*H100*'"
    )
    parser.add_argument(
        "--min-compute-capability", metavar="X.Y", help="only GPUs of this CUDA capability or more"
    )
    parser.add_argument(
        "--max-util",
        metavar="PCT",
        help="only GPUs whose recent utilization (mean of several readings) is under PCT",
    )
    parser.add_argument(
        "--ledger", metavar="DIR", help="coordinate through the ledger in DIR (e.g. a shared one)"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="say where and when the command starts"
    )


def settings_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "timeout": args.timeout,
        "pick": args.pick,
        "priority": args.priority,
        "safety": args.safety,
        "ledger_dir": args.ledger,
    }


def _check_command(argv: Sequence[str]) -> str:
    """The executable `argv[0]` resolves to; raises with exit 127/126 otherwise."""
    name = argv[0]
    if "/" in name:
        if not os.path.exists(name):
            raise _CommandProblem(f"{name}: no such file", EXIT_NOT_FOUND)
        if os.path.isdir(name) or not os.access(name, os.X_OK):
            raise _CommandProblem(f"{name}: not executable", EXIT_NOT_EXECUTABLE)
        return name
    found = _which(name)
    if found is None:
        raise _CommandProblem(f"{name}: command not found", EXIT_NOT_FOUND)
    return found


def _which(name: str) -> str | None:
    """The first executable file `name` in PATH, as shutil.which finds it on POSIX.

    Not shutil itself: importing it (with the compression modules it pulls in) costs more than
    a launch can spare.
    """
    for directory in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(directory or ".", name)
        if os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
    return None


class _CommandProblem(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message, self.code = message, code


def run(args: argparse.Namespace, command: list[str], settings: Settings) -> int:
    if not command:
        raise UsageError("no command given; usage: gpuwait [OPTIONS] [--] COMMAND [ARGS...]")
    if args.gpus < 1:
        raise UsageError(f"--gpus {args.gpus}: ask for at least 1 GPU")
    if args.retry_oom < 0:
        raise UsageError(f"--retry-oom {args.retry_oom}: give 0 or more retries")
    if args.key is not None and not args.key.strip():
        raise UsageError("--key needs a non-empty name")
    given = [
        option
        for option, value in (
            ("--checkpoint-signal", args.checkpoint_signal),
            ("--grace", args.grace),
            ("--grace-kill", args.grace_kill or None),
        )
        if value is not None
    ]
    if given and not args.pausable:
        raise UsageError(f"{given[0]} applies to --pausable jobs only; add --pausable")
    args.checkpoint_signal = args.checkpoint_signal or "USR1"
    args.grace = args.grace or "120s"
    try:
        parse_signal(args.checkpoint_signal)
    except ValueError as exc:
        raise UsageError(f"--checkpoint-signal {exc}") from None
    try:
        args.grace_seconds = parse_duration(args.grace)
    except ValueError as exc:
        raise UsageError(f"--grace {exc}") from None
    choice = _request(args, settings, command)
    requirements = _requirements(args)
    for option, value in (("--name", args.name), ("--batch", args.batch)):
        if value is not None and not _NAME_RE.match(value):
            raise UsageError(
                f"{option} {value!r}: use up to 100 letters, digits and . _ : @ + -, "
                "starting with a letter or digit"
            )
    try:
        _check_command(command)
    except _CommandProblem as problem:
        _output.error(problem.message)
        return problem.code

    try:
        backend = open_backend(settings["sim"] or None, settings["nvml_timeout"])
    except BackendUnavailable as exc:
        if settings["on_no_gpu"] == "fail":
            raise
        if not args.quiet:
            _output.warn(f"{exc.message}; running the command without waiting (on_no_gpu = run)")
        return _exec_bare(command)
    try:
        return _run_with_retries(args, command, settings, backend, choice, requirements)
    finally:
        backend.close()


def _request(args: argparse.Namespace, settings: Settings, command: list[str]) -> RequestChoice:
    if args.exclusive:
        if args.vram is not None:
            raise UsageError("--exclusive takes whole GPUs; leave out --vram")
        return RequestChoice(None, FLAG)
    flag: MemoryRequest | None = None
    if args.vram is not None:
        try:
            flag = parse_request(args.vram)
        except ValueError as exc:
            raise UsageError(f"--vram {exc}") from None
    choice = choose_request(
        flag,
        settings["default_vram"],
        settings.state_dir,
        command,
        os.getcwd(),
        key=args.key,
        margin=settings["estimate_margin"],
    )
    if choice.learned is not None and not args.quiet:
        for message in choice.learned.warnings:
            _output.warn(message)
    return choice


def _run_with_retries(
    args: argparse.Namespace,
    command: list[str],
    settings: Settings,
    backend: Backend,
    choice: RequestChoice,
    requirements: dict[str, Any],
) -> int:
    """Run once; after an out-of-memory failure, queue again with the raised estimate."""
    retries = 0
    while True:
        ended = _run_with_backend(args, command, settings, backend, choice, requirements)
        returncode = ended.returncode
        if not ended.oom or retries >= args.retry_oom:
            break
        retries += 1
        raised = choose_request(
            None,
            settings["default_vram"],
            settings.state_dir,
            command,
            os.getcwd(),
            key=args.key,
            margin=settings["estimate_margin"],
        )
        # Capped as the next attempt will be: a run that already had the largest card
        # cannot be helped by a bigger estimate.
        snapshot = backend.snapshot()
        raised = cap_to_cards(
            raised, snapshot.gpus, _candidates(args, snapshot), settings["safety"]
        )
        after = raised.request.bytes if raised.request is not None else None
        if after is None or after <= ended.reserved_bytes:
            if not args.quiet:
                _output.warn("the command ran out of GPU memory; no larger size to retry with")
            break
        if not args.quiet:
            _output.info(
                f"the command ran out of GPU memory; retrying with {format_size(after)} "
                f"(retry {retries} of {args.retry_oom})"
            )
        choice = raised
    if returncode < 0:
        sys.stdout.flush()
        _signals.die_by_signal(-returncode)
        return 128 - returncode
    return returncode


def _requirements(args: argparse.Namespace) -> dict[str, Any]:
    """The capability options as a ledger entry stores them. Raises UsageError."""
    wanted: dict[str, Any] = {}
    if args.min_total_vram is not None:
        try:
            wanted["min_total_bytes"] = parse_size(args.min_total_vram)
        except ValueError as exc:
            raise UsageError(f"--min-total-vram {exc}") from None
    if args.gpu_name is not None:
        if not args.gpu_name.strip():
            raise UsageError("--gpu-name needs a pattern, e.g. A100 or '*H100*'")
        wanted["name_pattern"] = args.gpu_name.strip()
    if args.min_compute_capability is not None:
        match = re.fullmatch(r"\s*([0-9]{1,2})(?:\.([0-9]{1,2}))?\s*", args.min_compute_capability)
        if match is None:
            raise UsageError(
                f"--min-compute-capability {args.min_compute_capability!r}: use MAJOR.MINOR, e.g. 8.0"
            )
        wanted["min_compute_capability"] = [int(match.group(1)), int(match.group(2) or 0)]
    if args.max_util is not None:
        try:
            percent = float(args.max_util.strip().removesuffix("%"))
        except ValueError:
            percent = -1.0
        if not 0 < percent <= 100:
            raise UsageError(f"--max-util {args.max_util!r}: give a percentage above 0, e.g. 30")
        wanted["max_util_pct"] = percent
    return wanted


def _references(values: list[str]) -> list[str]:
    return [ref.strip() for value in values for ref in value.split(",") if ref.strip()]


def _weights(settings: Settings, snapshot: MachineSnapshot) -> dict[str, float]:
    """gpu_weights with NVML indices turned into UUIDs."""
    by_index = {str(g.index): g.uuid for g in snapshot.gpus}
    weights: dict[str, float] = {}
    for key, weight in settings["gpu_weights"].items():
        if key.isdigit() and key not in by_index:
            raise UsageError(f"gpu_weights names GPU {key}, which is not here")
        weights[by_index.get(key, key)] = weight
    return weights


def _exec_bare(command: list[str]) -> int:
    # Python ignores SIGPIPE for itself; the command must get the default, as from a shell.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        _output.error(f"{command[0]}: {exc.strerror}")
        return EXIT_NOT_EXECUTABLE
    return 0  # pragma: no cover - execvp does not return


def _candidates(args: argparse.Namespace, snapshot: MachineSnapshot) -> list[str] | None:
    candidates: list[str] | None = None
    if args.devices is not None:
        try:
            candidates = parse_devices_option(args.devices, snapshot.gpus)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None:
        visible = parse_inherited_visible(inherited, snapshot.gpus)
        if not visible:
            raise ImpossibleRequest(
                f"CUDA_VISIBLE_DEVICES={inherited!r} makes no GPU visible to this command",
                hint="unset it, or list GPU indices or UUIDs that exist (see gpuwait status)",
            )
        candidates = visible if candidates is None else [u for u in candidates if u in visible]
        if not candidates:
            raise ImpossibleRequest(
                f"--devices {args.devices} names no GPU visible through CUDA_VISIBLE_DEVICES={inherited}"
            )
    return candidates


class _Ended(Record, frozen=True):
    """One attempt: the status to end with (< 0: killed by that signal) and whether it OOMed."""

    returncode: int
    oom: bool = False
    reserved_bytes: int = 0
    #: The command checkpointed on request and is queued again (cooperative pausing).
    paused: bool = False


def _run_with_backend(
    args: argparse.Namespace,
    command: list[str],
    settings: Settings,
    backend: Backend,
    choice: RequestChoice,
    requirements: dict[str, Any],
) -> _Ended:
    snapshot = backend.snapshot()
    for message in snapshot.warnings:
        if not args.quiet:
            _output.warn(message)
    candidates = _candidates(args, snapshot)
    choice = cap_to_cards(choice, snapshot.gpus, candidates, settings["safety"])
    request = choice.request
    now = time.time()
    job = Job(
        id=os.urandom(4).hex(),
        pid=os.getpid(),
        start_time=_proc.start_time(os.getpid()) or 0,
        uid=os.getuid(),
        command=list(command),
        cwd=os.getcwd(),
        request=request.to_json() if request is not None else {},
        gpus=args.gpus,
        candidates=candidates,
        pick=settings["pick"],
        priority=settings["priority"],
        state=WAITING,
        submitted_at=now,
        updated_at=now,
        name=args.name,
        batch=args.batch,
        requirements=requirements,
        weights=_weights(settings, snapshot) if settings["pick"] == "weighted" else {},
        pausable=args.pausable,
        checkpoint_signal=args.checkpoint_signal,
        grace_seconds=args.grace_seconds,
        grace_kill=args.grace_kill,
    )
    fair = FairShare.from_settings(settings)
    impossible = impossible_reason(
        job.claim(snapshot.gpus), snapshot.gpus, settings["safety"], fair.limits
    )
    if impossible is not None:
        raise ImpossibleRequest(
            impossible,
            hint="ask for less (--vram), raise safety, or use other GPUs (--devices, --gpu-name)",
        )
    _estimate(job, settings, snapshot, args.quiet)
    after, after_ok = _references(args.after), _references(args.after_ok)

    # From here on, signals queue up for the waiting loop instead of killing gpuwait midway.
    _signals.block_handled()
    ledger = ledger_for(settings)
    try:
        _submit(
            ledger,
            job,
            after,
            after_ok,
            settings.state_dir,
            kept_command(command, job.cwd, settings["history_commands"]),
        )
    except StateError as exc:
        if settings["on_state_error"] != "run":
            raise
        _signals.unblock_all()
        if not args.quiet:
            _output.warn(
                f"{exc.message}; running the command without coordination (on_state_error = run)"
            )
        return _Ended(_exec_bare(command))
    _show_ledger_warnings(ledger, args.quiet)

    pause_rules = PauseRules(
        min_runtime=settings["pause_min_runtime"], max_pauses=settings["pause_max"]
    )
    #: The wait before the first start, and the waits after stepping aside (what pausing cost).
    queued_seconds: float | None = None
    paused_seconds = 0.0
    while True:
        line = _output.WaitLine(quiet=args.quiet)
        timeout: float | None = settings["timeout"]
        waited_from = time.monotonic()
        try:
            outcome = wait_for_admission(
                ledger,
                backend,
                job,
                safety=settings["safety"],
                poll_interval=settings["poll_interval"],
                nvml_interval=settings["nvml_interval"],
                # --timeout bounds the first wait only: a paused job always comes back.
                deadline=None if timeout is None or job.pauses else waited_from + timeout,
                on_reason=_warnings_first(ledger, args.quiet, _with_note(line.update, choice.note)),
                ignore_processes=frozenset(settings["ignore_processes"]),
                use_inotify=settings["wake"] == "inotify",
                fair=fair,
                pause_rules=pause_rules,
            )
        except BaseException:
            _leave(ledger, job, INTERRUPTED)
            raise
        finally:
            line.clear()
            _show_ledger_warnings(ledger, args.quiet)
        wait_seconds = time.monotonic() - waited_from
        if isinstance(outcome, TimedOut):
            _leave(ledger, job, TIMED_OUT)
            why = f" ({outcome.reason.describe()})" if outcome.reason else ""
            _output.error(f"gave up after waiting {format_duration(wait_seconds)}{why}")
            return _Ended(EXIT_TIMEOUT)
        if isinstance(outcome, Interrupted):
            _leave(ledger, job, INTERRUPTED)
            return _Ended(128 + outcome.signum)
        if isinstance(outcome, Cancelled):
            # `gpuwait cancel` already took the entry out and recorded the outcome.
            if not args.quiet:
                _output.info(f"job {job.id} cancelled while waiting")
            return _Ended(EXIT_CANCELLED)
        if isinstance(outcome, DependencyFailed):
            _output.error(f"job {job.id} will not start: {outcome.message}")
            return _Ended(EXIT_DEPENDENCY_FAILED)
        if queued_seconds is None:
            queued_seconds = wait_seconds
        else:
            paused_seconds += wait_seconds
        ended = _start(
            args,
            command,
            settings,
            backend,
            ledger,
            job,
            outcome,
            wait_seconds,
            choice,
            queued_seconds,
            paused_seconds,
        )
        if not ended.paused:
            return ended
        if not args.quiet:
            _output.info(f"job {job.id} checkpointed and stepped aside; it waits to resume")


def _warnings_first(
    ledger: Ledger, quiet: bool, update: Callable[[WaitReason], None]
) -> Callable[[WaitReason], None]:
    """The ledger's warnings from the wait so far (a damaged file, an ignored edit), then the
    wait line."""

    def show(reason: WaitReason) -> None:
        _show_ledger_warnings(ledger, quiet)
        update(reason)

    return show


def _with_note(
    update: Callable[[WaitReason], None], note: str | None
) -> Callable[[WaitReason], None]:
    """The wait line says where a request without --vram came from."""
    if not note:
        return update
    return lambda reason: update(reason._replace(needed=f"{reason.needed} ({note})"))


def _submit(
    ledger: Ledger,
    job: Job,
    after: list[str],
    after_ok: list[str],
    state_dir: Path,
    logged_command: list[str],
) -> None:
    """Put `job` in the queue, unless its user already has as many entries as one may.

    `logged_command`: the command as the event log keeps it (see history_commands).

    Raises UsageError when an --after reference names no job.
    """
    with ledger.transaction() as data:
        mine = sum(1 for j in data.jobs if j.uid == job.uid)
        if mine >= MAX_ENTRIES_PER_UID:
            raise StateError(
                f"you already have {mine} gpuwait jobs in the ledger, the most one user may",
                hint="wait for some to finish",
            )
        try:
            job.after = resolve_references(after, data, state_dir)
            job.after_ok = resolve_references(after_ok, data, state_dir)
        except ValueError as exc:
            raise UsageError(
                f"--after: {exc}", hint="see `gpuwait status` and `gpuwait log`"
            ) from None
        job.order = data.next_order
        data.next_order += 1
        data.jobs.append(job)
        _events.emit(
            ledger.directory,
            "submit",
            job=job.id,
            name=job.name,
            batch=job.batch,
            priority=job.priority,
            command=logged_command,
        )


def _estimate(job: Job, settings: Settings, snapshot: MachineSnapshot, quiet: bool) -> None:
    """Expected run time from history: for backfill, ETAs and adaptive-throughput."""
    estimates = run_time_estimates(settings.state_dir)
    job.expected_seconds = estimates.expected_seconds(job.command, job.cwd)
    for message in estimates.warnings:
        if not quiet:
            _output.warn(message)
    if job.pausable:
        # Pausing this job costs its reload: waiters weigh it against their own wait.
        try:
            load = learn(settings.state_dir, job.command, job.cwd).load_time
        except Exception:
            load = None
        job.load_seconds = None if load is None else load.median
    if job.pick == "adaptive-throughput":
        for gpu in snapshot.gpus:
            seconds = estimates.expected_seconds(job.command, job.cwd, gpu.uuid)
            if seconds is not None:
                job.expected_by_gpu[gpu.uuid] = seconds


def _start(
    args: argparse.Namespace,
    command: list[str],
    settings: Settings,
    backend: Backend,
    ledger: Ledger,
    job: Job,
    admitted: Admitted,
    wait_seconds: float,
    choice: RequestChoice,
    queued_seconds: float,
    paused_seconds: float,
) -> _Ended:
    chosen = list(admitted.gpus)
    env = dict(os.environ)
    env.update(
        {
            "CUDA_VISIBLE_DEVICES": ",".join(admitted.gpu_uuids),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "GPUWAIT_JOB_ID": job.id,
            "GPUWAIT_GPU_UUIDS": ",".join(admitted.gpu_uuids),
            "GPUWAIT_GPU_INDICES": ",".join(str(g.index) for g in chosen),
            "GPUWAIT_VRAM_BYTES": str(admitted.reserved_bytes),
        }
    )
    if job.pausable:
        env.update(
            {
                "GPUWAIT_PAUSABLE": "1",
                "GPUWAIT_CHECKPOINT_SIGNAL": job.checkpoint_signal.upper().removeprefix("SIG"),
                "GPUWAIT_RESUME_EXIT": str(settings["resume_exit"]),
                "GPUWAIT_RESUME_COUNT": str(job.pauses),
            }
        )
    if args.verbose and not args.quiet:
        where = ", ".join(f"GPU{g.index} ({g.uuid})" for g in chosen)
        note = f" ({choice.note})" if choice.note else ""
        _output.info(
            f"job {job.id} starts on {where} after {format_duration(wait_seconds)}, "
            f"{format_size(admitted.reserved_bytes)} reserved{note}"
        )
    started_at = time.time()
    watch = StderrWatch(enabled=settings["watch_stderr"] != "off")
    try:
        child = spawn(command, env, watch.file_actions())
    except OSError as exc:
        watch.abandon()
        code = EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_NOT_EXECUTABLE
        _leave(ledger, job, FAILED, exit_status=code)
        _output.error(f"{command[0]}: {exc.strerror}")
        return _Ended(code)
    watch.started()
    _events.emit(ledger.directory, "start", job=job.id, name=job.name, pid=child)
    try:
        with ledger.transaction() as data:
            mine = data.find(job.id)
            if mine is None:
                data.jobs.append(job)
                mine = job
            mine.child_pid = job.child_pid = child
            mine.pids = job.pids = [child]
    except Exception as exc:  # the command is running: never abandon it over bookkeeping
        _output.warn(str(exc))
    result = supervise(
        child,
        job,
        ledger,
        backend,
        settings["sample_interval"],
        baseline_used={g.uuid: g.used_bytes for g in chosen},
        responder=PauseResponder(ledger, job) if job.pausable else None,
    )
    said_oom = watch.finish()
    code = result.returncode
    if result.paused and code == settings["resume_exit"]:
        requeue(ledger, job, result.run_seconds)
        return _Ended(code, paused=True)
    vram_seconds = job.reserved_bytes * len(job.gpu_uuids) * result.run_seconds
    _leave(
        ledger,
        job,
        OK if code == 0 else FAILED,
        exit_status=code if code >= 0 else None,
        signal=-code if code < 0 else None,
        run_seconds=result.run_seconds,
        charge_usage=(vram_seconds, settings["fair_share_half_life"]),
        paused=(job.pauses, paused_seconds) if job.pausable else None,
    )
    oom = _record(
        args,
        settings,
        job,
        chosen,
        result,
        queued_seconds,
        started_at,
        choice,
        said_oom,
        watch,
        paused_seconds,
    )
    return _Ended(result.returncode, oom, job.reserved_bytes)


def _leave(
    ledger: Ledger,
    job: Job,
    outcome: str,
    exit_status: int | None = None,
    signal: int | None = None,
    run_seconds: float | None = None,
    charge_usage: tuple[float, float | None] | None = None,
    paused: tuple[int, float] | None = None,
) -> None:
    """Take the job out of the queue, recording how it ended (and where it ran, if it did);
    after a run, add its VRAM-time to our user's fair-share usage. `paused`: a --pausable job's
    pauses and the seconds it spent stepped aside."""
    try:
        with ledger.transaction() as data:
            mine = data.remove(job.id)
            # The ledger's word: another waiter's plan may have admitted it meanwhile.
            ran_on = mine.gpu_uuids if mine is not None and mine.state == RUNNING else []
            done = Finished(
                id=job.id,
                outcome=outcome,
                finished_at=time.time(),
                name=job.name,
                batch=job.batch,
                exit_status=exit_status,
                signal=signal,
            )
            data.book.note_finished(done, ran_on)
            if charge_usage is not None:
                charge(data, job.uid, charge_usage[0], time.time(), charge_usage[1])
            _events.emit(
                ledger.directory,
                "finish" if ran_on else "leave",
                job=job.id,
                name=job.name,
                outcome=outcome,
                exit_status=exit_status,
                signal=signal,
                gpus=ran_on,
                run_seconds=None if run_seconds is None else round(run_seconds, 3),
                **(
                    {}
                    if paused is None
                    else {"pauses": paused[0], "paused_seconds": round(paused[1], 3)}
                ),
            )
    except Exception as exc:
        # Our entry is reaped by the next gpuwait anyway, since this process is about to end.
        _output.warn(str(exc))


def _record(
    args: argparse.Namespace,
    settings: Settings,
    job: Job,
    chosen: list[GpuSnapshot],
    result: RunResult,
    wait_seconds: float,
    started_at: float,
    choice: RequestChoice,
    said_oom: bool | None,
    watch: StderrWatch,
    paused_seconds: float = 0.0,
) -> bool:
    """Leave the run's record in the history; returns whether it looked like an OOM.

    `wait_seconds` is the wait before the first start; a --pausable job's record also says how
    often it stepped aside and how long it then waited to resume (`paused_seconds`)."""
    peaks, approximate = result.peaks()
    card_full = any(
        near_full(result.free_at_peak_bytes.get(u), total)
        for u, total in result.total_bytes.items()
    )
    oom = looks_like_oom(result.returncode, bool(said_oom), card_full)
    evidence = None if not oom else ("message" if said_oom else "card full")
    record = build_record(
        job_id=job.id,
        command=job.command,
        cwd=job.cwd,
        key=args.key,
        history_commands=settings["history_commands"],
        choice=choice,
        request_json=job.request,
        reserved_bytes=job.reserved_bytes,
        gpus=chosen,
        peak_by_gpu=peaks,
        peak_approximate=approximate,
        time_to_peak=result.time_to_peak(),
        samples=result.samples,
        free_at_peak_bytes=result.free_at_peak_bytes,
        wait_seconds=wait_seconds,
        run_seconds=result.run_seconds,
        started_at=started_at,
        returncode=result.returncode,
        oom=oom,
        oom_evidence=evidence,
        stderr_watched=watch.mode,
    )
    # --name/--batch: `--after NAME` finds runs that left the ledger's record in the history.
    record["name"], record["batch"] = job.name, job.batch
    if job.pausable:
        record["pauses"], record["paused_seconds"] = job.pauses, round(paused_seconds, 3)
    try:
        warnings = save_record(settings.state_dir, record, settings["history_max_size"])
    except OSError as exc:
        # The run itself is over and its status stands; only the record is lost.
        warnings = [f"could not record the run in the history: {exc.strerror or exc}"]
    for message in warnings:
        if not args.quiet:
            _output.warn(message)
    return oom


def _show_ledger_warnings(ledger: Ledger, quiet: bool) -> None:
    for message in ledger.warnings:
        if not quiet:
            _output.warn(message)
    ledger.warnings.clear()
