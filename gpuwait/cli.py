"""Command line entry point: `main(argv) -> int`, which tests call directly."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from gpuwait import __version__, _output
from gpuwait._config import OPTIONS, load_settings, show_value
from gpuwait._errors import EXIT_BROKEN_PIPE, EXIT_USAGE, GpuwaitError, UsageError

#: Subcommand -> one-line help. Each lives in gpuwait.commands.<name, '-' as '_'> and has
#: `main(argv, parser_class) -> int`.
SUBCOMMANDS = {
    "status": "GPUs, running jobs, the queue and batches (--json, --watch)",
    "cancel": "cancel jobs: waiting ones leave the queue, running ones get TERM",
    "log": "the event log: admit, start, finish, cancel, GPU lost/back (-f to follow)",
    "config": "every effective setting and where it came from",
    "sim": "simulated GPUs: `sim init FILE`, `sim job --vram SIZE ...`",
    "shell-init": "shell hook that runs python & co. through gpuwait: see README",
    "shell-hook": "what the shell hook runs: COMMAND through gpuwait unless the wrap rules say no",
    "completion": "completion script for bash, zsh or fish",
    "estimate": "the VRAM learned from earlier runs of a command: `estimate -- CMD ...`",
    "history": "recent runs: peak VRAM, load, wait and run time, exit (--json for scripts)",
}

_EPILOG = """\
A program named like a subcommand runs with `gpuwait -- status`.
Exit status: the command's own; gpuwait's failures use 2 (usage), 3 (request can never fit),
4 (no GPU readings and on_no_gpu = fail), 5 (state dir unusable), 6 (an --after-ok job did not
succeed), 7 (cancelled while waiting), 8 (not permitted: another user's job), 124 (--timeout
passed), 126/127 (command not executable /
not found), 130/143 (interrupted while waiting).

settings (command line > GPUWAIT_<NAME> > config.toml > default):
"""


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}; see '{self.prog} --help'")


def _terminal_columns() -> int:
    """The terminal's width as shutil.get_terminal_size gives it: $COLUMNS, the tty, else 80."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _RunFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse builds a formatter for every option it adds (to check its metavar), and its own
    way of measuring the terminal imports shutil: some 2 ms of every launch. Measured directly."""

    def __init__(
        self,
        prog: str,
        indent_increment: int = 2,
        max_help_position: int = 24,
        width: int | None = None,
    ) -> None:
        width = _terminal_columns() - 2 if width is None else width
        super().__init__(prog, indent_increment, max_help_position, width)


class _RunParser(_Parser):
    """The default command's parser: its epilog (every setting's default) is built only for
    --help, since formatting the whole settings table would slow down every launch."""

    def format_help(self) -> str:
        if self.epilog is None:
            self.epilog = _settings_epilog()
        return super().format_help()


def _settings_epilog() -> str:
    lines = ["subcommands:"]
    lines += [f"  {name:<16}  {text}" for name, text in SUBCOMMANDS.items()]
    lines += ["", _EPILOG]
    for option in OPTIONS:
        lines.append(
            f"  {option.name:<16}  {option.help} (default: {show_value(option.name, option.parse(option.default))})"
        )
    return "\n".join(lines)


def build_run_parser() -> argparse.ArgumentParser:
    from gpuwait.commands.run import add_run_options

    parser = _RunParser(
        prog="gpuwait",
        usage="gpuwait [OPTIONS] [--] COMMAND [ARGS...]\n"
        f"       gpuwait {{{','.join(SUBCOMMANDS)}}} ...",
        description="Wait until COMMAND's VRAM fits on a GPU, pick the GPU, and run it there.",
        formatter_class=_RunFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gpuwait {__version__}")
    add_run_options(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run gpuwait with `argv` (without the program name) and return the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_list and args_list[0] in SUBCOMMANDS:
            return _subcommand(args_list[0], args_list[1:])
        return _run(args_list)
    except GpuwaitError as exc:
        _output.error(exc.message, exc.hint)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`gpuwait status | head -1`): nothing left to say, and no one to
        # say it to. The status a shell shows for a program that SIGPIPE ended.
        return EXIT_BROKEN_PIPE


def _run(argv: list[str]) -> int:
    from gpuwait.commands.run import run, settings_overrides

    args = build_run_parser().parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    settings = load_settings(settings_overrides(args))
    return run(args, command, settings)


def _subcommand(name: str, argv: list[str]) -> int:
    # Imported on demand: a plain `gpuwait CMD` launch pays for none of the subcommands.
    module = importlib.import_module(f"gpuwait.commands.{name.replace('-', '_')}")
    code: int = module.main(argv, _Parser)
    return code


def entry_point() -> NoReturn:
    """Console script: exit with main()'s status."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        # The reader may have gone away (`| head`) or closed the stream: nothing to add then.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    # Leave without tearing the interpreter down: every file is closed and every thread a daemon
    # by now, no atexit handler is registered, and unloading the modules costs about 10 ms: a
    # sixth of a launch.
    os._exit(code if 0 <= code <= 255 else EXIT_USAGE)
