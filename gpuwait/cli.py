"""Command line entry point: `main(argv) -> int`, which tests call directly.

The console script (`entry_point`) first takes its turn at the start-up turnstile when it
launches a command (gpuwait.linux.turnstile), so this file imports nothing heavy before that:
the rest of gpuwait is loaded once the turn has come.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time

from gpuwait.commands import SUBCOMMANDS

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any, NoReturn


def main(argv: Sequence[str] | None = None) -> int:
    """Run gpuwait with `argv` (without the program name) and return the exit status."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return 130


def _main(argv: Sequence[str] | None) -> int:
    """main(), but for a Ctrl-C, which it leaves to its caller."""
    from gpuwait.commands import output, warn_unknown_variables
    from gpuwait.core.errors import EXIT_BROKEN_PIPE, EXIT_USAGE, GpuwaitError, OutputError

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] in SUBCOMMANDS:
            # -q: nothing but errors (`cancel -q`), and a misspelled variable once.
            own = args[1 : args.index("--")] if "--" in args else args[1:]
            warn_unknown_variables(os.environ, quiet=bool({"-q", "--quiet"} & set(own)))
            return _subcommand(args[0], args[1:])
        from gpuwait.commands import run

        options = run.build_parser().parse_args(args)
        warn_unknown_variables(os.environ, quiet=options.quiet)
        return run.run(options)
    except GpuwaitError as exc:
        output.error(exc.message, exc.hint)
        return exc.exit_code
    except BrokenPipeError:
        # The reader went away (`gpuwait status | head -1`): nothing left to say, and no one to
        # say it to. The status a shell shows for a program that SIGPIPE ended.
        return EXIT_BROKEN_PIPE
    except OutputError as exc:
        # What a subcommand printed could not be written (a full disk behind `> file`).
        output.output_failed(exc)
        return EXIT_USAGE


def _subcommand(name: str, argv: list[str]) -> int:
    import importlib

    from gpuwait.commands import module_name

    # Imported on demand: a plain `gpuwait CMD` launch pays for none of the subcommands.
    module = importlib.import_module(module_name(name))
    # A command that reads its arguments by hand has `parse`; the others, a parser.
    parse = getattr(module, "parse", None)
    options = parse(argv) if parse is not None else module.build_parser().parse_args(argv)
    code: int = module.run(options)
    return code


def launches(args: Sequence[str]) -> bool:
    """Whether these arguments start a command: `gpuwait [OPTIONS] CMD`, or the shell hook's
    `gpuwait shell-hook -- CMD`. The other subcommands never queue, and one of them may be the
    command a launch starts (`gpuwait sim job`): it must not wait for a turn behind launches."""
    return bool(args) and (args[0] not in SUBCOMMANDS or args[0] == "shell-hook")


def _end_by_ctrl_c() -> NoReturn:
    """A Ctrl-C before gpuwait has its signals in hand (while it waits for its turn to start, or
    loads): gpuwait ends by it, as while waiting for room, and as the command would have bare.
    A shell stops its script, the rest of a typed line and a loop on a child that Ctrl-C killed,
    not on one that exited 130."""
    import signal

    from gpuwait.linux.signals import die_by_signal

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    die_by_signal(signal.SIGINT)
    os._exit(130)


def _take_turn(args: Sequence[str]) -> None:
    """A launch's turn at the start-up turnstile, in the user's runtime dir or else this
    machine's directory for the user state dir (`turnstile.directories`), whatever state_dir
    says: the settings are not loaded yet, and loading them is the work the turnstile spaces
    out."""
    if not launches(args):
        return
    from gpuwait.core.errors import GpuwaitError
    from gpuwait.linux import dirs, turnstile

    # No home directory: the settings say so, and what to do, in a moment.
    with contextlib.suppress(GpuwaitError):
        turnstile.enter(turnstile.directories(os.environ, dirs.user_state_dir()))


#: Allocations (less deallocations) between two collections of the youngest generation; the
#: default is 700.
YOUNG_COLLECTION_THRESHOLD = 50_000


def _plug_closed_standard_fds() -> bool:
    """Put /dev/null, close-on-exec, on each of stdin, stdout and stderr that gpuwait was started
    without (`gpuwait ... <&- >&- 2>&-`, some daemons and cron wrappers). Left free, the first
    file gpuwait opens would take its number: the job's liveness lock, which the command
    inherits, would become the command's stderr. Closed on exec, the command still finds the
    descriptor closed, as it would bare, and gpuwait's own messages go nowhere. Returns whether
    stdout was closed: a report written there is lost (`_checked_stdout`)."""
    closed = set()
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            closed.add(fd)
            plug = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if plug != fd:
                os.dup2(plug, fd, inheritable=False)
                os.close(plug)
    # Python starts with no stream for a descriptor that was closed.
    if sys.stdin is None:
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (lives as long as the process)
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    return 1 in closed


