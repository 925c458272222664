"""`gpuwait shell-hook [--explain] -- COMMAND [ARGS...]`: what the shell hooks call.

Runs COMMAND through gpuwait when the wrap rules (wrap_only_in, never_wrap, GPUWAIT_DISABLE, being
inside a gpuwait job) allow it, and otherwise replaces itself with the bare command, so its exit
status, stdin, terminal and signals are the command's own either way; in a subshell that runs
the hook's function (`python train.py &`) it stays the bare command's parent instead, so that
`kill $!` ends the command. `--explain` only says which.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Sequence

from gpuwait.commands.common import load_settings
from gpuwait.config import OPTIONS_BY_NAME, wrap_rules
from gpuwait.core.cmdkey import launcher_script_file, python_script_file
from gpuwait.core.errors import GpuwaitError, UsageError
from gpuwait.core.text import command_line, whole_number
from gpuwait.core.wrap import Decision, decide
from gpuwait.linux import outlived, proc
from gpuwait.linux.signals import end_with_parent
from gpuwait.runner.launch import exec_bare, forget_job

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpuwait.commands.parsing import Parser

USAGE = "usage: gpuwait shell-hook [--explain] -- COMMAND [ARGS...]"
HELP = f"""{USAGE}

Used by the functions that `gpuwait shell-init` defines: run COMMAND through
gpuwait unless the wrap rules say no (GPUWAIT_JOB_ID or GPUWAIT_DISABLE set,
the directory is not under wrap_only_in, or the command line matches
never_wrap), in which case COMMAND runs bare.

  --explain   print "wrap" or "bare" and the reason, run nothing (exit 0 or 1)
"""


class Options:
    """The options `parse` read. Not argparse's Namespace: a line the hook runs bare, on every
    `python` typed, would load argparse for nothing."""

    def __init__(self) -> None:
        self.explain = False
        self.help = False
        self.command: list[str] = []


def build_parser() -> Parser:
    """The options, for completion; `parse` reads them (by hand)."""
    from gpuwait.commands.parsing import Parser

    parser = Parser(prog="gpuwait shell-hook", usage=USAGE)
    parser.add_argument(
        "--explain", action="store_true", help='print "wrap" or "bare" and why, run nothing'
    )
    return parser


def parse(argv: list[str]) -> Options:
    # By hand: everything after `--` must reach the command byte for byte.
    options = Options()
    rest = list(argv)
    while rest and rest[0] != "--":
        option = rest.pop(0)
        if option == "--explain":
            options.explain = True
        elif option in ("-h", "--help"):
            options.help = True
            return options
        elif not option.startswith("-"):
            # `shell-hook python train.py`: the command's first word, not an option.
            explain = " --explain" if options.explain else ""
            raise UsageError(
                f"shell-hook: the command comes after --; {USAGE}",
                hint=f"gpuwait shell-hook{explain} -- {command_line([option, *rest])}",
            )
        else:
            from gpuwait.core.text import nearest_option  # only once an option is not known

            match = nearest_option(option, ("--explain", "--help"))
            raise UsageError(
                f"shell-hook: unknown option {option!r}; {USAGE}",
                hint=None if match is None else f"did you mean {match}?",
            )
    options.command = rest[1:]
    if not options.command:
        raise UsageError(f"shell-hook: no command given; {USAGE}")
    return options


def run(options: Options) -> int:
    if options.help:
        print(HELP, end="")
        return 0
    command: list[str] = options.command
    if options.explain:
        command = _as_typed(command)
    shell_pids = _hook_shell_pids()
    ended = _job_ended()
    decision = decision_for(command, ended)
    if options.explain:
        decision = _not_hooked(command) or decision
        print(f"{'wrap' if decision.wrap else 'bare'}: {decision.reason}")
        return 0 if decision.wrap else 1
    main, current = shell_pids
    in_subshell = _in_hook_subshell(main, current)
    if in_subshell:
        # A subshell runs the hook's function (`python train.py &`, a pipeline's stage), and
        # `kill $!` reaches that subshell alone: bare, the command is the process killed. Its
        # job ends with it, waiting or running, as by a TERM sent to gpuwait, and so does a
        # command run bare. (A shell that ran this call in the subshell's place made gpuwait
        # that process.)
        end_with_parent(signal.SIGTERM, current)
    if decision.wrap:
        from gpuwait.commands import run as run_command

        if ended:
            forget_job(os.environ)
        launch = run_command.build_parser().parse_args(["--", *command])
        # Where it would wait for ever (inside a job, or piped to one that holds the GPU it
        # needs), the command runs bare, as the hook runs any command inside a job.
        launch.from_hook = True
        return run_command.run(launch)
    if in_subshell:
        from gpuwait.runner.bare import run_bare  # only here: the rest become the command

        return run_bare(command)
    return exec_bare(command)


def _as_typed(command: list[str]) -> list[str]:
    """For --explain: the line as the shell runs it. After the shells' `time` keyword (zsh's
    `noglob` modifier) what follows runs as typed alone would, the hook's function too; the
    NAME=VALUE words before the command (`GPUWAIT_DEFAULT_VRAM=8G python x.py`) are set for
    it, so they go into this process's environment, where the rules read them."""
    if command[0] in ("time", "noglob"):
        command = (command[2:] if command[1:2] == ["-p"] else command[1:]) or command
    while len(command) > 1 and re.match(r"[A-Za-z_][A-Za-z0-9_]*=", command[0]):
        name, _, value = command[0].partition("=")
        os.environ[name] = value
        command = command[1:]
    return command


