"""Run gpuwait as other users (tests and benchmarks that run as root).

No accounts are needed: a process may take any numeric uid and gid. The interpreter may live
where other users cannot read it (under root's home), so the helper starts as root, imports
everything gpuwait will need, and only then drops to the user, before gpuwait's own main runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

#: argv[0..] of a process that becomes uid/gid/groups and then runs `gpuwait ARGS`. The word
#: "gpuwait" stands alone in its command line, as it does for `python -m gpuwait`.
AS_USER = r"""
import os, sys, importlib, pkgutil
# Everything is imported before the switch: the other user may not read this checkout.
import gpuwait, gpuwait.cli, ctypes, textwrap
for module in pkgutil.walk_packages(gpuwait.__path__, "gpuwait."):
    if module.name != "gpuwait.__main__":  # that one runs gpuwait when imported
        importlib.import_module(module.name)
import pwd, grp, unicodedata, threading, signal, json, zlib, errno, fcntl, locale, gettext, shutil, select, logging
import gpuwait.commands.run
gpuwait.commands.run.build_parser().format_help()  # argparse's and gettext's own lazy imports
uid, gid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups([int(g) for g in sys.argv[3].split(",") if g])
os.setgid(gid)
os.setuid(uid)
sys.argv = ["gpuwait", *sys.argv[5:]]
gpuwait.cli.entry_point()
"""


#: What AS_USER does once it is the user, in a rootless container (podman's default): the user
#: becomes uid 0 (and gid 0) of a user namespace of its own, which maps them onto the user
#: outside. Its /proc is the host's: the same pids, owners shown as the namespace maps them.
_INTO_USER_NAMESPACE = r"""
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: /proc/self is the user's again after setuid
if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
    raise SystemExit(f"no user namespace: {os.strerror(ctypes.get_errno())}")
for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
"""
ROOTLESS = AS_USER.replace("sys.argv = [", _INTO_USER_NAMESPACE + "sys.argv = [", 1)


def can_switch_users() -> bool:
    return os.geteuid() == 0


def user_argv(
    uid: int, gid: int, groups: Sequence[int], args: Sequence[str], rootless: bool = False
) -> list[str]:
    """argv that runs `gpuwait ARGS` as uid/gid with these supplementary groups; `rootless`:
    as root of a user namespace that is uid/gid outside, as a rootless container of theirs."""
    return [
        sys.executable,
        "-c",
        ROOTLESS if rootless else AS_USER,
        str(uid),
        str(gid),
        ",".join(str(g) for g in groups),
        "gpuwait",
        *args,
    ]


def program_as(
    uid: int, gid: int, groups: Sequence[int], directory: Path, python: str
) -> list[str]:
    """argv of a Python program of the user's own, `directory`/train.py, that runs `python`
    (which may call gpuwait's API) as uid/gid: its command line names no gpuwait."""
    script = directory / "train.py"
    # Its /proc is the user's again after the switch (PR_SET_DUMPABLE), as a program that
    # was started as the user has it.
    dumpable = "ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)\n"
    script.write_text(AS_USER.replace("gpuwait.cli.entry_point()", dumpable + python))
    script.chmod(0o644)
    return [sys.executable, str(script), str(uid), str(gid), ",".join(str(g) for g in groups)]


def user_home(root: Path, uid: int, gid: int) -> dict[str, str]:
    """A home of the user's own under `root`, and the environment that points gpuwait at it."""
    home = root / f"home-{uid}"
    for sub in ("", "state", "config"):
        (home / sub).mkdir(mode=0o700, exist_ok=True)
        os.chown(home / sub, uid, gid)
    return {
        "HOME": str(home),
        "XDG_STATE_HOME": str(home / "state"),
        "XDG_CONFIG_HOME": str(home / "config"),
        "PYTHONPATH": str(REPO),
    }


def shared_root() -> Path:
    """A fresh directory every user may enter (pytest's own tmp dirs are root's only)."""
    root = Path(tempfile.mkdtemp(prefix="gpuwait-users-"))
    os.chmod(root, 0o755)
    return root


def clean_up(root: Path, procs: Sequence[subprocess.Popen[str]]) -> None:
    """End what a test started as users (each process with its session) and remove `root`."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    shutil.rmtree(root, ignore_errors=True)


def make_shared_ledger_dir(root: Path, gid: int, mode: int = 0o3770) -> Path:
    """A shared ledger directory as an administrator sets it up: root-owned, the group's,
    group-writable, setgid and sticky."""
    ledger = root / "ledger"
    ledger.mkdir()
    os.chown(ledger, 0, gid)
    os.chmod(ledger, mode)
    return ledger


def popen_as(
    uid: int,
    gid: int,
    groups: Sequence[int],
    args: Sequence[str],
    env: Mapping[str, str],
    rootless: bool = False,
    **kw: Any,
) -> subprocess.Popen[str]:
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(
        user_argv(uid, gid, groups, args, rootless), env=dict(env), text=True, cwd="/", **kw
    )


def run_as(
    uid: int,
    gid: int,
    groups: Sequence[int],
    args: Sequence[str],
    env: Mapping[str, str],
    timeout: float = 60,
    prefix: Sequence[str] = (),
    rootless: bool = False,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, *user_argv(uid, gid, groups, args, rootless)],
        env=dict(env),
        text=True,
        cwd="/",
        capture_output=True,
        timeout=timeout,
    )


def hidepid_prefix(mode: str) -> list[str]:
    """How to start a command that sees /proc mounted with `hidepid=mode` (`noaccess`: other
    users' processes listed but unreadable; `invisible`: not listed), as on a hardened shared
    server; or skip the test. The command gets a /proc of its own in a mount namespace of its
    own: the machine's stays as it is."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    prefix = ["unshare", "--mount", "sh", "-c"]
    prefix += [f'mount -t proc -o hidepid={mode} proc /proc && exec "$@"', "sh"]
    probe = subprocess.run(
        [*prefix, "grep", "-c", f"hidepid={mode}", "/proc/self/mountinfo"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        pytest.skip(f"no /proc with hidepid can be mounted here: {probe.stderr.strip()}")
    return prefix
