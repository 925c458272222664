"""Whether a job lives, told across pid namespaces: a lock each job holds on a file of its own.

A pid names a process only in its own pid namespace. gpuwait processes in containers that share
a state directory but not the host's pid namespace (docker without --pid=host) cannot look each
other's processes up: an entry written in one container names no process in another, or
somebody else's, and taken for dead it would be reaped while its job allocates.

A lock can tell. Each job's gpuwait takes an exclusive flock(2) on `alive.<uid>/<job id>` in the
ledger directory before its entry is written, and its command inherits the descriptor: the
kernel keeps the lock while either of them (or a process the command started and left the
descriptor to) still runs, and drops it when the last is gone, even by SIGKILL. The file is the
same inode in every container that mounts the directory, so another process finds the job alive
when it cannot take a shared lock on it. The directory is its user's alone (0700): nobody else
can open the files, so nobody else can keep a job of theirs looking alive. Each job holds a
shared lock on the directory itself too: other members of a shared ledger, who cannot look
inside it, see by its inode in /proc/locks that a job of its user runs. Where another member
of a shared ledger directory made something under its name first, the user's is beside it,
`alive.<uid>.<random>`, used from then on, even once that member takes theirs away
(gpuwait.linux.security.own_name).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import re
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from gpuwait.linux import lock, proc
from gpuwait.linux.security import (
    UnsafePath,
    ensure_private_dir,
    open_state_file,
    own_name,
    own_names,
    owned_by,
)

#: Job ids as gpuwait makes them; anything else names no file of ours.
_JOB_ID = re.compile(r"[0-9a-f]{1,64}")

#: The locks this process holds, by (ledger directory, job id).
_HELD: dict[tuple[Path, str], int] = {}
#: The shared locks this process holds on its lock directory, by (ledger directory, job id):
#: what tells other members of a shared ledger that a job of this user's runs (`jobs_run`).
_DIR_HELD: dict[tuple[Path, str], int] = {}


def _path(
    ledger_dir: Path, uid: int, job_id: str, listed: Iterable[str] | None = None
) -> Path | None:
    if _JOB_ID.fullmatch(job_id) is None:
        return None
    return _directory(ledger_dir, uid, listed=listed) / job_id


def _directory(
    ledger_dir: Path, uid: int, kuid: int | None = None, listed: Iterable[str] | None = None
) -> Path:
    """`uid`'s lock directory: alive.<uid>, or where another member made something of that
    name first in a shared ledger directory, one of `uid`'s own beside it. `kuid`: the uid the
    machine knows `uid` by (an entry's), where another user namespace wrote it (a rootless
    container, whose uid 0 is its user here). `listed`: the names in `ledger_dir`, where the
    caller listed it already."""
    return own_name(ledger_dir, "alive", uid=uid, kuid=kuid, listed=listed)


def hold(ledger_dir: Path, job_id: str, listed: Iterable[str] | None = None) -> bool:
    """Lock `job_id`'s file for as long as this process (or a command it starts) lives.

    False where that cannot be done (the directory unusable, or the file locked by a live job
    of the same id): the entry is then judged by its pids alone, as before. `listed`: the
    names in `ledger_dir`, where the caller listed it already.
    """
    path = _path(ledger_dir, os.getuid(), job_id, listed)
    if path is None:
        return False
    try:
        ensure_private_dir(path.parent)
        fd = open_state_file(path, 0o600)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    # Inherited by the command gpuwait starts, so that an orphaned command (its gpuwait killed
    # with SIGKILL) keeps its job alive for readers elsewhere, as its pid does for readers here.
    os.set_inheritable(fd, True)
    _HELD[(ledger_dir, job_id)] = fd
    _hold_directory(ledger_dir, job_id, path.parent)
    return True


def _hold_directory(ledger_dir: Path, job_id: str, directory: Path) -> None:
    """A shared lock on the lock directory itself for as long as the job's lock is held (its
    command inherits it too): where the directory's files are its owner's alone to look at,
    the directory's own inode, in /proc/locks, tells everyone that a job of theirs runs."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return
    os.set_inheritable(fd, True)
    _DIR_HELD[(ledger_dir, job_id)] = fd


