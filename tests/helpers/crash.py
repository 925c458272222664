"""gpuwait killed at one step of its work: SIGKILL, as the OOM killer or `kill -9` would."""

from __future__ import annotations

import sys

#: `python -c KILLED MODULE FUNCTION WHEN gpuwait-args...`: gpuwait, with MODULE.FUNCTION made
#: to kill the process with SIGKILL before it runs (WHEN = before) or once it has returned
#: (WHEN = after).
_KILLED = """
import importlib, os, signal, sys
module, name, when = sys.argv[1:4]
del sys.argv[1:4]
target = importlib.import_module(module)
real = getattr(target, name)
def killed(*args, **kwargs):
    if when == "after":
        real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
setattr(target, name, killed)
from gpuwait.cli import entry_point
entry_point()
"""


def gpuwait_killed_at(module: str, function: str, when: str = "before") -> list[str]:
    """The argv prefix of a gpuwait that dies by SIGKILL at `module.function` (see _KILLED)."""
    assert when in ("before", "after")
    return [sys.executable, "-c", _KILLED, module, function, when]