def _show_what_the_locale_cannot() -> None:
    """Let stdout and stderr show '?' for what the locale's encoding has no byte for. Under a
    Latin-1 or ASCII locale (an old server's, `PYTHONIOENCODING=ascii`), a report's en dash or
    '×', or a command's own letters, would otherwise end the report with a traceback halfway
    through (stdout is strict), or widen a wait line fitted to the terminal with backslash
    escapes (stderr)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="replace")


def _checked_stdout(closed: bool) -> None:
    """Make sys.stdout one whose failures are told apart (OutputError), as it was otherwise: a
    report that cannot be written (a full disk behind `> file`, or a stdout gpuwait was started
    without, `closed`) is said in one line, not a traceback, nor an exit status of 0 with
    nothing written."""
    import errno
    import io

    from gpuwait.core.errors import OutputError

    class Output(io.FileIO):
        def write(self, data: Any) -> int:
            if closed:
                raise OutputError(errno.EBADF, os.strerror(errno.EBADF))
            try:
                return super().write(data)
            except (BrokenPipeError, BlockingIOError, InterruptedError):
                raise
            except OSError as exc:
                raise OutputError(exc.errno, exc.strerror) from None

    old = sys.stdout
    fd = old.fileno()
    # Buffered as Python buffers its own: by the block size of what fd 1 is (a pipe's 4 KiB).
    try:
        size = os.fstat(fd).st_blksize or io.DEFAULT_BUFFER_SIZE
    except OSError:
        size = io.DEFAULT_BUFFER_SIZE
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(Output(fd, "w", closefd=False), buffer_size=size),
        encoding=old.encoding,
        errors=old.errors,
        line_buffering=bool(getattr(old, "line_buffering", False)),
        write_through=bool(getattr(old, "write_through", False)),
    )


def _undo_locale_coercion() -> None:
    """Put LC_CTYPE back as gpuwait was started with it. Python's start-up switches a C or
    POSIX locale to UTF-8 by setting LC_CTYPE in its own environment (PEP 538), so under cron's
    or `env -i`'s locale the command would get LC_CTYPE=C.UTF-8, which it would not have bare
    (sort, grep and tr go by it). /proc/self/environ holds the environment as exec'd."""
    if "LC_CTYPE" not in os.environ:
        return  # not coerced (the usual case): nothing read
    try:
        with open("/proc/self/environ", "rb") as f:
            started = f.read()
    except OSError:
        return
    for item in started.split(b"\0"):
        if item.startswith(b"LC_CTYPE="):
            os.environ["LC_CTYPE"] = os.fsdecode(item[len(b"LC_CTYPE=") :])
            return
    del os.environ["LC_CTYPE"]


#: Said where gpuwait itself runs out of memory, written as it is: there may be no memory left
#: to build a message.
_OUT_OF_MEMORY = (
    b"gpuwait: error: gpuwait ran out of memory (its address space limited by ulimit -v, or a "
    b"memory cgroup's limit); a command not yet started is not run\n"
    b"gpuwait: hint: give it more: gpuwait needs about 20 MB of address space\n"
)


#: How an ImportError or a SystemError tells that memory ran out.
_SHORT_OF_MEMORY = (
    "failed to map segment",
    "Cannot allocate memory",
    "error return without exception set",
    "returned NULL without setting an exception",
)


def _without_current_directory() -> None:
    """Take the current directory out of sys.path, where PYTHONPATH put it there: an empty
    entry, which `export PYTHONPATH=$PYTHONPATH:/opt/lib` leaves first where it was unset, or
    `.`. gpuwait runs in project directories and shared ones, whose own signal.py (a project's,
    or one a colleague left there) would otherwise be what gpuwait imports, and run inside it.
    gpuwait itself is loaded by now; what it loads later comes from its package."""
    for entry in list(sys.path):
        try:
            here = entry == "" or (os.path.isdir(entry) and os.path.samefile(entry, os.curdir))
        except OSError:
            continue
        if here:
            sys.path.remove(entry)


