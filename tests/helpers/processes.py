"""`procs`: start processes in a test and have them always reaped.

Each process leads a process group of its own, so the end of the test reaches everything it
started: gpuwait, its command, and what that command started. TERM first (gpuwait passes it on
and cleans up), SIGKILL to the group for whatever is still there after a while.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


def can_unshare() -> bool:
    """Whether processes can be started in namespaces of their own (root and unshare(1)): a
    host name and pids of their own, as on another machine."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    done = subprocess.run(
        ["unshare", "--uts", "--pid", "--fork", "--mount-proc", "true"], capture_output=True
    )
    return done.returncode == 0


@pytest.fixture
def procs() -> Iterator[Callable[..., subprocess.Popen[Any]]]:
    """start(argv, **popen) -> a running process (text mode, stdout and stderr piped unless
    given otherwise), stopped with its process group and reaped at the end of the test."""
    started: list[subprocess.Popen[Any]] = []

    def start(argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        kw.setdefault("text", True)
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        started.append(subprocess.Popen(argv, start_new_session=True, **kw))
        return started[-1]

    yield start
    for proc in started:
        _signal_group(proc, signal.SIGTERM)
    for proc in started:
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.communicate(timeout=10)


def _signal_group(proc: subprocess.Popen[Any], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


def unshare_prefix() -> list[str]:
    """How to start a command in a new pid namespace with its own /proc, as a container without
    --pid=host does, or skip the test."""
    from gpuwait.linux import pidns

    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    # Root makes the namespace itself; anyone else needs a user namespace to make it in.
    # --kill-child: should the test give up, killing unshare ends everything inside.
    prefix = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if os.geteuid() != 0:
        prefix[1:1] = ["--user", "--map-root-user"]
    probe = subprocess.run(
        [*prefix, "readlink", "/proc/self/ns/pid"], capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0 or probe.stdout.strip() == pidns.INITIAL_PID_NAMESPACE:
        pytest.skip(f"no pid namespace can be made here: {probe.stderr.strip()}")
    return prefix


def time_namespace(boottime: int) -> list[str]:
    """How to start a command in a time namespace whose boot clock is `boottime` seconds ahead
    of the machine's (as a container restored from a checkpoint may be), or skip the test."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    prefix = ["unshare", "--time", f"--boottime={boottime}", "--fork"]
    if subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("no time namespace can be made here")
    return prefix


#: gpuwait on a machine that is suspended for two hours once the file named first exists: the
#: boot clock (and the wall clock) count the two hours, the monotonic clock does not.
_SUSPENDED = """
import os, sys
from gpuwait.linux import proc
real, flag = proc.boot_clock, sys.argv.pop(1)
proc.boot_clock = lambda: real() + (7200 if os.path.exists(flag) else 0)
from gpuwait.cli import main
sys.exit(main(sys.argv[1:]))
"""


def suspended_gpuwait(woke: Path) -> list[str]:
    """How to start a gpuwait (its arguments to follow) on a machine that has slept two hours
    once the file `woke` exists (it may exist already: a gpuwait started after the wake-up)."""
    return [sys.executable, "-c", _SUSPENDED, str(woke)]


def children(pid: int) -> list[int]:
    """The child processes of `pid` (its main thread's), as the kernel lists them."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def pending_signals(pid: int) -> set[int]:
    """The signals process `pid` holds pending (blocked), shared or its main thread's."""
    held = 0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("ShdPnd", "SigPnd"):
                held |= int(value.strip(), 16)
    return {n for n in range(1, 65) if held & (1 << (n - 1))}


def process_name(pid: int) -> str:
    """The name the kernel gives process `pid` (its comm); "" once it has ended."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@contextlib.contextmanager
def liveness_lock_held(ledger_dir: Path, job_id: str) -> Iterator[Path]:
    """Another process holds the liveness lock of this user's job `job_id` in `ledger_dir`, as
    a running job's gpuwait does, while the block runs; the lock's path."""
    holds = "import sys, time; from pathlib import Path; from gpuwait.linux import alive; "
    holds += "alive.hold(Path(sys.argv[1]), sys.argv[2]); print(flush=True); time.sleep(60)"
    holder = subprocess.Popen(
        [sys.executable, "-c", holds, str(ledger_dir), job_id], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "\n"
        yield ledger_dir / f"alive.{os.getuid()}" / job_id
    finally:
        holder.kill()
        holder.wait()
