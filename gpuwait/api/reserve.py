"""`gpuwait.reserve("6G", ...)`: wait in gpuwait's queue, then hold the room for this process.

The options are the command line's, read by its own parser and settings (config files,
GPUWAIT_* variables), so a reservation made here waits and is admitted exactly as
`gpuwait --vram 6G ...` would be. Admitted, this process is given what a wrapped command is
given (CUDA_VISIBLE_DEVICES and the GPUWAIT_* variables, in os.environ), and its entry names
this process as both its gpuwait and its command: `status` shows it running with this pid, and
once the process is gone, however it ended, its room goes back to the queue.

CUDA reads CUDA_VISIBLE_DEVICES once, when it initialises in a process, so a reservation made
after that would not decide where the process runs: `reserve` refuses then (`cuda_in_use`).
Nothing here prints: warnings and the waiting reason go to the "gpuwait" logger, errors are
raised as ReserveError (the magic in gpuwait.api.magic says them in a notebook).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import math
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

from gpuwait.core.errors import EXIT_DEPENDENCY_FAILED, EXIT_USAGE, GpuwaitError, UsageError
from gpuwait.core.sizes import format_size

if TYPE_CHECKING:
    from gpuwait.core.policy import WaitReason
    from gpuwait.runner.hold import Holding
    from gpuwait.runner.session import Reporter


class ReserveError(GpuwaitError):
    """A reservation that could not be made. `exit_code` is the status the CLI would end with
    for the same failure (docs/exit-codes.md); `message` and `hint` are its words."""

    def __init__(self, message: str, hint: str | None = None, exit_code: int = 1) -> None:
        super().__init__(message, hint)
        self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message if self.hint is None else f"{self.message} (hint: {self.hint})"


#: Options of the command line that concern a command gpuwait starts, not a process that
#: reserves for itself.
COMMAND_ONLY = (
    ("pausable", "--pausable"),
    ("freezable", "--freezable"),
    ("checkpoint_signal", "--checkpoint-signal"),
    ("grace", "--grace"),
    ("grace_kill", "--grace-kill"),
    ("retry_oom", "--retry-oom"),
)

#: The one reservation this process holds (CUDA_VISIBLE_DEVICES is the process's, once).
_held: Reservation | None = None
#: The process whose thread is making (waiting for) a reservation: a child forked meanwhile
#: waits for none.
_making: int | None = None
_held_lock = threading.Lock()
_exit_hook = False


class Reservation:
    """Room on `gpus` held for this process until `release()`, the end of a `with` block, or the
    process's exit.

    `gpus`: the GPUs' indices as `gpuwait status` and nvidia-smi number them; inside this
    process CUDA numbers them from 0 (`cuda:0` is the first). `uuids`: the same GPUs by UUID
    (what CUDA_VISIBLE_DEVICES is set to). `vram`: bytes reserved on each (a whole card's
    size with exclusive=True; on cards of different sizes, on the largest); `vram_each`: bytes
    reserved on each of `gpus`, in that order (a share of each card, `50%`, is less on the
    smaller). `held` is False for a reservation that was never made because
    no GPU can be read here and on_no_gpu = run (the code then runs where it is).
    """

    def __init__(self, holding: Holding | None, env: dict[str, str | None] | None = None) -> None:
        self._holding = holding
        #: What os.environ had before the reservation, for the variables it set (or took out:
        #: None in `env`).
        self._before = {k: os.environ.get(k) for k in env or {}}
        self._given = dict(env or {})
        if holding is None:
            self.job_id, self.name = None, None
            self.gpus: tuple[int, ...] = ()
            self.uuids: tuple[str, ...] = ()
            self.vram = 0
            self.vram_each: tuple[int, ...] = ()
        else:
            self.job_id, self.name = holding.job.id, holding.job.name
            self.gpus = tuple(g.index for g in holding.gpus)
            self.uuids = tuple(g.uuid for g in holding.gpus)
            self.vram = holding.job.reserved_bytes
            self.vram_each = tuple(holding.job.reserved_on(u) for u in self.uuids)

    @property
    def held(self) -> bool:
        return self._holding is not None and not self._holding.released

    @property
    def peak(self) -> int:
        """The most this process (with its children) used on one of its GPUs so far, in bytes,
        as sampled every sample_interval."""
        return 0 if self._holding is None else self._holding.peak_bytes()

    def release(self, *, failed: bool = False, out_of_memory: bool = False) -> None:
        """Give the room back to the queue, and record the run in the history (`failed`: as
        a run that did not end well; `out_of_memory`: one that ran out of GPU memory). The
        variables the reservation set in os.environ are put back as they were. Safe to call
        twice; a process forked from the holder releases nothing. Where CUDA runs in this
        process, it is said that the GPUs stay in its use (CUDA keeps its context and cache
        there until the process ends)."""
        _check_flag("failed", failed)
        _check_flag("out_of_memory", out_of_memory)
        holding = self._holding
        if holding is not None and self.held and self._mine():
            why = cuda_in_use()
            if why is not None:
                where = ", ".join(f"GPU{i}" for i in self.gpus)
                holding.reporter.warn(
                    f"released job {self.job_id}, but CUDA still runs in this process ({why}): "
                    f"its memory on {where} stays in use, and what it allocates there from now "
                    "on is not reserved; end the process (restart the kernel) to give the GPU "
                    "back, and reserve before the next use"
                )
        self._give_back(1 if failed or out_of_memory else 0, out_of_memory)

    def _mine(self) -> bool:
        """Held for this process (not for the one a forked child was forked from)."""
        return self._holding is not None and os.getpid() == self._holding.pid

    def _give_back(self, returncode: int | None, out_of_memory: bool) -> None:
        """`release`, recording the run as ended with `returncode` (< 0: killed by that signal;
        None: the status is unknown, which counts as no success)."""
        holding = self._holding
        if holding is None or holding.released or not self._mine():
            return
        try:
            holding.release(returncode, out_of_memory)
        finally:
            self._put_back()

    def _put_back(self) -> None:
        """os.environ as it was before the reservation (for the variables the process has not
        changed since), and this process holding none."""
        global _held
        for name, value in self._before.items():
            if os.environ.get(name) != self._given[name]:
                continue  # changed since: the process's own now
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        with _held_lock:
            if _held is self:
                _held = None

    def __enter__(self) -> Reservation:
        if self._holding is not None and self._holding.released:
            # Its GPU may be another job's by now: a block must not run there unreserved.
            raise ReserveError(
                f"this reservation (job {self.job_id}) was released: it holds no room any more",
                hint="reserve again (gpuwait.reserve(...)) for each block",
                exit_code=EXIT_USAGE,
            )
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if isinstance(exc, SystemExit):
            # sys.exit(3) in the block: the process ends with that status, and the run with it.
            self._give_back(_exit_status(exc.code), False)
            return
        if isinstance(exc, KeyboardInterrupt):
            # Ctrl-C cut the block short: as a wrapped command stopped by it, no success, and
            # nothing learned from a run stopped half way.
            self._give_back(-signal.SIGINT, False)
            return
        # Not release(): a block's end is most often the program's, where CUDA's context
        # going with the process needs no word.
        failed = exc is not None
        self._give_back(1 if failed else 0, failed and _is_oom(exc))

    def __repr__(self) -> str:
        if self._holding is None:
            return "<gpuwait.Reservation: none (no GPU here; on_no_gpu = run)>"
        where = ", ".join(f"GPU{i}" for i in self.gpus)
        state = "held" if self.held else "released"
        name = f" {self.name}" if self.name else ""
        return (
            f"<gpuwait.Reservation job {self.job_id}{name}: {format_size(self.vram)} on "
            f"{where}, {state}>"
        )


def _exit_status(code: object) -> int:
    """The status a process ends with for `sys.exit(code)`."""
    if code is None:
        return 0
    return code % 256 if isinstance(code, int) else 1


def _is_oom(exc: BaseException | None) -> bool:
    """An exception that says the GPU ran out of memory (PyTorch, JAX, TensorFlow, CuPy)."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return "out of memory" in text or "outofmemory" in text or "resource_exhausted" in text


