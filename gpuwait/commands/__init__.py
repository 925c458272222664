"""gpuwait's commands: one module per command, each with `build_parser()` (on `Parser`, below)
and `run(options) -> int` (a command that reads its arguments by hand, so that a command line
reaches it byte for byte, also has `parse(argv)`). Only this package and gpuwait.cli print.

The default command, `gpuwait [OPTIONS] [--] COMMAND`, is gpuwait.commands.run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from gpuwait.core.errors import UsageError
from gpuwait.core.sizes import parse_whole

#: Subcommand -> one-line help. Each lives in gpuwait.commands.<name, '-' as '_'>.
SUBCOMMANDS = {
    "status": "GPUs, running jobs, the queue and batches (--json, --watch)",
    "cancel": "cancel jobs: waiting ones leave the queue, running ones get TERM",
    "log": "the event log: admit, start, finish, cancel, GPU lost/back (-f to follow)",
    "config": "every effective setting and where it came from",
    "sim": "simulated GPUs: `sim init FILE`, `sim job --vram SIZE ...`",
    "shell-init": "shell hook that runs python & co. through gpuwait: see docs/integrations.md",
    "shell-hook": "what the shell hook runs: COMMAND through gpuwait unless the wrap rules say no",
    "completion": "completion script for bash, zsh or fish",
    "estimate": "the VRAM learned from earlier runs: `estimate -- CMD ...`",
    "history": "recent runs: peak VRAM, load, wait and run time, exit (--json for scripts)",
    "idle": "processes holding VRAM on a GPU that does no work, any user's (--json)",
    "adopt": "give a process started without gpuwait a place in the queue: `adopt PID`",
}


def module_name(subcommand: str) -> str:
    return f"gpuwait.commands.{subcommand.replace('-', '_')}"


def warn_unknown_variables(environ: Mapping[str, str]) -> None:
    """Warn of GPUWAIT_* variables gpuwait does not know, naming the likely intended one: a
    misspelled one would otherwise be ignored without a word, and its setting keep its
    default (a whole GPU reserved for a job meant to take 6G). A launch only looks at the
    names; the settings are imported when one is set."""
    names = [name for name in environ if name.startswith("GPUWAIT_")]
    if not names:
        return
    from gpuwait.commands import output
    from gpuwait.config import unknown_variables

    for name, match in unknown_variables(names):
        guess = f"did you mean {match}?" if match else "`gpuwait --help` lists the settings"
        output.warn(f"{name} is not a gpuwait setting and is ignored ({guess})")


class Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line instead of printing usage and exiting.

    `options` holds every option and positional added, and the subcommands of `add_subparsers`,
    in order: what `gpuwait completion` offers.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before argparse's own __init__, which adds -h/--help through add_argument.
        self.options: list[argparse.Action] = []
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.options.append(action)
        return action

    def add_subparsers(self, **kwargs: Any) -> Any:
        action = super().add_subparsers(**kwargs)
        self.options.append(action)
        return action

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}; see '{self.prog} --help'", hint=self._suggestion(message))

    def _suggestion(self, message: str) -> str | None:
        """'did you mean --vram?' for a misspelled option or choice argparse refused."""
        import re  # only once something was refused

        from gpuwait.core.text import nearest

        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            # A subcommand's (`sim init --froce`) are reported by the parser above it.
            parsers: list[argparse.ArgumentParser] = [self]
            options: list[str] = []
            while parsers:
                for action in parsers.pop()._actions:
                    options += action.option_strings
                    if isinstance(action, argparse._SubParsersAction):
                        parsers += action.choices.values()
            for word in unknown.group(1).split():
                if word.startswith("-"):
                    match = nearest(word.partition("=")[0], options)
                    if match is not None:
                        return f"did you mean {match}?"
            return None
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            match = nearest(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
            if match is not None:
                return f"did you mean '{match}'?"
        return None


#: The most lines `history -n` and `log -n` show.
MAX_LINES = 1_000_000


def whole_number(low: int, high: int) -> Callable[[str], int]:
    """argparse's `type=` for a whole number from `low` to `high`, refused in gpuwait's words
    (argparse's own would be "invalid int value", and int() takes '٣' for a three)."""

    def parse(text: str) -> int:
        try:
            return parse_whole(text, low, high)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def terminal_columns() -> int:
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


class HelpFormatter(argparse.HelpFormatter):
    """argparse builds a formatter for every option it adds (to check its metavar), and its own
    way of measuring the terminal imports shutil: some 2 ms of every launch. Measured directly."""

    def __init__(
        self,
        prog: str,
        indent_increment: int = 2,
        max_help_position: int = 24,
        width: int | None = None,
    ) -> None:
        width = terminal_columns() - 2 if width is None else width
        super().__init__(prog, indent_increment, max_help_position, width)


class RawHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The same, for a description or epilog laid out by hand (kept as written)."""
