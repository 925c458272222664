"""Where gpuwait keeps its files: the XDG base directories, as platformdirs gives them on Linux.

Worked out here rather than by importing platformdirs, whose import (it pulls in tempfile, shutil
and the compression modules) costs some 5 ms of every launch. tests/test_dirs.py checks that
the answers are platformdirs' own.
"""

from __future__ import annotations

import os

from gpuwait.core.errors import StateError

APP = "gpuwait"


def _home() -> str:
    # As platformdirs: an absolute HOME as it is; otherwise (unset or relative) the password file.
    home = os.environ.get("HOME", "")
    if not os.path.isabs(home):
        import pwd

        try:
            home = pwd.getpwuid(os.getuid()).pw_dir
        except KeyError:
            home = ""
        if not os.path.isabs(home):
            raise StateError(
                "cannot tell your home directory",
                hint="set HOME to an absolute path, or GPUWAIT_STATE_DIR to a directory of yours",
            )
    return home.rstrip("/") or "/"


def home_or_none() -> str | None:
    """The home directory the state and config directories are under by default (as
    `user_state_dir` tells it), or None where none can be told."""
    try:
        return _home()
    except StateError:
        return None


def _base(variable: str, under_home: str) -> str:
    """$variable when it is an absolute path (the XDG rule: relative ones are ignored), else ~/..."""
    path = os.environ.get(variable, "")
    return path if os.path.isabs(path) else f"{_home()}/{under_home}".replace("//", "/")


def user_state_dir() -> str:
    return os.path.join(_base("XDG_STATE_HOME", ".local/state"), APP)


def user_config_dir() -> str:
    return os.path.join(_base("XDG_CONFIG_HOME", ".config"), APP)


def site_config_dir() -> str:
    """The first absolute entry of $XDG_CONFIG_DIRS, else /etc/xdg."""
    dirs = [p for p in os.environ.get("XDG_CONFIG_DIRS", "").split(os.pathsep) if os.path.isabs(p)]
    return os.path.join(dirs[0] if dirs else "/etc/xdg", APP)
