"""Whether a shell hook should run a command through gpuwait: one rule set for every shell.

The shell side (shell/) only steps aside on its own inside a gpuwait job or when
GPUWAIT_DISABLE is set, since those checks cost nothing there; everything else is decided here.
"""

from __future__ import annotations

import fnmatch
import os.path
import re
from collections.abc import Iterable, Mapping, Sequence

from gpuwait.core.record import Record


class Decision(Record, frozen=True):
    wrap: bool
    reason: str


def disabled(env: Mapping[str, str]) -> bool:
    """GPUWAIT_DISABLE set to anything but empty or 0, compared exactly as the shell hooks
    compare it (they decide first, without Python): " 0" disables, as it does there."""
    return env.get("GPUWAIT_DISABLE", "") not in ("", "0")


def decide(
    argv: Sequence[str],
    cwds: Iterable[str],
    env: Mapping[str, str],
    wrap_only_in: Sequence[str],
    never_wrap: Sequence[str],
    job_ended: bool = False,
    missing_script: str | None = None,
) -> Decision:
    """Wrap `argv` started in a directory known by the paths `cwds`? With the reason, for --explain.

    `cwds` holds the shell's logical $PWD as well as the physical directory, so a glob naming
    either the symlink or its target matches. `job_ended`: the job GPUWAIT_JOB_ID names has
    ended (its GPUWAIT_JOB_PID is gone), and this process outlived it: the rules apply as
    anywhere else. `missing_script`: the script a Python command line names (or a launcher's workers
    run), where no such file is there: the interpreter fails at once, with nothing to wait for.
    """
    job = env.get("GPUWAIT_JOB_ID")
    if job and not job_ended:
        return Decision(False, f"already inside gpuwait job {job} (GPUWAIT_JOB_ID)")
    if disabled(env):
        return Decision(False, "GPUWAIT_DISABLE is set")
    directories = [os.path.normpath(c) for c in cwds if c]
    if wrap_only_in:
        matched = _matching_glob(directories, wrap_only_in, env)
        if matched is None:
            return Decision(
                False, f"{directories[0] if directories else '?'} is not under wrap_only_in"
            )
    line = " ".join(argv)
    for pattern in never_wrap:
        if fnmatch.fnmatchcase(line, pattern):
            return Decision(False, f"the command line matches never_wrap {pattern!r}")
    hidden = env.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hides_every_gpu(hidden):
        return Decision(
            False, f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU: the command runs on the CPU"
        )
    if missing_script is not None:
        program = os.path.basename(argv[0]) if argv else "python"
        return Decision(False, f"no script {missing_script}: {program} says so at once")
    return Decision(True, "no rule says otherwise")


def hides_every_gpu(visible: str) -> bool:
    """CUDA_VISIBLE_DEVICES set so that CUDA sees no GPU: its first entry is empty
    (`CUDA_VISIBLE_DEVICES= python prep.py`), a negative number (`=-1`) or a word that names no
    GPU (`=none`, `=NoDevFiles` as some batch systems set), where CUDA stops reading the list.
    The command asks to run on the CPU: there is nothing to wait for. An index, even of no GPU
    here (`=7`, a typo), a UUID (`GPU-...`, `MIG-...`) or a shell's expansion (`$GPU`) may
    name a GPU, and is not such a value. The shell hook and the check of a wrapper's
    assignments (runner.launch) read it by this one rule."""
    first = visible.split(",", 1)[0].strip()
    return not first or re.fullmatch(r"-[0-9]+|[A-Za-z_][A-Za-z0-9_]*", first) is not None


def _matching_glob(
    directories: Sequence[str], globs: Sequence[str], env: Mapping[str, str]
) -> str | None:
    """The first glob that matches one of `directories` or a directory above it."""
    home = env.get("HOME", "")
    for glob in globs:
        pattern = glob.rstrip("/") or "/"
        if home and (pattern == "~" or pattern.startswith("~/")):
            pattern = home.rstrip("/") + pattern[1:]
        for directory in directories:
            path = directory
            while True:
                if fnmatch.fnmatchcase(path, pattern):
                    return glob
                parent = os.path.dirname(path)
                if parent == path:
                    break
                path = parent
    return None