def entry_point() -> NoReturn:
    """Console script: exit with main()'s status (see `_entry_point`); one line and exit 126
    where gpuwait runs out of memory, as where its command cannot start for want of it."""
    _without_current_directory()
    try:
        _entry_point()
    except MemoryError:
        _out_of_memory()
    except (ImportError, SystemError) as exc:
        # Short of memory, loading a module may fail otherwise: a compiled one the address
        # space has no room for with the dynamic loader's ImportError ("failed to map segment
        # from shared object"), and Python's import machinery at times with a SystemError
        # ("error return without exception set").
        if not any(words in str(exc) for words in _SHORT_OF_MEMORY):
            raise
        _out_of_memory()
    except OSError as exc:
        # Or as the import machinery's listing of a package's directory failing (ENOMEM).
        if exc.errno != errno.ENOMEM:
            raise
        _out_of_memory()


#: Said where gpuwait ran out of memory while its command ran, and once it had ended.
_OUT_OF_MEMORY_RUNNING = (
    b"gpuwait: error: gpuwait ran out of memory (its address space limited by ulimit -v, or a "
    b"memory cgroup's limit) while its command ran; it waits for the command, passing signals "
    b"on, and ends with its status; the run is not recorded\n"
)
_OUT_OF_MEMORY_ENDED = (
    b"gpuwait: error: gpuwait ran out of memory (its address space limited by ulimit -v, or a "
    b"memory cgroup's limit) once its command had ended; it ends with the command's status\n"
)


def _out_of_memory() -> NoReturn:
    """Say that gpuwait ran out of memory and end, allocating as little as can be: none may be
    left. A command it started is never abandoned: gpuwait waits for it and ends with its
    status (one ended by a signal, by that signal), whatever it was doing."""
    code: int | None = 126
    # Loaded already where a command was started; not loaded now, where memory is short.
    signals = sys.modules.get("gpuwait.linux.signals")
    try:
        running: bool | None = None if signals is None else signals.command_running()
        said = _OUT_OF_MEMORY_RUNNING if running else _OUT_OF_MEMORY_ENDED
        os.write(2, _OUT_OF_MEMORY if running is None else said)
        while running is not None and signals is not None:
            try:
                code = signals.wait_for_command()
                break
            except MemoryError:
                time.sleep(0.1)  # it may come back; the command must not be left
        if code is not None and code < 0 and signals is not None:
            signals.die_by_signal(-code)
            code = 128 - code
    finally:
        os._exit(126 if code is None or not 0 <= code <= 255 else code)


def _entry_point() -> NoReturn:
    """Console script: exit with main()'s status.

    It leaves with os._exit, without tearing the interpreter down (unloading the modules costs
    about 10 ms: a sixth of a launch). That is safe because, by then:
    - no atexit handler is registered (gpuwait registers none, and imports nothing that does);
    - every thread left is a daemon (NVML calls with a deadline, the stderr relay, joined first);
    - stdout and stderr are flushed just below: nothing written is lost;
    - every file gpuwait wrote is closed and, where it matters, fsynced (the ledger, the history).
    tests/architecture/test_launch.py checks the first three on real launches.

    The start-up allocates mostly what lives as long as the process (modules, classes, the
    parser): the cyclic garbage collector, run every 700 allocations, would scan it again and
    again and find nothing, some 3 % of a launch. It runs far less often instead; later, a
    waiter or a supervisor frees nearly all it allocates by reference counting, so collections
    stay rare and the cyclic garbage between two of them small.
    """
    import gc

    stdout_closed = _plug_closed_standard_fds()
    _show_what_the_locale_cannot()
    _checked_stdout(stdout_closed)
    _undo_locale_coercion()
    try:
        _take_turn(sys.argv[1:])
    except KeyboardInterrupt:
        _end_by_ctrl_c()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, older, oldest)
    from gpuwait.core.errors import EXIT_BROKEN_PIPE, EXIT_USAGE, OutputError

    try:
        code = _main(None)
    except KeyboardInterrupt:
        _end_by_ctrl_c()
    except SystemExit as exc:
        # argparse's --help and --version end so: what they printed is checked like the rest.
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    from gpuwait.commands import output

    try:
        sys.stdout.flush()
    except OutputError as exc:
        # Written only now, into a file on a full disk say: a status that says all went well
        # would leave a script with an empty file.
        output.output_failed(exc)
        code = code or EXIT_USAGE
    except BrokenPipeError:
        # The reader went away before the last of the output (`| true`), as in main().
        code = code or EXIT_BROKEN_PIPE
    except (OSError, ValueError):
        pass  # stdout closed under gpuwait: nothing to add
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()

    os._exit(code if 0 <= code <= 255 else EXIT_USAGE)
