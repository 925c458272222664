"""What waiters watch instead of the ledger: a small summary, rewritten with every ledger change.

With a hundred waiters, having each of them read and re-plan the whole ledger whenever it
changes costs more than the jobs' own work on a small machine. So every ledger transaction that
changes the file also writes `wake.json` beside it (under the same lock, atomically):

    {"schema": 1, "release": 41, "running": ["id", ...], "waiting": ["id", ...]}

`waiting` is in queue order. `release` counts the transactions that freed room: an entry left
(finished, cancelled, reaped), a running job's reservation shrank, or the queue's head let go of a
GPU it held. A waiter reads only this file when woken and acts on what concerns it:
- its id is in `running`: a plan admitted it (any planner admits every waiter that fits);
- it is first in `waiting` and `release` moved: it plans, for everybody;
- its id is in neither: it was cancelled (or the ledger was recovered), so it looks closer;
- a dependency of it is in neither: it settles its dependencies.
Everything else waits for the waiter's periodic re-read of the GPUs, which is shared too: a
waiter skips its own when any waiter planned less than an interval ago (`plan.stamp`'s mtime).
If the first waiter does not plan after a release within a moment (it may be suspended), the
second one does.

How a waiter learns that the summary changed: in a shared ledger directory, by watching the
directory (inotify). In a private one every writer is the same user, so the transaction itself
signals (SIGCHLD: harmless to any process, and blocked by gpuwait from its start, so never lost)
only the waiters a change concerns - those it admitted, removed, or whose dependency left, and
after a release the first two in line - once the lock is let go (`concerned`). A watch would
wake every waiter on every write, and with a hundred of them those wake-ups alone starve the
process that is trying to release its room.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gpuwait.core.record import Record
from gpuwait.linux.atomic import holds, write_in_place
from gpuwait.linux.security import is_shared_dir
from gpuwait.queue.entries import RUNNING, Job

SCHEMA = 1
FILENAME = "wake.json"
#: A summary names every entry's id once: far below this for any ledger gpuwait reads.
MAX_SUMMARY_BYTES = 4 << 20
STAMP = "plan.stamp"

Fingerprint = Mapping[str, tuple[str, int, tuple[str, ...]]]


def fingerprint(jobs: Iterable[Job]) -> Fingerprint:
    """What about each entry decides whether room was freed."""
    return {j.id: (j.state, j.reserved_bytes, tuple(j.held_gpus)) for j in jobs}


def released(before: Fingerprint, after: Fingerprint) -> bool:
    """True when `after` may offer room that `before` did not."""
    for job_id, (state, reserved, held) in before.items():
        now = after.get(job_id)
        if now is None:
            return True
        if state == RUNNING and (now[0] != RUNNING or now[1] < reserved):
            return True
        if held and not set(held) <= set(now[2]):
            return True
    return False


def concerned(
    before: Mapping[str, tuple[str, int]],
    jobs: Iterable[Job],
    gone_quietly: frozenset[str],
    release: bool,
) -> set[int]:
    """The processes to signal after a transaction turned `before` ({id: (state, pid)}) into
    `jobs`: those it admitted, those it removed (cancelled) unless `gone_quietly` (dead or
    forged), waiters whose dependency left, and after a `release` the first two waiters."""
    entries = list(jobs)
    live = {j.id for j in entries}
    left = {i for i in before if i not in live}
    pids = {pid for i, (_, pid) in before.items() if i in left and i not in gone_quietly}
    for j in entries:
        was = before.get(j.id)
        admitted = j.state == RUNNING and was is not None and was[0] != RUNNING
        unblocked = j.state != RUNNING and bool(left.intersection((*j.after, *j.after_ok)))
        if admitted or unblocked:
            pids.add(j.pid)
    if release:
        waiting = sorted(
            (j for j in entries if j.state != RUNNING), key=lambda j: (-j.priority, j.order)
        )
        pids.update(j.pid for j in waiting[:2])
    pids.discard(os.getpid())
    return pids


def kick(pids: Iterable[int]) -> None:
    """Wake these waiters (SIGCHLD ends their sleep; its default action is to do nothing)."""
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile, or another user's (shared dir)
            os.kill(pid, signal.SIGCHLD)


def wake_path(state_dir: Path) -> Path:
    return state_dir / FILENAME


def summary(jobs: Iterable[Job], release: int, starting: Iterable[str] = ()) -> dict[str, Any]:
    """`starting`: other users' waiters the writer's plan starts; listed as running, so that
    their own gpuwait looks (and, finding itself still waiting, plans and starts)."""
    entries = list(jobs)
    starts = set(starting)
    waiting = sorted(
        (j for j in entries if j.state != RUNNING and j.id not in starts),
        key=lambda j: (-j.priority, j.order),
    )
    return {
        "schema": SCHEMA,
        "release": release,
        "running": [j.id for j in entries if j.state == RUNNING or j.id in starts],
        "waiting": [j.id for j in waiting],
    }


def write_summary(state_dir: Path, content: dict[str, Any], shared_gid: int | None) -> None:
    """Replace wake.json with `content` (`summary()`), unless it holds that already. No fsync:
    it is derived from the ledger and rewritten constantly.

    In a shared (sticky) directory (`shared_gid` set) it cannot be replaced by rename when another
    user wrote it last, so it is rewritten in place there; a reader that catches it half-written
    finds no valid summary and plans, which is safe.
    """
    path = wake_path(state_dir)
    body = json.dumps(content, separators=(",", ":")).encode()
    # Waiters act on the summary's content alone, and most changes (a job's new sample, a
    # waiter's reason) leave it as it was: rewriting it then would cost a rename (or, in a
    # shared directory, wake every watching waiter) for nothing.
    if holds(path, body):
        return
    if shared_gid is not None:
        with contextlib.suppress(OSError):
            write_in_place(path, body, shared_gid)
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        # Waiters whose summary is missing fall back to reading the GPUs on their timer.
        tmp.unlink(missing_ok=True)


class Summary(Record, frozen=True):
    release: int
    running: frozenset[str]
    waiting: tuple[str, ...]


def read_summary(state_dir: Path) -> Summary | None:
    """The summary, or None when it is missing or not one (then the caller plans to be safe)."""
    # In a shared directory the summary is whoever wrote it first's: never followed as a link,
    # never waited on as a FIFO, and never read past what a summary can be.
    try:
        fd = os.open(
            wake_path(state_dir), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        )
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = json.loads(os.read(fd, MAX_SUMMARY_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        return None
    release, running, waiting = raw.get("release"), raw.get("running"), raw.get("waiting")
    if (
        not isinstance(release, int)
        or not isinstance(running, list)
        or not isinstance(waiting, list)
        or not all(isinstance(i, str) for i in [*running, *waiting])
    ):
        return None
    return Summary(release, frozenset(running), tuple(waiting))


def file_token(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def note_planned(state_dir: Path) -> None:
    """Say that the GPUs were just read and the queue planned (plan.stamp's mtime)."""
    path = state_dir / STAMP
    with contextlib.suppress(OSError):
        if os.path.lexists(path):
            os.utime(path, follow_symlinks=False)
            return
        # In a shared ledger directory every member's waiters touch it: the group's, 0660.
        mode = 0o660 if is_shared_dir(os.lstat(state_dir)) else 0o600
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)  # whatever the umask
        finally:
            os.close(fd)


def planned_since(state_dir: Path, moment_ns: int) -> bool:
    """Has any waiter planned since `moment_ns` (Unix time in nanoseconds, as file times are)?"""
    try:
        return os.stat(state_dir / STAMP).st_mtime_ns >= moment_ns
    except OSError:
        return False