def current() -> Reservation | None:
    """The reservation this process holds, if any."""
    return _held


def cuda_in_use() -> str | None:
    """Why CUDA is already initialised in this process, or None where nothing shows it.

    Looked at: PyTorch (`torch.cuda.is_initialized()`), JAX (a backend made), and for
    everything else (CuPy, TensorFlow, Numba, a CUDA library of one's own) the device file
    that a CUDA context opens, /dev/nvidia-uvm, among this process's open files. A module
    that is only imported does not count: CUDA starts at the first use of a GPU.
    """
    torch = sys.modules.get("torch")
    initialised = getattr(getattr(torch, "cuda", None), "is_initialized", None)
    if callable(initialised):
        try:
            if initialised():
                return "PyTorch has initialised CUDA: torch.cuda.is_initialized() is True"
        except Exception:
            pass
    bridge = sys.modules.get("jax._src.xla_bridge")
    if getattr(bridge, "_backends", None):
        return "JAX has made its backends"
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target == "/dev/nvidia-uvm":
            return "this process has /dev/nvidia-uvm open: a CUDA context exists"
    return None


def reserve(
    vram: str | int | None = None,
    *,
    gpus: int | None = 1,
    exclusive: bool = False,
    priority: int | str | None = None,
    timeout: float | str | None = None,
    pick: str | None = None,
    devices: int | str | Sequence[int | str] | None = None,
    name: str | None = None,
    batch: str | None = None,
    key: str | None = None,
    after: str | Sequence[str] | None = (),
    after_ok: str | Sequence[str] | None = (),
    safety: float | str | None = None,
    enforce: str | None = None,
    ledger: str | os.PathLike[str] | None = None,
    min_total_vram: str | int | None = None,
    gpu_name: str | None = None,
    min_compute_capability: str | float | None = None,
    max_util: float | str | None = None,
) -> Reservation:
    """Wait until `vram` fits on `gpus` GPUs, as `gpuwait --vram VRAM ...` waits, and hold it for
    this process; CUDA_VISIBLE_DEVICES (and the GPUWAIT_* variables) are set in os.environ.

    `vram`: "6G", "6GiB", "6GB", "50%", or bytes as an int (at least 1 MiB); None: learned from this program's (or `key`'s)
    earlier runs, else default_vram. `timeout`: seconds, or "30m". The other options are the
    command line's (docs/usage.md), and settings left out come from GPUWAIT_* and the config
    files as for the CLI. Raises ReserveError; a Ctrl-C while waiting raises KeyboardInterrupt.
    """
    argv = list(_argv(vram, gpus=gpus, exclusive=exclusive, priority=priority, timeout=timeout))
    for option, value in (
        ("--pick", _words("pick", pick)),
        ("--devices", _listed(devices)),
        ("--name", _words("name", name)),
        ("--batch", _words("batch", batch)),
        ("--key", _words("key", key)),
        ("--safety", _text(safety)),
        ("--enforce", _words("enforce", enforce)),
        ("--ledger", _path_text(ledger)),
        ("--min-total-vram", _size_text(min_total_vram)),
        ("--gpu-name", _words("gpu_name", gpu_name)),
        ("--min-compute-capability", _text(min_compute_capability)),
        ("--max-util", _text(max_util)),
    ):
        if value is not None:
            argv.append(f"{option}={value}")
    for option, keyword, refs in (
        ("--after", "after", after),
        ("--after-ok", "after_ok", after_ok),
    ):
        for ref in _references(keyword, refs):
            argv.append(f"{option}={ref}")
    try:
        return reserve_argv(argv, _LoggingReporter(keywords=True))
    except ReserveError as exc:
        if exc.exit_code not in (EXIT_USAGE, EXIT_DEPENDENCY_FAILED):
            raise
        # Told as the caller wrote it: `max_util`, not the command line's `--max-util`;
        # `after_ok cannot be met`, not `--after-ok`.
        hint = None if exc.hint is None else _keywords(exc.hint)
        raise ReserveError(_keywords(exc.message), hint, exc.exit_code) from None


