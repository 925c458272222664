"""`gpuwait completion {bash,zsh,fish}`: completion for gpuwait's options and subcommands."""

from __future__ import annotations

import argparse

from gpuwait import _completion

SHELLS = ("bash", "zsh", "fish")


def build_parser(parser_class: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = parser_class(
        prog="gpuwait completion",
        description="Print a completion script for gpuwait. `gpuwait shell-init` includes it; "
        "this is for completion without the hook, e.g. "
        "`gpuwait completion fish > ~/.config/fish/completions/gpuwait.fish`.",
    )
    parser.add_argument("shell", choices=SHELLS, help="the shell to print completion for")
    return parser


def main(argv: list[str], parser_class: type[argparse.ArgumentParser]) -> int:
    args = build_parser(parser_class).parse_args(argv)
    print(_completion.script(args.shell), end="")
    return 0
