"""A simulated CUDA program: `gpuwait sim job --vram 6G --hold 10s`.

It behaves as a CUDA job does towards gpuwait: it takes device 0 of what CUDA_VISIBLE_DEVICES
shows it, claims its memory on that card (at once or ramping up), and dies with a PyTorch-style
out-of-memory error when the card is full. A card over-committed by gpuwait therefore shows up as a
failed job, not as a passing test. Where its card's compute mode keeps it out (prohibited, or
exclusive-process with another process on the card already), it fails as CUDA does. With
`--gpus N` it is a data-parallel job: a process per GPU, as torchrun starts its ranks, so that a
gang over-committed on any of its cards fails too.

It also keeps to the budgets the real frameworks keep to (`--framework`, docs/budgets.md): as
PyTorch, the allocator cap (`per_process_memory_fraction` in PyTorch's allocator settings, or
gpuwait's hook variable); as JAX, XLA_PYTHON_CLIENT_MEM_FRACTION (and, as JAX does by default,
it takes that share of the card at its start); under any of them, the CUDA MPS memory limit
when an MPS daemon serves the user. A job over its cap dies alone, with that framework's error.

This is the job's own output, not gpuwait's: errors go to stderr as a CUDA program writes them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from gpuwait import checkpoint
from gpuwait.core import budget
from gpuwait.core.errors import BackendUnavailable
from gpuwait.core.sizes import MAX_GPUS, NEGATIVE_VALUE, parse_duration, parse_size, parse_whole
from gpuwait.core.snapshot import COMPUTE_EXCLUSIVE_PROCESS, COMPUTE_PROHIBITED
from gpuwait.core.text import nearest_option, whole_number
from gpuwait.gpu.sim import (
    Allocation,
    SimConfig,
    SimGpu,
    checkpoint_holds,
    cuda_visible_gpus,
    ensure_state_dir,
    live_allocations,
    load_sim_file,
    remove_allocation,
    sim_lock,
    write_allocation,
)
from gpuwait.linux import mps, proc
from gpuwait.linux.atomic import write_atomic

#: How often a ramping job grows, in seconds.
RAMP_STEP_S = 0.05
FRAMEWORKS = ("torch", "jax", "cuda")
#: The share of the card JAX takes when XLA_PYTHON_CLIENT_MEM_FRACTION does not say.
JAX_DEFAULT_FRACTION = 0.75
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _Signalled(BaseException):
    """Raised by the signal handler; a BaseException so nothing on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def main(argv: list[str]) -> int:
    args = _parse_args(argv)
    previous: dict[signal.Signals, Any] = {}
    try:
        for signum in _SIGNALS:
            if signal.getsignal(signum) == signal.SIG_IGN:
                # Ignored by whoever started it (nohup, `&` in a script): as for any program
                # that does not handle it, it stays so.
                continue
            previous[signum] = signal.signal(signum, _raise_signalled)
        return _main(args)
    except _Signalled as received:
        return _die_by(received.signum)
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(signum, handler)


def _main(args: argparse.Namespace) -> int:
    sim_path = args.sim or os.environ.get("GPUWAIT_SIM")
    if not sim_path:
        _error("gpuwait sim job: no simulation file; pass --sim FILE or set GPUWAIT_SIM")
        return 2
    if not args.sim and not os.path.isabs(os.path.expanduser(sim_path)):
        # As gpuwait refuses it: another file in every directory than its gpuwait's.
        _error(
            f"gpuwait sim job: GPUWAIT_SIM {sim_path!r} is relative; give an absolute path "
            f"such as {os.path.abspath(sim_path)}"
        )
        return 2
    try:
        config = _load(sim_path)
    except BackendUnavailable as exc:
        _error(f"gpuwait sim job: {exc.message}")
        return 2
    try:
        # Before any memory is claimed: a simulation this user cannot record jobs in (another
        # user's private one) is said at once, with how to share one, not found out halfway.
        ensure_state_dir(config)
    except BackendUnavailable as exc:
        _error(f"gpuwait sim job: {exc.message}")
        _error(f"gpuwait sim job: hint: {exc.hint}")
        return 2
    if args.checkpoint and not os.path.isdir(os.path.dirname(os.path.abspath(args.checkpoint))):
        _error(f"gpuwait sim job: --checkpoint {args.checkpoint}: its directory does not exist")
        return 2
    if args.checkpoint and os.path.isdir(args.checkpoint):
        _error(f"gpuwait sim job: --checkpoint {args.checkpoint} is a directory; give a file")
        return 2
    if args.gpus > 1:
        if args.report or args.checkpoint:
            _error(
                "gpuwait sim job: --report and --checkpoint take a job of one GPU: leave "
                "them out with --gpus"
            )
            return 2
        return _ranks(config, args)
    return _one(config, args)