def _keywords(text: str) -> str:
    """`text` with the command line's options that are reserve()'s keywords named as those."""
    import inspect  # a refused value's message alone pays for it (6 ms of reserve's import)

    keywords = inspect.signature(reserve).parameters

    def keyword(match: re.Match[str]) -> str:
        name = match.group(1).replace("-", "_")
        return name if name in keywords else match.group(0)

    text = re.sub(r"(?<![\w-])--([a-z][a-z-]*[a-z])", keyword, text)
    # argparse's words and the command line's help are no Python caller's: "argument gpus: 0
    # is too small; see 'gpuwait --help'" is "gpus: 0 is too small", and a setting refused as
    # "--priority '9' is not valid: ..." is "priority: '9' is not valid: ...", as argparse's
    # "gpus: 0 is too small" is said.
    text = re.sub(r"; see '[^']*--help'$", "", re.sub(r"^argument (\w+): ", r"\1: ", text))
    refused = re.match(r"(\w+) (.*?) is not valid: ", text)
    if refused is None or refused.group(1) not in keywords:
        return text
    return f"{refused.group(1)}: {text[refused.end(1) + 1 :]}"


def _argv(
    vram: str | int | None,
    *,
    gpus: int | None,
    exclusive: bool,
    priority: int | str | None,
    timeout: float | str | None,
) -> Iterator[str]:
    # Each as `--option=value`: a value that starts with a dash (key="-exp1") is the value,
    # not taken for an option of its own.
    if vram is not None:
        yield f"--vram={_size_text(vram) or ''}"
    # A bool is an int, True one GPU; a string (exclusive="false") is true: each would be
    # taken for what it is not.
    if isinstance(gpus, bool):
        raise _wrong_type("gpus", gpus, "a whole number of GPUs")
    if gpus is not None and gpus != 1:
        yield f"--gpus={gpus}"
    _check_flag("exclusive", exclusive)
    if exclusive:
        yield "--exclusive"
    if priority is not None:
        yield f"--priority={priority}"
    if timeout is not None:
        yield f"--timeout={_seconds_text(timeout)}"


