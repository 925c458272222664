"""`gpuwait shell-init {bash,zsh,fish}`: the hook that runs chosen commands through gpuwait.

bash/zsh: `eval "$(gpuwait shell-init bash)"`; fish: `gpuwait shell-init fish | source`. The
hook defines one shell function per command in wrap_commands; each calls `gpuwait shell-hook`,
which applies the wrap rules (gpuwait/core/wrap.py). The script templates live in shell/ (packaged as gpuwait/shell).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from importlib import resources
from pathlib import Path

import gpuwait
from gpuwait.commands import completion
from gpuwait.commands.parsing import Parser
from gpuwait.config import load_settings

SHELLS = ("bash", "zsh", "fish")


def build_parser() -> Parser:
    parser = Parser(
        prog="gpuwait shell-init",
        description="Print the shell hook that runs wrap_commands through gpuwait. "
        'bash/zsh: eval "$(gpuwait shell-init bash)"; fish: gpuwait shell-init fish | source',
    )
    parser.add_argument("shell", choices=SHELLS, help="the shell to print the hook for")
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
    settings = load_settings({"wrap_commands": args.wrap_commands})
    print(hook_script(args.shell, settings.wrap_commands, always=args.always), end="")
    if not args.no_completion:
        print(completion.script(args.shell), end="")
    return 0


def gpuwait_invocation() -> list[str]:
    """How the hook starts this very gpuwait, whatever PATH, virtualenv or PYTHONPATH is later.

    Like a console script, it names the interpreter and the directory gpuwait was imported from.
    That directory takes the place of the current one at the head of sys.path: a wrapped
    `python` runs in project directories, whose own `signal.py` must not shadow gpuwait's.
    """
    root = str(Path(gpuwait.__file__).resolve().parent.parent)
    code = f"import sys; sys.path[0] = {root!r}; from gpuwait.cli import entry_point; entry_point()"
    return [sys.executable, "-c", code]


def hook_script(shell: str, commands: tuple[str, ...], always: bool) -> str:
    template = resources.files("gpuwait").joinpath("shell", f"gpuwait.{shell}").read_text()
    if shell == "fish":
        invocation = " ".join(completion.fish_quote(word) for word in gpuwait_invocation())
        functions = [
            f"    function {name} --wraps {name} --description 'runs through gpuwait'\n"
            f"        __gpuwait_run {name} $argv\n"
            "    end"
            for name in commands
        ]
    else:
        invocation = shlex.join(gpuwait_invocation())
        # The `function` keyword keeps an alias of the same name from being expanded here.
        functions = [f'    function {name} {{ __gpuwait_run {name} "$@"; }}' for name in commands]
    return (
        template.replace("@ALWAYS@", "1" if always else "")
        .replace("@GPUWAIT@", invocation)
        .replace("@FUNCTIONS@", "\n".join(functions))
    )
