"""`%gpuwait`, the IPython line magic (`%load_ext gpuwait`): `gpuwait.reserve` for a notebook.

    %gpuwait 6G --priority 4 --timeout 30m    reserve (the command line's options)
    %gpuwait release                          give the room back
    %gpuwait status                           this kernel's reservation

It says what it does as the CLI does (gpuwait.commands.output: warnings, the waiting line,
`gpuwait: error: ...`), in the cell's output, and returns the Reservation. Only this module
knows IPython, and only as the object it is handed.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
from typing import TYPE_CHECKING, Any

from gpuwait.api.reserve import COMMAND_ONLY, Reservation, ReserveError, current, reserve_argv
from gpuwait.commands import output
from gpuwait.core.errors import UsageError
from gpuwait.core.sizes import format_size, parse_request

if TYPE_CHECKING:
    from gpuwait.commands.parsing import Parser

#: A negative size (`-6G`, `-.5G`), which argparse would take for an option.
_NEGATIVE = re.compile(r"-\.?\d")
USAGE = "usage: %gpuwait SIZE [OPTIONS] | %gpuwait release | %gpuwait status"


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magic_function(gpuwait_magic, magic_kind="line", magic_name="gpuwait")


def gpuwait_magic(line: str) -> Reservation | None:
    try:
        words = shlex.split(line)
    except ValueError as exc:
        output.error(f"{exc}; {USAGE}")
        return None
    if not words or words == ["status"]:
        return _status()
    if words == ["release"]:
        _release()
        return None
    if words[0] in ("status", "release"):
        output.error(f"%gpuwait {words[0]} takes nothing after it: {_typed(words[1:])}", USAGE)
        return None
    try:
        argv, quiet = _argv(words)
    except SystemExit:
        return None  # --help or --version: argparse has said it
    except UsageError as exc:
        output.error(exc.message, exc.hint)
        return None
    try:
        reservation = reserve_argv(argv, output.Console(quiet))
    except ReserveError as exc:
        output.error(exc.message, exc.hint)
        return None
    if reservation.held and not quiet:
        output.info(f"reserved {_where(reservation)} for this kernel (job {reservation.job_id})")
    return reservation


_DESCRIPTION = """\
Wait in gpuwait's queue until SIZE fits on a GPU, then hold it for this kernel:
CUDA_VISIBLE_DEVICES and the GPUWAIT_* variables are set in it, and the room goes
back with `%gpuwait release` or when the kernel ends. SIZE: 6G, 6 GiB, 6GB or 50%
of a card; left out, learned from earlier runs, else default_vram. Returns the
reservation (r = %gpuwait 6G)."""

_EPILOG = """\
  %gpuwait status       this kernel's reservation
  %gpuwait release      give its room back

See docs/python-api.md."""


def _parser() -> Parser:
    """The command line's parser, speaking as the magic: its usage, its help (without the
    options that concern only a command gpuwait starts, which a reservation refuses), and its
    name in what it refuses (`see '%gpuwait --help'`)."""
    from gpuwait.commands.run import build_parser

    parser = build_parser()
    parser.prog = "%gpuwait"
    parser.usage = USAGE.removeprefix("usage: ").replace("%", "%%")  # argparse formats it
    parser.description = _DESCRIPTION
    parser.epilog = _EPILOG
    hidden = {option for _, option in COMMAND_ONLY}
    for action in parser.options:
        if hidden.intersection(action.option_strings):
            action.help = argparse.SUPPRESS
    return parser


def _argv(words: list[str]) -> tuple[list[str], bool]:
    """The command line's words for `SIZE [OPTIONS]`, or `[OPTIONS] SIZE [OPTIONS]` (`-q 6G`),
    and whether they ask for quiet. Raises UsageError for what the parser refuses, and
    SystemExit once it has printed the help or the version."""
    parser = _parser()
    argv = _sized(words)
    options = parser.parse_args(argv)
    rest = list(options.command)
    if options.vram is None and rest and not rest[0].startswith("-") and argv[-len(rest) :] == rest:
        if rest[0] in ("status", "release"):
            # `%gpuwait -q status` meant status, which no size follows.
            given = _typed(argv[: -len(rest)])
            raise UsageError(
                f"%gpuwait {rest[0]} takes no options ({given}): write %gpuwait {rest[0]}"
            )
        # Options first: the size is the first word they leave, and options may follow it.
        argv = argv[: -len(rest)] + _sized(rest)
        options = parser.parse_args(argv)
    return argv, bool(options.quiet)


def _typed(words: list[str]) -> str:
    """`words` as they would be typed, quoted once: in quotes of their own ('-q', '--name x')
    where none needs the shell's, else as the shell's quotes say them (--name 'a b'); Python's
    repr over those quoted them twice."""
    typed = shlex.join(words)
    return f"'{typed}'" if typed == " ".join(words) else typed


def _sized(words: list[str]) -> list[str]:
    """The command line's options for `SIZE [OPTIONS]`: a size typed with its unit as a word of
    its own (`6 GiB`, `50 %`), as gpuwait.reserve("6 GiB") takes it, is one size, and a
    negative one (`-6G`) is a size refused as such, not an option."""
    first = words[0]
    if first.startswith("-") and not _NEGATIVE.match(first):
        return words
    if len(words) > 1 and not words[1].startswith("-"):
        with contextlib.suppress(ValueError):
            parse_request(first)
            return [f"--vram={first}", *words[1:]]
        with contextlib.suppress(ValueError):
            parse_request(f"{first} {words[1]}")
            return [f"--vram={first} {words[1]}", *words[2:]]
    return [f"--vram={first}", *words[1:]]


def _where(reservation: Reservation) -> str:
    gpus = ", ".join(f"GPU{i}" for i in reservation.gpus)
    return f"{format_size(reservation.vram)} on {gpus}"


def _status() -> Reservation | None:
    held = current()
    if held is None:
        output.info(f"no reservation in this kernel; {USAGE}")
        return None
    output.info(f"job {held.job_id} holds {_where(held)}; peak so far {format_size(held.peak)}")
    return held


def _release() -> None:
    held = current()
    if held is None:
        output.info("no reservation in this kernel to release")
        return
    held.release()
    output.info(f"released job {held.job_id} ({_where(held)}; peak {format_size(held.peak)})")