def release(ledger_dir: Path, job_id: str) -> None:
    """Give up `job_id`'s lock and remove its file; called once its entry is out of the ledger."""
    fd = _HELD.pop((ledger_dir, job_id), None)
    if fd is None:
        return
    with contextlib.suppress(KeyError):
        os.close(_DIR_HELD.pop((ledger_dir, job_id)))
    if _path(ledger_dir, os.getuid(), job_id) is not None:
        with contextlib.suppress(OSError), _own_dir(ledger_dir, os.getuid()) as directory:
            os.unlink(job_id, dir_fd=directory)
    os.close(fd)


def held_here(ledger_dir: Path) -> set[str]:
    """The jobs (their ids) whose locks in `ledger_dir` this process holds."""
    return {job_id for directory, job_id in _HELD if directory == ledger_dir}


@contextlib.contextmanager
def given_up(ledger_dir: Path, job_id: str, on_error: bool = False) -> Iterator[None]:
    """`release` `job_id`'s lock after the block, or (`on_error`) only should it fail."""
    try:
        yield
    except BaseException:
        if on_error:
            release(ledger_dir, job_id)
        raise
    finally:
        if not on_error:
            release(ledger_dir, job_id)


def held(ledger_dir: Path, uid: int, job_id: str, kuid: int | None = None) -> bool | None:
    """Does a live process hold the lock of `uid`'s job `job_id` (`kuid`: the entry's, see
    `_directory`)? None where it cannot be told (the file is there but cannot be opened): the
    caller keeps the job, as it would a live one."""
    if _path(ledger_dir, uid, job_id) is None:
        return None
    try:
        with _own_dir(ledger_dir, uid, kuid) as directory:
            return _held_in(directory, job_id)
    except FileNotFoundError:
        return False
    except OSError:
        return None


def _held_in(directory: int, name: str) -> bool | None:
    """`held`, of the lock file `name` in the lock directory open as `directory`."""
    try:
        return _held_or_error(directory, name)
    except FileNotFoundError:
        return False
    except OSError:
        return None