def _not_hooked(command: list[str]) -> Decision | None:
    """For --explain: a line typed so runs no function of the hook's, whatever the rules say
    (`pip install x`, `.venv/bin/python x.py`, `command python x.py`); None where one runs it."""
    try:
        wrapped = load_settings({}).wrap_commands
    except GpuwaitError:  # said where the line is wrapped; a bare one needs no settings
        wrapped = OPTIONS_BY_NAME["wrap_commands"].default
    program = command[0]
    if program in wrapped:
        return None
    if program in ("command", "builtin") and len(command) > 1:
        return Decision(False, f"`{program}` runs {command_line(command[1:2])} past the hook")
    if program == "exec" and len(command) > 1:
        return Decision(
            False,
            f"`exec` runs {command_line(command[1:2])} past the hook in bash and fish (zsh's "
            "runs the hook's function: ask without `exec` there)",
        )
    return Decision(
        False,
        f"{command_line(command[:1])} is not in wrap_commands ({', '.join(wrapped)}): the hook "
        "has no function for it, unless its `shell-init --wrap-commands` named it",
    )


def decision_for(command: list[str], job_ended: bool) -> Decision:
    try:
        settings = load_settings({})
    except GpuwaitError:
        # A setting that cannot be read (`export GPUWAIT_SIM=sim.toml`, a malformed config
        # file) is refused where the line would run through gpuwait; a line the rules run bare
        # (`python --version`, `CUDA_VISIBLE_DEVICES= python prep.py`, one outside the user's
        # wrap_only_in) needs none of them and runs as typed. The user's own rules where they
        # can still be read, else those that hold whichever settings do.
        rules = wrap_rules() or ((), OPTIONS_BY_NAME["never_wrap"].default)
        decision = _decide(command, job_ended, *rules)
        if decision.wrap:
            raise
        return decision
    return _decide(command, job_ended, settings.wrap_only_in, settings.never_wrap)


def _decide(
    command: list[str], job_ended: bool, wrap_only_in: Sequence[str], never_wrap: Sequence[str]
) -> Decision:
    cwds = [os.environ.get("PWD", "")]
    with contextlib.suppress(OSError):  # the directory may have been removed under the shell
        cwds.append(os.getcwd())
    # A mistyped script (`python trian.py`, `torchrun trian.py`) would wait for a GPU before
    # python says it is not there: run bare, python says so at once.
    missing = None
    with contextlib.suppress(OSError):
        here = os.getcwd()
        script = python_script_file(command, here) or launcher_script_file(command, here)
        if script is not None and not os.path.exists(script):
            missing = script
    return decide(
        command,
        cwds,
        os.environ,
        wrap_only_in,
        never_wrap,
        job_ended,
        missing_script=missing,
    )


#: MAIN/PID from the hooks: the shell whose hook calls ($$) and the (sub)shell that runs the
#: hook's function. In a variable, which an older gpuwait installed under a shell hooked by this
#: one ignores without a word (its name is no GPUWAIT_ setting's), where an option it knows not
#: would end every wrapped command with a usage error.
SHELL_PID_VARIABLE = "_GPUWAIT_SHELL_PID"


def _hook_shell_pids() -> tuple[int, int]:
    """The pids the hook put in SHELL_PID_VARIABLE, taken out of the environment the command
    inherits; (0, 0) where there are none."""
    main, _, current = os.environ.pop(SHELL_PID_VARIABLE, "").partition("/")
    pids = (whole_number(main), whole_number(current))
    return (pids[0], pids[1]) if pids[0] is not None and pids[1] is not None else (0, 0)


def _in_hook_subshell(main: int, current: int) -> bool:
    """Whether the hook's function runs in a subshell of the main shell (pids from
    `_hook_shell_pids`): `current` is this process's parent, or has ended already (this
    process then has another: its pid gone, or a zombie its shell has not reaped yet). A live
    process other than the parent (a value the hook did not set) names no subshell: ending with
    it would end this process at once, the line unrun."""
    if main == current or current == os.getpid():
        return False
    return current == os.getppid() or not proc.is_alive(current, None)


def _job_ended() -> bool:
    """Has the job this process was started in ended, as the hooks tell it? (The rule is
    gpuwait.linux.outlived's, gpuwait.checkpoint's too.)"""
    return outlived.job_ended(os.environ, os.getpid())