def _seconds_text(value: object) -> str:
    """`timeout` as the command line's word: text as it is, a number as seconds written out
    (Python writes 1e-05 and 1e+20, which no duration is)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _wrong_type("timeout", value, 'seconds, or a duration as text ("30m", "none")')
    if isinstance(value, int) and value >= 0:
        # Written out whole: one past any float (10**400) is too long, as the command line
        # says, where float formatting would raise OverflowError.
        return f"{value}s"
    if not math.isfinite(value) or value < 0:
        raise ReserveError(
            f"timeout={value!r}: give seconds (0: only if it fits at once), or timeout='none' "
            "to wait as long as it takes",
            exit_code=EXIT_USAGE,
        )
    return f"{value:.6f}".rstrip("0").rstrip(".") + "s"


def _text(value: object) -> str | None:
    return None if value is None else str(value)


#: The fewest bytes an int may give: fewer are no GPU job's memory, but a size in GiB.
_MIN_INT_BYTES = 2**20


def _size_text(value: object) -> str | None:
    """A size given from Python as the command line's word. An int is bytes; a bare number is
    refused by the command line (6 meant 6G to whoever typed it), and so, from Python, are a
    float and an int too small to be a GPU job's bytes: `reserve(6)` would hold 6 bytes, and the
    process would take its 6 GiB from its neighbours."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, int) and not 0 < value < _MIN_INT_BYTES:
            return f"{value}B"
        if not value > 0 or not math.isfinite(value):
            said = f"{value!r} is not a size above zero"
        elif value >= _MIN_INT_BYTES:
            # Bytes computed as a float (model_bytes * 1.2): no one meant millions of GiB.
            said = f"{value!r} is a float: give bytes as an int: {math.ceil(value)}"
        else:
            said = f"{value!r} has no unit: write '{value:g}G' for {value:g} GiB"
        raise ReserveError(
            said,
            hint="a size as text (6G, 6GiB, 6GB, 512M, 50%), or an int of bytes (at least 1 MiB)",
            exit_code=EXIT_USAGE,
        )
    raise ReserveError(
        f"{value!r} is not a size",
        hint="a size as text (6G, 6GiB, 6GB, 512M, 50%), or an int of bytes (at least 1 MiB)",
        exit_code=EXIT_USAGE,
    )


def _wrong_type(keyword: str, value: object, expected: str) -> ReserveError:
    return ReserveError(f"{keyword}={value!r}: expected {expected}", exit_code=EXIT_USAGE)


def _check_flag(keyword: str, value: object) -> None:
    """Raise where `value`, given for a flag, is no bool (nor 0, 1 or None): a string is true
    (exclusive="false", failed="no"), and would be taken for what it is not."""
    if value is not None and not isinstance(value, bool) and value not in (0, 1):
        raise _wrong_type(keyword, value, "True or False")


def _words(keyword: str, value: object) -> str | None:
    """A text option as the command line's word (a number given for a name is no name)."""
    if value is None or isinstance(value, str):
        return value
    raise _wrong_type(keyword, value, "text")


def _path_text(value: object) -> str | None:
    if value is None or isinstance(value, (str, os.PathLike)):
        return None if value is None else os.fspath(value)
    raise _wrong_type("ledger", value, "a directory's path")


