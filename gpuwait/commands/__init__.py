"""gpuwait's commands: one module per command, each with `build_parser()` and
`run(options) -> int` (a command that reads its arguments by hand, so that a command line
reaches it byte for byte, also has `parse(argv)`). Only this package and gpuwait.cli print.

The default command, `gpuwait [OPTIONS] [--] COMMAND`, is gpuwait.commands.run.
"""

from __future__ import annotations

#: Subcommand -> one-line help. Each lives in gpuwait.commands.<name, '-' as '_'>.
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


def module_name(subcommand: str) -> str:
    return f"gpuwait.commands.{subcommand.replace('-', '_')}"