def _one(config: SimConfig, args: argparse.Namespace) -> int:
    """The job on CUDA device 0 of what this process sees."""
    start = proc.start_time(os.getpid())
    if start is None:
        _error("gpuwait sim job: cannot read this process's start time from /proc")
        return 2
    job = _Job(config, start, args.report, args.framework)
    problem = job.pick_gpu()
    if problem is not None:
        _error(problem)
        job.write_report()
        return 1
    return _run(job, args)


def _ranks(config: SimConfig, args: argparse.Namespace) -> int:
    """`--gpus N`: a data-parallel job as torchrun starts one, a process per GPU (its rank),
    each on one of the first N devices this process sees. A rank that fails (out of memory)
    ends the others, and the job ends with its status; a signal to the job ends them all."""
    visible = cuda_visible_gpus(config, os.environ)
    if len(visible) < args.gpus:
        _error(CUDA_NO_ORDINAL)
        return 1
    ranks: dict[int, int] = {}
    try:
        for rank, gpu in enumerate(visible[: args.gpus]):
            pid = os.fork()
            if pid == 0:
                os._exit(_rank(config, args, gpu.uuid))
            ranks[pid] = rank
        status = 0
        while ranks:
            pid, how = os.waitpid(-1, 0)
            if ranks.pop(pid, None) is None:
                continue
            code = os.waitstatus_to_exitcode(how)
            if code != 0 and status == 0:
                status = code if code > 0 else 128 - code
                _signal_ranks(ranks, signal.SIGTERM)
        return status
    except _Signalled as received:
        _signal_ranks(ranks, received.signum)
        for pid in ranks:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        raise


def _rank(config: SimConfig, args: argparse.Namespace, uuid: str) -> int:
    """One rank of `_ranks`, in its own process: the job on the GPU `uuid` alone."""
    try:
        os.environ["CUDA_VISIBLE_DEVICES"] = uuid
        return _one(config, args)
    except _Signalled as received:
        return _die_by(received.signum)
    except BaseException:  # its parent's stack is above it: said, and never returned into
        sys.excepthook(*sys.exc_info())
        return 1


def _signal_ranks(ranks: Mapping[int, int], signum: int) -> None:
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


#: How long a job starting while its simulation file is being saved reads it again.
LOAD_PATIENCE = 5.0


def _load(sim_path: str) -> SimConfig:
    """The simulation file. One caught half-saved is read again for a moment: gpuwait admitted
    the job on the whole file just before, and a real CUDA job never notices an NVML hiccup."""
    deadline = time.monotonic() + LOAD_PATIENCE
    while True:
        try:
            return load_sim_file(sim_path)
        except BackendUnavailable as exc:
            if exc.lasting or time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


class _BadUsage(Exception):
    """A malformed command line: one line on stderr and exit status 2, as gpuwait's own."""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # `--ramp -1s`: a value, refused by its own parser as negative, not an unknown option
        # leaving --ramp "expected one argument", as gpuwait's Parser takes it.
        self._negative_number_matcher = NEGATIVE_VALUE

    def error(self, message: str) -> NoReturn:
        raise _BadUsage(message)


