"""`gpuwait shell-init {bash,zsh,fish}`: the hook that runs chosen commands through gpuwait.

bash/zsh: `eval "$(gpuwait shell-init bash)"`; fish: `gpuwait shell-init fish | source`. The
hook defines one shell function per command in wrap_commands; each calls `gpuwait shell-hook`,
which applies the wrap rules (gpuwait/core/wrap.py). The script templates live in shell/ (packaged as gpuwait/shell).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import gpuwait
from gpuwait.commands import completion, output
from gpuwait.commands.common import load_settings
from gpuwait.commands.parsing import Parser
from gpuwait.config import OPTIONS_BY_NAME
from gpuwait.core.errors import GpuwaitError

SHELLS = ("bash", "zsh", "fish")


def build_parser() -> Parser:
    parser = Parser(
        prog="gpuwait shell-init",
        description="Print the shell hook that runs wrap_commands through gpuwait. "
        'bash/zsh: eval "$(gpuwait shell-init bash)"; fish: gpuwait shell-init fish | source',
    )
    parser.add_argument(
        "shell",
        type=completion.shell_argument("hook"),
        choices=SHELLS,
        help="the shell to print the hook for",
    )
    parser.add_argument(
        "--always",
        action="store_true",
        help="wrap in non-interactive shells too (scripts, `bash -c`); default: interactive only",
    )
    parser.add_argument(
        "--wrap-commands",
        metavar="LIST",
        help="comma-separated commands to wrap (default: the wrap_commands setting)",
    )
    parser.add_argument(
        "--no-completion", action="store_true", help="leave out completion for gpuwait itself"
    )
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        commands = load_settings({"wrap_commands": args.wrap_commands}).wrap_commands
    except GpuwaitError as exc:
        # A setting refused (`export GPUWAIT_SIM=sim.toml` above this line in an rc file, a
        # malformed config file): with no hook, every command would run bare, on GPUs other
        # jobs hold, with nothing more said. The hook goes in, and each line it runs through
        # gpuwait says what to fix; those it runs bare run.
        commands = _commands_asked(args.wrap_commands, exc)
        output.warn(
            f"{exc.message}; until that is fixed, each command the hook runs through gpuwait "
            "ends with this error"
        )
    script = hook_script(args.shell, commands, always=args.always)
    if not args.no_completion:
        script += completion.script(args.shell)
    print(only_in(args.shell, script), end="")
    return 0


def _commands_asked(value: str | None, refused: GpuwaitError) -> tuple[str, ...]:
    """The commands --wrap-commands names (`value`), else wrap_commands' default, where the
    settings were `refused`; that error again where `value` is not a valid list."""
    option = OPTIONS_BY_NAME["wrap_commands"]
    try:
        commands: tuple[str, ...] = option.parse(option.default if value is None else value)
    except (ValueError, TypeError):
        raise refused from None
    return commands


#: The variable only each shell sets, whatever mode it emulates.
_VERSION_VARIABLES = {"bash": "BASH_VERSION", "zsh": "ZSH_VERSION"}


def only_in(shell: str, script: str) -> str:
    """`script`, run by `shell` alone. The hook may land in ~/.profile, which /bin/sh (dash)
    reads too (a graphical login's Xsession, `sh -l`): dash cannot parse bash's or zsh's
    syntax, and a syntax error ends a non-interactive sh, the rest of the profile and the login
    with it. Quoted, the script is only a word to another shell, which goes on wrapping nothing
    (and says so where someone types)."""
    variable = _VERSION_VARIABLES.get(shell)
    if variable is None:  # fish's files are read by fish alone
        return script
    note = f"gpuwait: the hook of shell-init {shell} is for {shell}: this shell wraps nothing"
    # The comment that opens the hook stays readable above it.
    lines = script.splitlines(keepends=True)
    comments = 0
    while comments < len(lines) and lines[comments].startswith("#"):
        comments += 1
    head, body = "".join(lines[:comments]), "".join(lines[comments:])
    return (
        f"{head}"
        f'if [ -n "${{{variable}-}}" ]; then\n'
        f"eval {shlex.quote(body)}\n"
        f"else\n    case $- in *i*) echo {shlex.quote(note)} >&2 ;; esac\n"
        "fi\n"
    )


def gpuwait_invocation() -> list[str]:
    """How the hook starts this very gpuwait, whatever PATH, virtualenv or PYTHONPATH is later.

    Like a console script, it names the interpreter and the directory gpuwait was imported from.
    That directory takes the place of the current one at the head of sys.path: a wrapped
    `python` runs in project directories, whose own `signal.py` must not shadow gpuwait's.
    """
    root = str(_package().parent)
    # A string in double quotes (JSON's are Python's too): the bash and zsh hooks, quoted once
    # more in single quotes (`only_in`), stay readable.
    code = (
        f"import sys; sys.path[0] = {json.dumps(root)}; "
        "from gpuwait.cli import entry_point; entry_point()"
    )
    return [sys.executable, "-c", code]


def _package() -> Path:
    """The directory this gpuwait was imported from."""
    return Path(gpuwait.__file__).resolve().parent


def hook_script(shell: str, commands: tuple[str, ...], always: bool) -> str:
    """The hook for `shell`. It checks, with the shell's own tests, that the interpreter and
    the package it names are still there: a shell outlives `pip uninstall gpuwait` or the
    removal of its environment, after which the invocation would end every wrapped command in
    a traceback. Then the gpuwait on PATH takes its place, as a new shell would hook it, or the
    command runs bare with one line saying why, as in a new shell where none is installed."""
    template = resources.files("gpuwait").joinpath("shell", f"gpuwait.{shell}").read_text()
    interpreter, cli = sys.executable, str(_package() / "cli.py")
    quote: Callable[[str], str]
    if shell == "fish":
        quote = completion.fish_quote
        invocation = " ".join(quote(word) for word in gpuwait_invocation())
        functions = [
            f"        function {name} --wraps {name} --description 'runs through gpuwait'\n"
            f"            __gpuwait_run {name} $argv\n"
            "        end"
            for name in commands
        ]
    else:
        quote = shlex.quote
        invocation = shlex.join(gpuwait_invocation())
        # The `function` keyword keeps an alias of the same name from being expanded here.
        # bash: `|| return`, as in __gpuwait_run, for its ERR trap under set -E.
        tail = " || return" if shell == "bash" else ""
        functions = [
            f'    function {name} {{ __gpuwait_run {name} "$@"{tail}; }}' for name in commands
        ]
    return (
        template.replace("@ALWAYS@", "1" if always else "")
        .replace("@GPUWAIT@", invocation)
        .replace("@PYTHON@", quote(interpreter))
        .replace("@PACKAGE@", quote(cli))
        .replace("@FUNCTIONS@", "\n".join(functions))
    )