def _references(keyword: str, refs: object) -> list[str]:
    """`after`/`after_ok`: one job (id, name or batch) or a list of them; None, as for every
    other keyword, is none given."""
    listed = [refs] if isinstance(refs, str) else [] if refs is None else refs
    if isinstance(listed, (list, tuple)) and all(isinstance(r, str) for r in listed):
        return list(listed)
    raise _wrong_type(keyword, refs, "a job's id, name or batch, or a list of them")


def _listed(devices: object) -> str | None:
    """`devices`: an index, a UUID, or a list of them, as `--devices` takes them."""
    if devices is None or isinstance(devices, str):
        return devices
    listed = [devices] if isinstance(devices, int) else devices
    if isinstance(listed, (list, tuple)) and all(
        isinstance(d, (int, str)) and not isinstance(d, bool) for d in listed
    ):
        return ",".join(str(d) for d in listed)
    raise _wrong_type("devices", devices, "a GPU's index or UUID, or a list of them")


def _options(argv: Sequence[str]) -> argparse.Namespace:
    """`argv` read by the command line's own parser; what concerns only a command is refused."""
    from gpuwait.commands.run import build_parser

    options = build_parser().parse_args(list(argv))
    for attribute, option in COMMAND_ONLY:
        if getattr(options, attribute):
            raise UsageError(f"{option} applies to a command gpuwait starts, not to a reservation")
    extra = [w for w in options.command if w != "--"]
    if extra:
        raise UsageError(
            f"unexpected {' '.join(extra)!r}: a reservation takes options only",
            hint="e.g. 6G --priority 4 --timeout 30m",
        )
    # What the entry, `status` and the history name: this program, as it was started.
    options.command = list(getattr(sys, "orig_argv", None) or [sys.executable])
    return options


def reserve_argv(argv: Sequence[str], reporter: Reporter) -> Reservation:
    """`reserve`, with the options as the command line's words (the magic's way in)."""
    global _making
    options = _options_or_error(argv)
    with _held_lock:
        # A child forked from the holder shares its room but may reserve its own.
        if _held is not None and _held.held and _held._mine():
            raise ReserveError(
                f"this process already holds a reservation (job {_held.job_id})",
                hint="release it first (r.release(), or %gpuwait release)",
                exit_code=EXIT_USAGE,
            )
        if _making == os.getpid():
            raise ReserveError(
                "this process is already waiting for a reservation (in another thread)",
                hint="one reservation per process: share the one that thread gets",
                exit_code=EXIT_USAGE,
            )
        _making = os.getpid()
    try:
        return _reserve(options, reporter)
    finally:
        with _held_lock:
            _making = None


def _options_or_error(argv: Sequence[str]) -> argparse.Namespace:
    try:
        return _options(argv)
    except GpuwaitError as exc:
        raise ReserveError(exc.message, exc.hint, exc.exit_code) from None


def _reserve(options: argparse.Namespace, reporter: Reporter) -> Reservation:
    global _held, _exit_hook
    from gpuwait.commands.run import prepare
    from gpuwait.runner.hold import WaitInterrupted, hold

    try:
        why = cuda_in_use()
        if why is not None:
            raise ReserveError(
                f"CUDA is already initialised in this process ({why}); it would not see the "
                "GPUs a reservation gives",
                hint="reserve before the first use of a GPU (first thing in a notebook), or "
                "restart the kernel",
                exit_code=EXIT_USAGE,
            )
        request, config = prepare(options)
        holding = hold(request, config, reporter)
    except WaitInterrupted as exc:
        if exc.signum == signal.SIGINT:
            raise KeyboardInterrupt from None
        # Handed back: the process's own handler (or the default action) decides.
        os.kill(os.getpid(), exc.signum)
        raise ReserveError(
            f"{exc} arrived while waiting; the reservation was given up",
            exit_code=128 + exc.signum,
        ) from None
    except ReserveError:
        raise
    except GpuwaitError as exc:
        raise ReserveError(exc.message, exc.hint, exc.exit_code) from None
    if holding is None:
        return Reservation(None)
    reservation: Reservation | None = None
    try:
        env = holding.env
        reservation = Reservation(holding, env)
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        with _held_lock:
            _held = reservation
            _ending.watch()
            if not _exit_hook:
                # A reservation still held when the interpreter exits is released and
                # recorded; one whose process dies otherwise is reaped by the next gpuwait.
                atexit.register(_release_at_exit)
                _exit_hook = True
        return reservation
    except BaseException:
        # A Ctrl-C before the caller got it: nobody could release it, so it is given back.
        holding.abandon()
        if reservation is not None:
            reservation._put_back()
        raise


