"""The start-up turnstile: launches that start together load a few at a time, in turn.

`make -j 40`, a job array or a loop of `&` starts forty gpuwait processes at one moment. Each
spends some 100 ms of CPU loading Python and gpuwait before it can join the queue. On a machine
with few cores the kernel shares the CPU evenly among them, so all forty finish loading
together, late; only then do the first jobs that fit start, and their commands' own start-up
still shares the CPU with the launches behind them. Through the turnstile, as many launches
load at once as this process has CPUs to run on (its affinity, or fewer by its cgroup's CPU
quota), the others sleep: the first ones join the queue and start their commands while the
rest wait their turn.

A launch leaves the turnstile as soon as it knows what comes next: its command starts
(`gpuwait.runner.launch`), it waits in the queue (`gpuwait.queue.wait`) or for failing GPU
readings to pass (`gpuwait.runner.session`), or it ends. One that waits longer than WAIT_LIMIT
for its turn goes on without it: a stopped or hung launch costs the others that long at most,
never a hang.

One file per user, `start.lock` in $XDG_RUNTIME_DIR/gpuwait (the user's own local directory for
the time they are logged in), else in this machine's ledger directory, the user state dir or,
where several machines share that, this machine's directory under it (cron, services, a `su`
that kept another user's runtime dir); one byte of it per slot, each taken with a POSIX record
lock: such a lock belongs to the process, so a process gpuwait forks (the stderr relay) never
holds a slot, a command it starts never does either (the descriptor is closed on exec), and
the kernel frees it when gpuwait dies, even by SIGKILL. The turnstile is about
speed, never about safety: where neither place can hold it (no such directory and none can be
made, a lock file that is not this user's own plain file) the launch goes on without it, saying
nothing; the ledger says what is wrong with the state dir, if anything is.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpuwait.linux import cgroup
from gpuwait.linux.lock import LockTimeout, lock_within
from gpuwait.linux.security import UnsafePath, ensure_private_dir, open_state_file

FILE_NAME = "start.lock"

#: The longest a launch waits for its turn, in seconds. A turn lasts some 100 ms of CPU, so
#: with two cores the twentieth launch of a burst is let through after about a second.
WAIT_LIMIT = 2.0

#: The descriptor that holds this process's slot; None when it holds none.
_held: int | None = None


def slots() -> int:
    """How many launches load at once: the CPUs this process may run on, or as many as its
    cgroup's CPU quota gives it time for where that is fewer (a container run with --cpus, a
    Kubernetes pod's CPU limit: its affinity names every core of the machine)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except OSError:
        cpus = os.cpu_count() or 1
    limit = cgroup.cpu_limit()
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, cpus)


def directories(environ: Mapping[str, str], state_dir: str) -> list[Path]:
    """Where the turnstile may be, in order: the runtime dir's `gpuwait`, then this machine's
    ledger directory (`state_dir`, or where that is shared by several machines, this machine's
    directory under it: linux/netfs).

    Both are local to this machine, where a home directory (and the state dir in it) may be
    shared over the network with others, whose launches do not share this machine's CPUs. A
    relative $XDG_RUNTIME_DIR is ignored, as the XDG rules say, and so is one that does not
    exist (the session's manager makes it; gpuwait makes only its own directory).
    """
    # Imported here: only launches read the mount table, once (the settings' ledger_path reads
    # the answer kept from here).
    from gpuwait.linux import netfs

    runtime = environ.get("XDG_RUNTIME_DIR", "")
    found = [Path(runtime) / "gpuwait"] if os.path.isabs(runtime) and os.path.isdir(runtime) else []
    return [*found, netfs.ledger_home(Path(state_dir))]


def enter(places: Sequence[Path], limit: float = WAIT_LIMIT) -> bool:
    """Take a slot of the turnstile in the first of `places` that can hold it, waiting at most
    `limit` seconds for one.

    Returns whether this process holds a slot now (False: it goes on without one). Ctrl-C while
    waiting raises KeyboardInterrupt, as it would anywhere in a start-up.
    """
    global _held
    if _held is not None:
        return True
    fd = _open(places)
    if fd is None:
        return False
    count = slots()
    # Spread over the slots by pid, so that the waiters of a burst queue on all of them.
    first = os.getpid() % count
    try:
        for n in range(count):
            with contextlib.suppress(BlockingIOError):
                _take(fd, (first + n) % count, block=False)
                _held = fd
                return True
        # No patience for pending signals: none is blocked yet this early in a launch.
        lock_within(lambda block: _take(fd, first, block), limit, patience=float("inf"))
    except (LockTimeout, OSError):
        os.close(fd)
        return False
    except BaseException:
        os.close(fd)
        raise
    _held = fd
    return True


def leave() -> None:
    """Give the slot back (nothing when this process holds none)."""
    global _held
    fd, _held = _held, None
    if fd is not None:
        # Closing any descriptor of the file drops this process's record locks on it.
        os.close(fd)


def _open(places: Sequence[Path]) -> int | None:
    for directory in places:
        try:
            ensure_private_dir(directory)
            return open_state_file(directory / FILE_NAME, 0o600)
        except (OSError, UnsafePath):
            continue
    return None


def _take(fd: int, slot: int, block: bool) -> None:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB, 1, slot)
    except PermissionError:
        # POSIX allows EACCES as well as EAGAIN for a lock held by another process.
        raise BlockingIOError from None