def _held_or_error(directory: int, name: str) -> bool:
    """`_held_in`, raising OSError where it cannot be told (FileNotFoundError: no such lock)."""
    fd = os.open(name, _READ_FLAGS, dir_fd=directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def opened_by(ledger_dir: Path, uid: int, job_id: str, pid: int, kuid: int | None = None) -> bool:
    """Does process `pid` have the lock file of `uid`'s job `job_id` open? Nobody but that user
    can open it, and the job's gpuwait keeps it open for the job's life (its command inherits
    it): the process is that job's own, whatever program it runs (one holding room for itself,
    gpuwait.api)."""
    if _path(ledger_dir, uid, job_id) is None:
        return False
    try:
        with _own_dir(ledger_dir, uid, kuid) as directory:
            file = os.stat(job_id, dir_fd=directory, follow_symlinks=False)
    except OSError:
        return False
    return proc.has_open(pid, file, job_id)


def sweep(ledger_dir: Path, named: set[str]) -> None:
    """Remove this user's lock files that no entry (`named`: their job ids) stands for and no
    process holds: those of jobs reaped, or ended without `release` (a waiter cancelled by
    someone else). Called under the ledger lock, as every `hold` is, so a file is never taken
    away between its creation and its lock."""
    with contextlib.suppress(OSError), _own_dir(ledger_dir, os.getuid()) as directory:
        for name in os.listdir(directory):
            if name not in named and (ledger_dir, name) not in _HELD:
                _remove_unheld(directory, name)


def unlisted(
    ledger_dir: Path, named: set[str], before: float, listed: Iterable[str] | None = None
) -> list[str]:
    """This user's jobs that a live process holds the lock of but no entry (`named`: their
    job ids) stands for, of locks taken `before` then (a time.time()), other than this
    process's own: jobs whose entries were lost with the ledger started afresh at `before` (a
    damaged one), which their gpuwait puts back. A lock taken since is a job of the new ledger
    (between its end and the removal of its file, it is held with no entry). Looked for in
    every lock directory that is this user's here: theirs, and those their gpuwait keeps in
    another user namespace under the uid it has there (a rootless container's alive.0/, which
    is its user's on the host; the host's, to such a container).

    Raises OSError where that cannot be told (no file descriptor left, a lock directory of the
    user's shut to them): no job found is not to be taken for none living. A ledger directory
    gone (or a file in its place) holds no lock. `listed`: the names in `ledger_dir`, where the
    caller listed it already."""
    found: set[str] = set()
    try:
        lock_dirs = _listed_lock_dirs(ledger_dir, listed)
    except (FileNotFoundError, NotADirectoryError):
        return []
    for lock_dir in lock_dirs:
        try:
            with _opened_dir(lock_dir) as directory:
                found.update(_unlisted_in(lock_dir, directory, ledger_dir, named, before))
        except (UnsafePath, FileNotFoundError, NotADirectoryError):
            # Another user's, gone, or no directory (a file, a symlink put under that name):
            # none of this user's locks is there.
            continue
        except OSError as exc:
            if exc.errno == errno.ELOOP or not _users_own(lock_dir):
                continue  # a symlink, or another member's directory, shut to this user (0700)
            raise
    return sorted(found)


def _unlisted_in(
    lock_dir: Path, directory: int, ledger_dir: Path, named: set[str], before: float
) -> set[str]:
    """`unlisted`, of the lock directory `lock_dir` open as `directory`."""
    found: set[str] = set()
    since: float | None = None  # `before` on the clock the lock files are stamped by
    for name in os.listdir(directory):
        if name in named or (ledger_dir, name) in _HELD or not _JOB_ID.fullmatch(name):
            continue
        try:
            taken = os.stat(name, dir_fd=directory, follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue  # its job ended meanwhile
        if since is None:  # looked at only where it tells something
            since = before if before == math.inf else before + _clock_ahead(lock_dir, directory)
        if taken < since:
            try:
                if _held_or_error(directory, name):
                    found.add(name)
            except FileNotFoundError:
                continue
    return found


#: By lock directory: how far the clock its file system stamps files by is ahead of this
#: machine's wall clock, and until when (on the monotonic clock) that stands (`_clock_ahead`).
#: The same clock as gpuwait.queue.ledger._AHEAD's (the lock directory is in the ledger
#: directory), told apart on purpose: this one must be an upper bound (a lock taken before the
#: moment is never told taken after it), on a private ledger's local file system too (whose
#: stamps lag by a tick), and known at the first plan after a ledger was started afresh, before
#: this process wrote anything; the ledger's is the middle of this process's writes of its
#: shared ledger file (a private ledger's tells none), for a hold either way of a change.
_AHEAD: dict[Path, tuple[float, float]] = {}

#: How long, at most, making a file may take, by the wall clock and by the monotonic clock, to
#: tell its file system's clock.
_TOLD_WITHIN = 2.0
#: How far behind the moment a file system stamps a file, at most: a tick of the kernel's
#: coarse clock (10 ms at HZ=100); a second more where it stamps whole seconds.
_STAMP_LAG = 0.01
#: How long what it told stands: this machine's clock may be stepped meanwhile.
_TOLD_FOR = 60.0


def _clock_ahead(lock_dir: Path, directory: int) -> float:
    """How far the clock the file system of `lock_dir` (open as `directory`) stamps files by is
    ahead of this machine's wall clock: a file server's (NFS) may be off by minutes, and a
    lock file's time, stamped by it, is compared with this machine's (`unlisted`). Told by a
    file made there and removed, at most once a minute; where it cannot be told (that took
    too long), what the last look that told it said stands, else 0. Told as far ahead as it
    may be: the file was made after the look began, and stamped at most _STAMP_LAG behind
    the moment, so that a lock taken before `unlisted`'s moment is never told taken after it
    (one taken a moment after may be told taken before, and is waited for in vain only until
    its entry is found)."""
    start = time.monotonic()
    known = _AHEAD.get(lock_dir)
    if known is not None and start < known[1]:
        return known[0]
    name = f".clock.{os.getpid()}"  # no job id: passed over by every reader of the directory
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=directory)  # left by a process of this pid killed meanwhile
    ahead = 0.0 if known is None else known[0]
    began = time.time()
    try:
        fd = os.open(
            name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=directory,
        )
    except OSError:
        return ahead
    try:
        stamped = os.fstat(fd).st_mtime_ns
        ended, end = time.time(), time.monotonic()
        if 0 <= ended - began <= _TOLD_WITHIN and end - start <= _TOLD_WITHIN:
            # Stamped to the whole second (ext3, an NFS server's export of it): up to a
            # second behind the moment, and a tick more (the second of the coarse clock, a
            # tick behind: the one before, just after a second began).
            lag = 1.0 + _STAMP_LAG if stamped % 1_000_000_000 == 0 else _STAMP_LAG
            ahead = stamped / 1e9 + lag - began
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=directory)
    _AHEAD[lock_dir] = (ahead, start + _TOLD_FOR)
    return ahead