def _release_at_exit() -> None:
    held = _held
    if held is not None:
        returncode, error = _ending.status()
        # A failure here costs nothing: the entry is reaped once this process is gone.
        with contextlib.suppress(Exception):
            held._give_back(returncode, error is not None and _is_oom(error))


class _Ending:
    """How this process is ending, as far as the interpreter shows it to an atexit handler.

    Python keeps the status of an exit to itself, so it is pieced together: the outermost frame
    of the main thread either returned (the program ran to its end: 0) or was left by an
    exception; an exception nobody caught is in sys.last_exc (Python prints it and exits 1, or
    dies of SIGINT for a KeyboardInterrupt); sys.exit(N), watched while a reservation is held,
    gives N. An exit seen by none of them (`raise SystemExit(N)`, `exit(N)`, a `from sys import
    exit` made before) has an unknown status: None, which counts as no success.
    """

    def __init__(self) -> None:
        self.frame: FrameType | None = None
        #: The opcodes that return from a frame.
        self.returns: set[int] = set()
        self.code: object = _NOT_SEEN
        self._real_exit: Callable[..., Any] | None = None

    def watch(self) -> None:
        import dis  # here, not at the exit: an exec() then would cost a KeyboardInterrupt's exit

        self.returns = {dis.opmap[n] for n in ("RETURN_VALUE", "RETURN_CONST") if n in dis.opmap}
        frames = sys._current_frames()
        frame = frames.get(threading.main_thread().ident or -1)
        while frame is not None and frame.f_back is not None:
            frame = frame.f_back
        self.frame = frame
        if self._real_exit is None:
            self._real_exit = sys.exit
            sys.exit = self._exit

    def _exit(self, status: object = None, /) -> NoReturn:
        if threading.current_thread() is threading.main_thread():
            self.code = status
        assert self._real_exit is not None
        self._real_exit(status)
        raise SystemExit(status)  # not reached: sys.exit raises

    def status(self) -> tuple[int | None, BaseException | None]:
        """(the exit status, or None where unknown; the exception that ended it, if one did)."""
        if hasattr(sys, "ps1") or sys.flags.interactive:
            # An interactive session: its statements' frames say nothing of how it ends. In
            # IPython's (a Jupyter kernel's) a sys.exit in a cell is caught and the session
            # goes on, so no sys.exit seen is how it ended.
            if self.code is _NOT_SEEN or _in_ipython():
                return 0, None
            return _exit_status(self.code), None
        code, at = (
            (b"", -1) if self.frame is None else (self.frame.f_code.co_code, self.frame.f_lasti)
        )
        if 0 <= at < len(code) and code[at] in self.returns:
            return 0, None  # the program ran to its end
        uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if isinstance(uncaught, KeyboardInterrupt):
            return -signal.SIGINT, None
        if isinstance(uncaught, Exception):
            return 1, uncaught
        if self.code is not _NOT_SEEN:
            return _exit_status(self.code), None
        return None, None


def _in_ipython() -> bool:
    """An IPython shell (a Jupyter kernel's too) runs this process's statements."""
    found = getattr(sys.modules.get("IPython.core.getipython"), "get_ipython", None)
    try:
        return callable(found) and found() is not None
    except Exception:
        return False


_NOT_SEEN = object()
_ending = _Ending()


class _LoggingReporter:
    """What a run says, for a program: through the "gpuwait" logger (warnings are seen by
    default; the waiting reason once each time it changes, at INFO)."""

    def __init__(self, keywords: bool = False) -> None:
        import logging

        self.log = logging.getLogger("gpuwait")
        self._last: tuple[object, ...] | None = None
        #: The options said as reserve()'s keywords, for a caller of reserve() (not the
        #: magic's, whose words are the command line's).
        self.keywords = keywords

    def warn(self, message: str) -> None:
        self.log.warning(message)

    def info(self, message: str) -> None:
        self.log.info(message)

    def error(self, message: str) -> None:
        self.log.error(message)

    def waiting(self, reason: WaitReason, job: str) -> None:
        from gpuwait.commands.output import situation

        # Said again only where more than the figures that move with each reading changed.
        key = situation(reason)
        if key == self._last:
            return
        self._last = key
        text = reason.describe()
        if self.keywords and "--" in text:
            # "--vram SIZE asks for less" (a whole GPU from default_vram): reserve()'s `vram`.
            text = _keywords(text)
        self.log.info("%s waits: %s", job, text)

    def waited(self) -> None:
        self._last = None
