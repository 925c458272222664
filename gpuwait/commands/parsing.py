"""The commands' argument parsing: `Parser` (argparse, errors as one line with a suggestion),
help formatting to the terminal's width, and argument types in gpuwait's words."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from gpuwait.core.errors import UsageError
from gpuwait.core.sizes import MAX_GPUS, NEGATIVE_VALUE, parse_whole

if TYPE_CHECKING:
    from _typeshed import SupportsWrite


class Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line instead of printing usage and exiting.

    `options` holds every option and positional added (those of its groups too), and the
    subcommands of `add_subparsers`, in order: what `gpuwait completion` offers.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        # `--vram -1G`, `--timeout -5s`: a value, refused by its own parser with a reason, not
        # an unknown option leaving --vram "expected one argument" (argparse takes only plain
        # negative numbers for values). No option of gpuwait's looks like one.
        self._negative_number_matcher = NEGATIVE_VALUE
        #: The arguments `parse_args` was given, for `error` to say which one was the slip.
        self._given: list[str] = []

    @property
    def options(self) -> list[argparse.Action]:
        # argparse's own list: an option added through a group (`-n N | --all`) is there too.
        return list(self._actions)

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        # argparse drops an OSError while writing help, usage or the version: a --help too long
        # for stdout's buffer, into a full disk or a reader that went away, would end with exit
        # 0 and nothing said. Raised, it is said and ends the command as any other output does.
        if message:
            (file or sys.stderr).write(message)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: None = None
    ) -> argparse.Namespace:
        # Arguments nobody took are said by the subcommand they were given to (`sim init
        # --name`), in its words and with its own options to suggest, not the ones above it.
        self._given = list(sys.argv[1:] if args is None else args)
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._chosen(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # The words as typed, for `error` to name the one it refuses (argparse names a part).
        given = sys.argv[1:] if args is None else args
        self._given = list(given[: given.index("--")] if "--" in given else given)
        return super().parse_known_args(args, namespace)

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        # `--name=--`: argparse before Python 3.13 drops the value as the end of the options
        # and gives [] where one value is asked, which the option's own check then meets. The
        # words `=` joins to an option are its value (`--name --` is refused as no value).
        if action.option_strings and action.nargs in (None, "?") and arg_strings == ["--"]:
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value
        return super()._get_values(action, arg_strings)

    def _chosen(self, parsed: argparse.Namespace) -> Parser:
        """The parser of the subcommand `parsed` names (one of its own, where it has them),
        else this one."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and action.dest != argparse.SUPPRESS:
                chosen = action.choices.get(str(getattr(parsed, action.dest, "")))
                if isinstance(chosen, Parser):
                    return chosen._chosen(parsed)
        return self

    def error(self, message: str) -> NoReturn:
        import re  # only once something was refused

        # `-vram 6G`: argparse reads -v and a value 'ram' it does not take, and says that.
        glued = re.fullmatch(r"argument (-\w)(?:/\S+)?: ignored explicit argument '(.*)'", message)
        if glued:
            word = glued.group(1) + glued.group(2)
            hint = self._suggestion(f"unrecognized arguments: -{word}")
            # `-qvram 4G`: flags taken before it (-q) are part of the word as typed, and of
            # what was meant (-q --vram).
            flags = next(
                (
                    typed[: -len(word) + 1]
                    for typed in getattr(self, "_given", ())
                    if typed.startswith("-")
                    and not typed.startswith("--")
                    and len(typed) >= len(word)
                    and typed.endswith(word[1:])
                ),
                None,
            )
            if flags not in (None, "-"):
                word = flags + word[1:]
                hint = (
                    None
                    if hint is None or self._ends_at_once(flags)
                    else hint.replace("did you mean ", f"did you mean {flags} ")
                )
            raise UsageError(
                f"{word} is no option: a long option takes two dashes; see '{self.prog} --help'",
                hint=hint,
            )
        unknown = self._unknown_option(message)
        if unknown is not None:
            message = f"unrecognized arguments: {unknown}"
        raise UsageError(f"{message}; see '{self.prog} --help'", hint=self._suggestion(message))

    def _ends_at_once(self, flags: str) -> bool:
        """Whether one of the short `flags` (-qh) prints something and ends (help, version):
        a line that keeps it runs nothing of what was meant."""
        return any(
            isinstance(
                self._option_string_actions.get(f"-{flag}"),
                (argparse._HelpAction, argparse._VersionAction),
            )
            for flag in flags[1:]
        )

    def _unknown_option(self, message: str) -> str | None:
        """The first word given that looks like no option of this parser's, where `message`
        refuses a positional's value (`adopt -vram 2G PID`: argparse sets -vram aside and
        takes 2G for the pid): the option typed wrong, not the value after it, is the slip."""
        import re  # only once something was refused

        refused = re.match(r"argument ([^ :/]+): ", message)
        positionals = {a.metavar or a.dest for a in self._actions if not a.option_strings}
        if refused is None or refused.group(1) not in positionals:
            return None
        options = [o for action in self._actions for o in action.option_strings]
        for word in self._given:
            if word == "--":
                break
            name = word.partition("=")[0]
            if (
                word.startswith("-")
                and word != "-"
                and not NEGATIVE_VALUE.match(word)
                and not any(o.startswith(name) for o in options if o.startswith("--"))
                and name not in options
            ):
                return word
        return None

    def _suggestion(self, message: str) -> str | None:
        """'did you mean --vram?' for a misspelled option or choice argparse refused."""
        import re  # only once something was refused

        from gpuwait.core.text import nearest, nearest_option

        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            # Said by the parser that was given them (`parse_args`): its options alone.
            options = [o for action in self._actions for o in action.option_strings]
            for word in unknown.group(1).split():
                if word.startswith("-"):
                    name = word.partition("=")[0]
                    # `--VRAM`: the long option typed in capitals, too far from it for nearest.
                    folded = name.lower() if name.startswith("--") else name
                    # `-V`, as python and most tools take it: too short for nearest.
                    folded = "--version" if name == "-V" else folded
                    if folded not in options and re.fullmatch(r"-[a-z]", folded):
                        # `status -w`: a short option it lacks, where one long option alone
                        # begins with its letter (--watch).
                        begun = [o for o in options if o.startswith(f"-{folded}")]
                        folded = begun[0] if len(begun) == 1 else folded
                    match = folded if folded in options else _OTHER_OPTIONS.get(folded)
                    if match not in options:
                        match = nearest_option(name, options)
                    # `--vram4G`: the option and its value, the space between them left out.
                    glued = re.fullmatch(r"(--[a-z-]+?)([0-9][^=]*)", name)
                    taken = self._option_string_actions.get(glued.group(1)) if glued else None
                    if glued and taken is not None and taken.nargs != 0:
                        match = f"{glued.group(1)} {glued.group(2)}"
                    if match is not None:
                        return f"did you mean {match}?"
            return None
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            match = nearest(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
            if match is not None:
                return f"did you mean '{match}'?"
        return None


#: What other tools call gpuwait's options (Slurm's `--mem`, a GPU's memory as `--gpu-mem`),
#: too far in letters for nearest, which would name an option close in letters alone
#: (`--mem`: `--name`): gpuwait's option, where the parser has it.
_OTHER_OPTIONS = dict.fromkeys(
    ("--mem", "--memory", "--mem-per-gpu", "--gpu-mem", "--gpu-memory", "--gpu-ram"), "--vram"
)


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


def add_gpus_option(parser: argparse.ArgumentParser, help_text: str) -> None:
    """`--gpus N`: the GPUs a job runs on, taken as `gpuwait --gpus N` takes them (default: 1)."""
    parser.add_argument(
        "--gpus", type=whole_number(1, MAX_GPUS), default=1, metavar="N", help=help_text
    )


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


_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,99}")


def check_name(option: str, value: str | None) -> None:
    """UsageError where `value`, given to `option` (`--name`, `--batch`, `--once`), is no name
    a job can have: one `status`, `cancel` and `--after` take as typed, in any shell."""
    if value is not None and not _NAME_RE.fullmatch(value):
        raise UsageError(
            f"{option} {value!r}: use up to 100 letters, digits and . _ : @ + -, "
            "starting with a letter or digit"
        )