def jobs_run(ledger_dir: Path, uid: int) -> bool:
    """Does a job of `uid`'s run, as the shared lock its gpuwait (or a program holding room
    through gpuwait.reserve()) holds on their lock directory shows in /proc/locks? Only they
    (and root) can open that directory to lock it; a lock of theirs on anything else (a
    download's, an editor's) tells nothing. Their directory is not listed: only its inode is
    looked at, whatever they keep in it."""
    return uid in jobs_run_of(ledger_dir, [uid])


def jobs_run_of(
    ledger_dir: Path, uids: Iterable[int], listed: Iterable[str] | None = None
) -> set[int]:
    """Those of `uids` a job of whose runs (`jobs_run`), /proc/locks read once for them all,
    and the mount table once for each mount their lock directories are in (one, but where
    someone mounted another file system there); their lock directories found by one listing
    of `ledger_dir` at most (`listed`: the names in it, where the caller has them)."""
    directories: dict[int, tuple[int, int]] = {}
    mounts: dict[int, int] = {}
    for uid, path in own_names(ledger_dir, "alive", "", uids, listed).items():
        try:
            fd = os.open(
                path,
                os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
            )
        except OSError:
            continue
        try:
            found = os.fstat(fd)
            if owned_by(found.st_uid, uid):
                directories[uid] = (proc.lock_device(fd, mounts), found.st_ino)
        except OSError:
            continue
        finally:
            os.close(fd)
    held = lock.holders_of(list(directories.values()))
    return {uid for uid, file in directories.items() if held.get(file)}


