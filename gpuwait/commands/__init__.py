"""gpuwait's commands: one module per command, each with `build_parser()` (on
`gpuwait.commands.parsing.Parser`) and `run(options) -> int` (a command that reads its arguments
by hand, so that a command line reaches it byte for byte, also has `parse(argv)`). Only this
package and gpuwait.cli print.

The default command, `gpuwait [OPTIONS] [--] COMMAND`, is gpuwait.commands.run. This file imports
nothing: the console script reads SUBCOMMANDS before it loads anything else (gpuwait.cli).
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

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


def warn_unknown_variables(environ: Mapping[str, str], quiet: bool = False) -> None:
    """Warn of GPUWAIT_* variables gpuwait does not know, naming the likely intended one: a
    misspelled one would otherwise be ignored without a word, and its setting keep its
    default (a whole GPU reserved for a job meant to take 6G). `quiet` (-q): each is said
    once, by the first quiet gpuwait that finds it, not in every step of a script that runs
    them all with -q. A launch only looks at the names; the settings are imported when one is
    set."""
    names = [name for name in environ if name.startswith("GPUWAIT_")]
    if not names:
        return
    from gpuwait.commands import output
    from gpuwait.config import not_said_quietly, unknown_variables

    unknown = unknown_variables(names)
    if quiet and unknown:
        new = not_said_quietly(name for name, _ in unknown)
        unknown = [(name, match) for name, match in unknown if name in new]
    for name, match in unknown:
        guess = f"did you mean {match}?" if match else "`gpuwait --help` lists the settings"
        output.warn(f"{name} is not a gpuwait setting and is ignored ({guess})")
