"""`gpuwait shell-hook [--explain] -- COMMAND [ARGS...]`: what the shell hooks call.

Runs COMMAND through gpuwait when the wrap rules (wrap_only_in, never_wrap, GPUWAIT_DISABLE, being
inside a gpuwait job) allow it, and otherwise replaces itself with the bare command, so its exit
status, stdin, terminal and signals are the command's own either way. `--explain` only says which.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from gpuwait import _output
from gpuwait._config import load_settings
from gpuwait._errors import EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, UsageError
from gpuwait._wrap import Decision, decide

USAGE = "usage: gpuwait shell-hook [--explain] -- COMMAND [ARGS...]"
HELP = f"""{USAGE}

Used by the functions that `gpuwait shell-init` defines: run COMMAND through gpuwait unless
the wrap rules say no (GPUWAIT_JOB_ID or GPUWAIT_DISABLE set, the directory is not under
wrap_only_in, or the command line matches never_wrap), in which case COMMAND runs bare.

  --explain   print "wrap" or "bare" and the reason, run nothing (exit 0 or 1)
"""


def main(argv: list[str], parser_class: type[argparse.ArgumentParser]) -> int:
    # Parsed by hand: everything after `--` must reach the command byte for byte.
    explain = False
    rest = list(argv)
    while rest and rest[0] != "--":
        option = rest.pop(0)
        if option == "--explain":
            explain = True
        elif option in ("-h", "--help"):
            print(HELP, end="")
            return 0
        else:
            raise UsageError(f"shell-hook: unknown option {option!r}; {USAGE}")
    command = rest[1:]
    if not command:
        raise UsageError(f"shell-hook: no command given; {USAGE}")
    decision = decision_for(command)
    if explain:
        print(f"{'wrap' if decision.wrap else 'bare'}: {decision.reason}")
        return 0 if decision.wrap else 1
    if decision.wrap:
        from gpuwait import cli

        return cli.main(["--", *command])
    return exec_bare(command)


def decision_for(command: list[str]) -> Decision:
    settings = load_settings({})
    cwds = [os.environ.get("PWD", "")]
    with contextlib.suppress(OSError):  # the directory may have been removed under the shell
        cwds.append(os.getcwd())
    return decide(command, cwds, os.environ, settings["wrap_only_in"], settings["never_wrap"])


def exec_bare(command: list[str]) -> int:
    """Become the command, as if the shell had started it."""
    sys.stdout.flush()
    sys.stderr.flush()
    # Python ignores these for itself; a command started by a shell gets the default.
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(signum, signal.SIG_DFL)
    try:
        os.execvp(command[0], command)
    except FileNotFoundError:
        _output.error(f"{command[0]}: command not found")
        return EXIT_NOT_FOUND
    except OSError as exc:
        _output.error(f"{command[0]}: {exc.strerror}")
        return EXIT_NOT_EXECUTABLE
    return 0  # pragma: no cover - execvp does not return