def locks_exclusively(ledger_dir: Path, uids: Iterable[int]) -> set[int]:
    """Those of `uids` a process of whose holds an exclusive flock on a file of the file
    system of the ledger directory, as /proc/locks names them (one waited for left out),
    /proc/locks read once for them all. So does the job of a gpuwait older than the lock on
    the lock directory (`jobs_run`), on its liveness lock; and so may any program of theirs (a
    download's `filelock`): it tells nothing alone."""
    wanted = set(uids)
    if not wanted:
        return set()
    try:
        fd = os.open(ledger_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return set()
    try:
        device = proc.lock_device(fd)
    finally:
        os.close(fd)
    prefix = b"%02x:%02x:" % (os.major(device), os.minor(device))
    found: set[int] = set()
    owners: dict[int, int | None] = {}
    for pid, kind, file in lock.flocks():
        if kind == b"WRITE" and file.startswith(prefix) and pid > 0:
            if pid not in owners:
                owners[pid] = proc.owner_uid(pid)
            owner = owners[pid]
            if owner is not None and owner in wanted:
                found.add(owner)
    return found


def holders_unlisted(ledger_dir: Path, named: set[str]) -> set[int]:
    """The gpuwait processes that hold the locks of this user's jobs no entry (`named`: their
    job ids) stands for, other than this process's own locks: after a ledger was started
    afresh, those of jobs whose entries the damage lost. A transaction wakes the waiters its
    ledger lists; these it cannot know of, and a waiter puts its entry back once woken. Each
    is the process /proc/locks names as the lock's taker, and only while it has the file open
    (the taker gone, its pid may be another process's). A program holding its GPU through
    gpuwait.reserve() takes its lock itself: where a handler of its own would take the
    wake-up (SIGCHLD, for its children), it is left alone, as it waits for nothing."""
    files: list[tuple[str, os.stat_result, int]] = []
    mounts: dict[int, int] = {}
    for lock_dir in _lock_dirs(ledger_dir) or ():
        with contextlib.suppress(OSError), _opened_dir(lock_dir) as directory:
            # The device /proc/locks names its files by (another than st_dev on btrfs).
            device = proc.lock_device(directory, mounts)
            for name in os.listdir(directory):
                if name in named or (ledger_dir, name) in _HELD or not _JOB_ID.fullmatch(name):
                    continue
                with contextlib.suppress(OSError):
                    found = os.stat(name, dir_fd=directory, follow_symlinks=False)
                    files.append((name, found, device))
    # /proc/locks read once, however many entries were lost.
    taken = lock.holders_of([(device, f.st_ino) for _, f, device in files])
    return {
        pid
        for name, file, device in files
        for pid in taken.get((device, file.st_ino), [])
        if pid > 0
        and pid != os.getpid()
        and proc.has_open(pid, file, name)
        and not proc.runs_handler(pid, signal.SIGCHLD)
    }


def still_held(ledger_dir: Path, job_ids: set[str]) -> set[str]:
    """Those of this user's jobs `job_ids` (found by `unlisted`) whose lock a live process
    still holds, in any lock directory of this user's here as `unlisted` looks; a lock that
    cannot be told counts as held. A job not among them has ended: no entry of it is to come
    back."""
    found: set[str] = set()
    lock_dirs = _lock_dirs(ledger_dir)
    if lock_dirs is None:
        return set(job_ids)  # not to be looked at: not told
    for lock_dir in lock_dirs:
        try:
            with _opened_dir(lock_dir) as directory:
                for name in job_ids - found:
                    if _JOB_ID.fullmatch(name) and _held_in(directory, name) is not False:
                        found.add(name)
        except (UnsafePath, FileNotFoundError):
            continue  # another user's, or gone: none of this user's locks is there
        except OSError:
            if not _users_own(lock_dir):
                # Another member's directory, shut to this user (0700), or whatever they put
                # there under such a name (a file, a symlink): none of this user's locks.
                continue
            return set(job_ids)  # not to be looked at now (no descriptor left): not told
    return found


def _users_own(path: Path) -> bool:
    """Is `path` this user's own (or not to be told)?"""
    try:
        return owned_by(os.lstat(path).st_uid, os.getuid())
    except OSError:
        return True


#: The name of a user's lock directory (`_directory`), whatever uid it carries.
_LOCK_DIR = re.compile(r"alive\.[0-9]{1,10}(?:\.[0-9a-f]{1,32})?")


def _lock_dirs(ledger_dir: Path) -> list[Path] | None:
    """`_listed_lock_dirs`; None where `ledger_dir` cannot be listed."""
    try:
        return _listed_lock_dirs(ledger_dir)
    except OSError:
        return None


def _listed_lock_dirs(ledger_dir: Path, listed: Iterable[str] | None = None) -> list[Path]:
    """Whatever is named as a lock directory in `ledger_dir` (`listed`: the names in it, where
    the caller listed it already), whoever's (`_LOCK_DIR`); OSError where `ledger_dir` cannot
    be listed."""
    names = os.listdir(ledger_dir) if listed is None else listed
    return [ledger_dir / n for n in names if _LOCK_DIR.fullmatch(n)]


#: Opening a lock file of a directory (`_own_dir`) to look at its lock: no symlink followed,
#: no FIFO waited on.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@contextlib.contextmanager
def _own_dir(ledger_dir: Path, uid: int, kuid: int | None = None) -> Iterator[int]:
    """A descriptor on `uid`'s lock directory, for the names in it to be opened, listed and
    removed through. OSError where there is none, or it is no directory of `uid`'s own: in a
    shared ledger directory any member may have put a directory, a file or a symlink there
    under that name before its owner's first job, and one followed would have this gpuwait
    look at, and take away, the files of any directory it points at (root's: anywhere)."""
    with _opened_dir(_directory(ledger_dir, uid, kuid), uid, kuid) as fd:
        yield fd


@contextlib.contextmanager
def _opened_dir(name: Path, uid: int | None = None, kuid: int | None = None) -> Iterator[int]:
    """A descriptor on the directory `name`, not followed as a link; UnsafePath where it is
    not `uid`'s (default: this user's) as `owned_by` tells."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not owned_by(os.fstat(fd).st_uid, os.getuid() if uid is None else uid, kuid):
            raise UnsafePath(name, f"{name} belongs to another user")
        yield fd
    finally:
        os.close(fd)


def _remove_unheld(directory: int, name: str) -> None:
    try:
        # Read-write: where flock(2) is done with POSIX locks (NFS), an exclusive one needs it.
        fd = os.open(
            name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory
        )
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(name, dir_fd=directory)
    except OSError:
        pass
    finally:
        os.close(fd)