def build_parser() -> argparse.ArgumentParser:
    """`gpuwait sim job`'s options (its errors are raised, for `_parse_args` to say)."""
    parser = _Parser(
        prog="gpuwait sim job",
        description="A simulated CUDA job: claims VRAM on simulated GPU 0 of CUDA_VISIBLE_DEVICES.",
    )
    parser.add_argument(
        "--vram", required=True, type=_size_arg, metavar="SIZE", help="memory it allocates"
    )
    parser.add_argument(
        "--ramp",
        default=0.0,
        type=_duration_arg,
        metavar="DURATION",
        help="grow linearly over this (default: 0s, all at once)",
    )
    parser.add_argument(
        "--hold",
        default=1.0,
        type=_duration_arg,
        metavar="DURATION",
        help="time at full size (default: 1s)",
    )
    parser.add_argument(
        "--exit",
        default=0,
        type=_exit_arg,
        metavar="STATUS",
        help="exit status at the end, 0-255 (default: 0)",
    )
    parser.add_argument(
        "--gpus",
        default=1,
        type=_gpus_arg,
        metavar="N",
        help="a data-parallel job: a process per GPU, each taking --vram on one of the first N "
        "devices it sees, as torchrun's ranks do (default: 1)",
    )
    parser.add_argument("--report", metavar="FILE", help="write a JSON report here at the end")
    parser.add_argument(
        "--framework",
        choices=FRAMEWORKS,
        default="torch",
        help="whose budgets it keeps to and whose errors it prints (default: torch)",
    )
    parser.add_argument("--sim", metavar="FILE", help="simulation file (default: $GPUWAIT_SIM)")
    parser.add_argument(
        "--checkpoint",
        metavar="FILE",
        help="pausable: on gpuwait's checkpoint signal, save the time held so far here and exit "
        "with the resume status; a later run resumes from it",
    )
    return parser


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    try:
        return parser.parse_args(argv)
    except _BadUsage as exc:
        message = str(exc)
        word = None
        if message.startswith("unrecognized arguments: "):
            word = message.split()[2].partition("=")[0]
        # `-hold 1s`: argparse reads -h and a value 'old' it does not take, and says that.
        glued = re.fullmatch(r"argument (-\w)(?:/\S+)?: ignored explicit argument '(.*)'", message)
        if glued:
            typed = glued.group(1) + glued.group(2)
            message = f"{typed} is no option: a long option takes two dashes"
            word = "-" + typed.partition("=")[0]
        options = [s for a in parser._actions for s in a.option_strings]
        if message.startswith("the following arguments are required: "):
            # `-vram 1G`: argparse sets the word aside, and says first that --vram is missing.
            given = argv[: argv.index("--")] if "--" in argv else argv
            for typed in given:
                name = typed.partition("=")[0]
                if (
                    re.fullmatch(r"-[A-Za-z][\w-]+", name)
                    and name not in options
                    and nearest_option(name, options) is not None
                ):
                    message = f"{typed} is no option: a long option takes two dashes"
                    word = "-" + name
                    break
        _error(f"gpuwait sim job: error: {message}; see 'gpuwait sim job --help'")
        if word is not None:
            match = nearest_option(word, options) if word.startswith("-") else None
            if match is not None:
                _error(f"gpuwait sim job: hint: did you mean {match}?")
        raise SystemExit(2) from None


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _gpus_arg(text: str) -> int:
    try:
        return parse_whole(text, 1, MAX_GPUS)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _exit_arg(text: str) -> int:
    try:
        return parse_whole(text, 0, 255)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _error(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


#: What CUDA says where the card's compute mode keeps the process out: prohibited, or
#: exclusive-process with another process on it already.
CUDA_BUSY = "CUDA error: all CUDA-capable devices are busy or unavailable"
#: What CUDA says where a program asks for a device it does not see (a rank past the last).
CUDA_NO_ORDINAL = "CUDA error: invalid device ordinal"
#: What CUDA says on a card that failed (fallen off the bus: NVML's "GPU is lost").
CUDA_LOST = "CUDA error: unspecified launch failure"


class _Job:
    """The memory this process holds on its simulated card."""

    def __init__(
        self, config: SimConfig, start_time: int, report_path: str | None, framework: str = "torch"
    ) -> None:
        self.config = config
        self.pid = os.getpid()
        self.start_time = start_time
        self.report_path = report_path
        self.framework = framework
        self.gpu: SimGpu | None = None
        self.allocated = 0
        self.peak = 0
        self.oom = False
        #: The most this process may hold (its framework's cap, the MPS limit); None: the card.
        self.cap: int | None = None
        self.cap_by = ""
        #: JAX's pool, taken at the start when it preallocates.
        self.pool = 0

    def pick_gpu(self) -> str | None:
        """Take CUDA device 0; the CUDA error a program would get if that fails."""
        visible = cuda_visible_gpus(self.config, os.environ)
        if not visible:
            return "CUDA error: no CUDA-capable device is detected"
        self.gpu = visible[0]
        if self.gpu.lost:
            return CUDA_LOST
        if self.gpu.compute_mode == COMPUTE_PROHIBITED:
            return CUDA_BUSY
        self.cap, self.cap_by = _cap(self.framework, self.gpu, os.environ)
        if self.framework == "jax":
            fraction = _jax_fraction(os.environ)
            if os.environ.get(budget.XLA_PREALLOCATE_VAR, "").lower() not in ("false", "0"):
                self.pool = math.floor(fraction * self.gpu.total_bytes)
        return None

    def allocate(self, vram: int, ramp: float) -> bool:
        """Grow to `vram` bytes, linearly over `ramp` seconds. False after an OOM."""
        if self.pool and not self._grow(self.pool):
            return False  # JAX takes its share of the card first
        steps = 1 if ramp <= 0 else max(1, round(ramp / RAMP_STEP_S))
        began = time.monotonic()
        for step in range(1, steps + 1):
            if ramp > 0:
                _sleep_until(began + ramp * step / steps)
            if not self._grow(math.ceil(vram * step / steps)):
                return False
        return True

    def _grow(self, target: int) -> bool:
        gpu = self.gpu
        assert gpu is not None
        if self.cap is not None and target > self.cap:
            # Refused by its own budget, whatever room the card has: it fails alone.
            _error(self._cap_message(gpu, target, self.cap))
            self.release()
            self.oom = True
            return False
        if target <= self.allocated and self.allocated == self.pool:
            return True  # inside the pool JAX holds already
        while True:
            # Signals wait until the record and the lock are consistent again.
            with _signals_blocked(), sim_lock(self.config) as directory:
                if not checkpoint_holds(directory, self.pid, self.start_time):
                    return self._grow_locked(directory, gpu, target)
            # Locked by cuda-checkpoint: as the driver blocks a locked process's CUDA calls,
            # it waits for the unlock (a signal still ends it).
            time.sleep(RAMP_STEP_S)

    def _grow_locked(self, directory: Path, was: SimGpu, target: int) -> bool:
        """`_grow` under the simulation's lock."""
        gpu = self._card_now(was)
        if gpu is None:
            # Lost (or taken out of the file) since: every CUDA call there fails.
            _error(CUDA_LOST)
            remove_allocation(directory, self.pid)
            self.allocated = 0
            return False
        others = [
            a
            for a in live_allocations(self.config, prune=True)
            if a.gpu_uuid == gpu.uuid and a.pid != self.pid
        ]
        if gpu.compute_mode == COMPUTE_EXCLUSIVE_PROCESS and others and not self.allocated:
            # The card takes one process at a time, and another holds it already.
            _error(CUDA_BUSY)
            return False
        if gpu.held_by_none + sum(a.bytes for a in others) + target > gpu.total_bytes:
            _error(self._oom_message(gpu, target, others))
            remove_allocation(directory, self.pid)
            self.allocated = 0
            self.oom = True
            return False
        write_allocation(directory, Allocation(self.pid, self.start_time, gpu.uuid, target))
        self.allocated = target
        self.peak = max(self.peak, target)
        return True

    def _card_now(self, gpu: SimGpu) -> SimGpu | None:
        """The job's card as the file describes it now (gpuwait reads it so at every reading:
        memory resized, taken by others, lost); None where it is lost or gone. A file caught
        half-saved, or broken since, leaves the card as it was: CUDA never reads that file."""
        with contextlib.suppress(BackendUnavailable):
            self.config = load_sim_file(self.config.path)
        now = next((g for g in self.config.gpus if g.uuid == gpu.uuid), None)
        if now is None or now.lost:
            return None
        self.gpu = now
        return now

    def _oom_message(self, gpu: SimGpu, target: int, others: list[Allocation]) -> str:
        said = self._framework_oom(target - self.allocated, "")
        if said is not None:
            return said
        used = gpu.held_by_none + sum(a.bytes for a in others) + self.allocated
        free = max(0, gpu.total_bytes - used)
        parts = [
            "torch.OutOfMemoryError: CUDA out of memory.",
            f"Tried to allocate {torch_size(target - self.allocated)}.",
            f"GPU 0 has a total capacity of {torch_size(gpu.total_bytes)}",
            f"of which {torch_size(free)} is free.",
        ]
        for other in sorted(others, key=lambda a: (-a.bytes, a.pid)):
            parts.append(f"Process {other.pid} has {torch_size(other.bytes)} memory in use.")
        parts.append(
            "Including non-PyTorch memory, this process has "
            f"{torch_size(self.allocated)} memory in use."
        )
        return " ".join(parts)

    def _framework_oom(self, wanted: int, why: str) -> str | None:
        """JAX's or the CUDA runtime's out-of-memory error for `wanted` more bytes (`why`: what
        refused them, " (...)"); None for PyTorch, whose message says more."""
        if self.framework == "jax":
            return (
                "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while "
                f"trying to allocate {wanted} bytes{why}."
            )
        if self.framework == "cuda":
            return f"CUDA error: out of memory{why}"
        return None

    def _cap_message(self, gpu: SimGpu, target: int, cap: int) -> str:
        wanted = target - self.allocated
        said = self._framework_oom(wanted, f" ({self.cap_by})")
        if said is not None:
            return said
        return (
            "torch.OutOfMemoryError: CUDA out of memory. "
            f"Tried to allocate {torch_size(wanted)}. "
            f"GPU 0 has a total capacity of {torch_size(gpu.total_bytes)} "
            f"of which {torch_size(max(0, gpu.total_bytes - gpu.held_by_none - self.allocated))} "
            f"is free. Of the allocated memory {torch_size(self.allocated)} is allocated by "
            f"PyTorch, and this process is limited to {torch_size(cap)} ({self.cap_by})."
        )

    def release(self) -> None:
        remove_allocation(self.config.state_dir, self.pid)
        self.allocated = 0

    def write_report(self) -> None:
        if not self.report_path:
            return
        report = {
            "pid": self.pid,
            "gpu_uuid": self.gpu.uuid if self.gpu else None,
            "gpu_index": self.gpu.index if self.gpu else None,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "peak_bytes": self.peak,
            "oom": self.oom,
            "cap_bytes": self.cap,
        }
        try:
            with open(self.report_path, "w", encoding="utf-8") as handle:
                json.dump(report, handle)
        except OSError as exc:
            _error(f"gpuwait sim job: cannot write report {self.report_path}: {exc.strerror}")


def _env_fraction(env: Mapping[str, str], name: str) -> float | None:
    try:
        value = float(env.get(name, ""))
    except ValueError:
        return None
    return value if 0 < value <= 1 else None


def _jax_fraction(env: Mapping[str, str]) -> float:
    for name in (budget.XLA_NEW_FRACTION_VAR, budget.XLA_FRACTION_VAR):
        fraction = _env_fraction(env, name)
        if fraction is not None:
            return fraction
    return JAX_DEFAULT_FRACTION


def _cap(framework: str, gpu: SimGpu, env: Mapping[str, str]) -> tuple[int | None, str]:
    """The most this simulated job may hold on `gpu` (its CUDA device 0), and what sets it."""
    total = gpu.total_bytes
    caps: list[tuple[int, str]] = []
    if framework == "torch":
        # As PyTorch 2.10+: the allocator settings, else what gpuwait's hook applies on import.
        fraction = budget.conf_fraction(budget.torch_conf(env))
        how = "per_process_memory_fraction"
        reserved = env.get(budget.TORCH_BYTES_VAR, "")
        held = whole_number(reserved)
        if fraction is None and held:
            # What the hook applies on a gang of cards of different sizes: this card's share.
            fraction, how = min(1.0, held / total), "the PyTorch cap"
        elif fraction is None:
            fraction, how = _env_fraction(env, budget.TORCH_FRACTION_VAR), "the PyTorch cap"
        if fraction is not None and 0 < fraction <= 1:
            caps.append((math.floor(fraction * total), how))
    elif framework == "jax":
        fraction = _jax_fraction(env)
        caps.append((math.floor(fraction * total), "XLA client memory fraction"))
    limit = env.get(budget.MPS_LIMIT_VAR)
    if limit and mps.daemon_serves(env):
        # As CUDA: a UUID (or a unique prefix of one) names the card whatever
        # CUDA_VISIBLE_DEVICES holds; an ordinal names a device as this process numbers them.
        limits = budget.parse_mps_limit(limit)
        by_uuid = [v for k, v in limits.items() if k.startswith("GPU-") and gpu.uuid.startswith(k)]
        device0 = by_uuid[0] if len(by_uuid) == 1 else limits.get("0")
        if device0 is not None:
            caps.append((device0, "MPS pinned device memory limit"))
    if not caps:
        return None, ""
    return min(caps)


def torch_size(n_bytes: int) -> str:
    """A size as PyTorch's allocator messages print it (c10 format_size)."""
    if n_bytes <= 1024:
        return f"{n_bytes} bytes"
    if n_bytes <= 2**20:
        return f"{n_bytes / 2**10:.2f} KiB"
    if n_bytes <= 2**30:
        return f"{n_bytes / 2**20:.2f} MiB"
    return f"{n_bytes / 2**30:.2f} GiB"


def _run(job: _Job, args: argparse.Namespace) -> int:
    ok = False
    paused = False
    try:
        ok = job.allocate(args.vram, args.ramp)
        if ok and args.checkpoint:
            paused = _hold_pausable(args.hold, args.checkpoint)
        elif ok:
            time.sleep(args.hold)
    finally:
        # A signal during clean-up is delivered (and raised) once the record is gone.
        with _signals_blocked():
            job.release()
            job.write_report()
    if paused:
        return checkpoint.resume_exit_status()
    return int(args.exit) if ok else 1


def _hold_pausable(hold: float, path: str) -> bool:
    """Hold the memory for what is left of `hold`; True if paused by the checkpoint signal.

    Progress (seconds held so far) is read from and saved to `path`, like a training job that
    resumes from its last checkpoint.
    """
    try:
        with open(path) as f:
            done = float(json.load(f)["held_seconds"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        done = 0.0
    if not (math.isfinite(done) and done >= 0):
        done = 0.0  # damaged: started over, as from no checkpoint
    checkpoint.install()
    started = time.monotonic()
    while done + (time.monotonic() - started) < hold:
        if checkpoint.requested():
            _save_progress(path, done + time.monotonic() - started, finished=False)
            return True
        time.sleep(0.02)
    _save_progress(path, hold, finished=True)
    return False


def _save_progress(path: str, held: float, finished: bool) -> None:
    state = {"held_seconds": held, "finished": finished, "resumes": checkpoint.resume_count()}
    try:
        write_atomic(Path(path), json.dumps(state).encode(), mode=0o644)
    except OSError as exc:
        # As a training script whose checkpoint cannot be written: it says so and goes on
        # (a pause without its checkpoint starts over when resumed).
        _error(f"gpuwait sim job: cannot write checkpoint {path}: {exc.strerror or exc}")


def _raise_signalled(signum: int, frame: FrameType | None) -> None:
    raise _Signalled(signum)


def _die_by(signum: int) -> int:
    """End by `signum` itself, so the parent sees a signal death as with any CUDA program."""
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    return 128 + signum  # reached only if something outside keeps the signal from killing us


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)
