"""A bin directory with `gpuwait` and `python` as a user has them on PATH, for shell-level tests.

Both are small scripts that start this checkout's gpuwait (and the test interpreter) with the
checkout's path baked in, so they keep working under `env -i` and in cron's or make's bare
environment.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from conftest import REPO

CONSOLE_SCRIPT = (
    f"import sys; sys.path[0] = {str(REPO)!r}; from gpuwait.cli import entry_point; entry_point()"
)


def make_bin(directory: Path) -> Path:
    """Write `gpuwait`, `python` and `python3` scripts into `directory` and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    python = shlex.quote(sys.executable)
    scripts = {
        # As a console script does: the checkout, not the current directory, heads sys.path.
        "gpuwait": f"exec {python} -c {shlex.quote(CONSOLE_SCRIPT)} " + '"$@"',
        "python": f'exec {python} "$@"',
        "python3": f'exec {python} "$@"',
    }
    for name, line in scripts.items():
        path = directory / name
        path.write_text(f"#!/bin/sh\n{line}\n")
        path.chmod(0o755)
    return directory


def env_with_bin(directory: Path) -> dict[str, str]:
    """os.environ with `directory` first on PATH."""
    return {**os.environ, "PATH": f"{directory}{os.pathsep}{os.environ['PATH']}"}


def with_program(directory: Path, name: str, script: str) -> dict[str, str]:
    """Write `script` into `directory` as the program `name` (a stand-in for one not installed
    here) and return os.environ with `directory` first on PATH."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(script)
    (directory / name).chmod(0o755)
    return env_with_bin(directory)
