"""gpuwait signalled at one step of its work: SIGKILL, as the OOM killer or `kill -9` would,
or a Ctrl-C landing just then."""

from __future__ import annotations

import sys

#: `python -c SIGNALLED MODULE FUNCTION WHEN SIGNAL WHOM gpuwait-args...`: gpuwait, with
#: MODULE.FUNCTION made to send SIGNAL (a name) to gpuwait (WHOM = self) or to its whole process
#: group (WHOM = group, as a terminal sends Ctrl-C) before it runs (WHEN = before) or once it
#: has returned (WHEN = after).
_SIGNALLED = """
import importlib, os, signal, sys
module, name, when, signame, whom = sys.argv[1:6]
del sys.argv[1:6]
target = importlib.import_module(module)
real = getattr(target, name)
def signalled(*args, **kwargs):
    result = real(*args, **kwargs) if when == "after" else None
    signum = getattr(signal, signame)
    if whom == "group":
        os.killpg(0, signum)
    else:
        os.kill(os.getpid(), signum)
    return result if when == "after" else real(*args, **kwargs)
setattr(target, name, signalled)
from gpuwait.cli import entry_point
entry_point()
"""


def gpuwait_signalled_at(
    module: str, function: str, signame: str, whom: str = "self", when: str = "before"
) -> list[str]:
    """The argv prefix of a gpuwait that gets `signame` at `module.function` (see _SIGNALLED)."""
    assert when in ("before", "after") and whom in ("self", "group")
    return [sys.executable, "-c", _SIGNALLED, module, function, when, signame, whom]


def gpuwait_killed_at(module: str, function: str, when: str = "before") -> list[str]:
    """The argv prefix of a gpuwait that dies by SIGKILL at `module.function`."""
    return gpuwait_signalled_at(module, function, "SIGKILL", when=when)
