"""Command line entry point: `main(argv) -> int`, which tests call directly."""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from gpuwait.commands import SUBCOMMANDS, module_name, output, warn_unknown_variables
from gpuwait.core.errors import EXIT_BROKEN_PIPE, EXIT_USAGE, GpuwaitError


def main(argv: Sequence[str] | None = None) -> int:
    """Run gpuwait with `argv` (without the program name) and return the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        warn_unknown_variables(os.environ)
        if args and args[0] in SUBCOMMANDS:
            return _subcommand(args[0], args[1:])
        from gpuwait.commands import run

        return run.run(run.build_parser().parse_args(args))
    except GpuwaitError as exc:
        output.error(exc.message, exc.hint)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`gpuwait status | head -1`): nothing left to say, and no one to
        # say it to. The status a shell shows for a program that SIGPIPE ended.
        return EXIT_BROKEN_PIPE


def _subcommand(name: str, argv: list[str]) -> int:
    # Imported on demand: a plain `gpuwait CMD` launch pays for none of the subcommands.
    module = importlib.import_module(module_name(name))
    # A command that reads its arguments by hand has `parse`; the others, a parser.
    parse = getattr(module, "parse", None)
    options = parse(argv) if parse is not None else module.build_parser().parse_args(argv)
    code: int = module.run(options)
    return code


#: Allocations (less deallocations) between two collections of the youngest generation; the
#: default is 700.
YOUNG_COLLECTION_THRESHOLD = 50_000


def entry_point() -> NoReturn:
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
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, older, oldest)
    code = main()
    for stream in (sys.stdout, sys.stderr):
        # The reader may have gone away (`| head`) or closed the stream: nothing to add then.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code if 0 <= code <= 255 else EXIT_USAGE)
