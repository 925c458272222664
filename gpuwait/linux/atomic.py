"""State files: created with the right modes whatever the umask; private ones replaced atomically,
shared ones rewritten in place."""

from __future__ import annotations

import os
import time
from pathlib import Path

# Re-exported: callers create their state dirs through this module.
from gpuwait.linux.security import ensure_private_dir as ensure_private_dir
from gpuwait.linux.security import open_state_file


def write_atomic(
    path: Path, data: bytes, mode: int = 0o600, group: int | None = None, owner: int = -1
) -> None:
    """Replace `path` with `data`: temp file in the same dir, fsync, os.replace.

    A reader sees the old file or the new one, never a mix, even if this process is killed.
    `group`: the file's group, in a directory other users write into (a shared ledger
    directory): there the temporary file's name cannot be guessed, so nobody can put a file or
    a link of theirs in its place beforehand. `owner`: whose file it is (root writing a user's).
    """
    suffix = f"{os.getpid()}-{os.urandom(6).hex()}" if group is not None else str(os.getpid())
    tmp = path.with_name(f".{path.name}.{suffix}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, mode)
    except FileExistsError:
        # Left by a writer with this pid that was killed halfway: ours to replace.
        tmp.unlink()
        fd = os.open(tmp, flags, mode)
    try:
        if owner != -1 or (group is not None and os.fstat(fd).st_gid != group):
            os.fchown(fd, owner, -1 if group is None else group)
        os.fchmod(fd, mode)  # O_CREAT's mode is filtered by the umask; this is not.
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)


def keep_damaged(path: Path) -> Path:
    """Move a damaged file aside (same dir) so the evidence is kept; return the new name."""
    target = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    os.replace(path, target)
    return target


def open_private_append(path: Path) -> int:
    """An O_APPEND descriptor on `path`, created 0600; a symlink there is refused (ELOOP)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def append_whole(fd: int, data: bytes) -> None:
    """Append `data` with one write; if only part of it got in (disk full), cut that part off
    again, so the file never ends in half a record."""
    written = os.write(fd, data)
    if written != len(data):
        end = os.lseek(fd, 0, os.SEEK_CUR)
        os.ftruncate(fd, end - written)
        raise OSError(28, "No space left on device (the record was not written)")


def write_in_place(path: Path, data: bytes, group: int | None) -> None:
    """Overwrite `path` with `data` (in a shared directory, where the sticky bit forbids renaming
    over another user's file). Space is reserved first, so a full disk fails before a byte of the
    old content is touched."""
    fd = open_state_file(path, 0o660, shared_gid=group)
    try:
        size = os.fstat(fd).st_size
        if len(data) > size:
            os.posix_fallocate(fd, 0, len(data))
        view = memoryview(data)
        offset = 0
        while offset < len(data):
            offset += os.pwrite(fd, view[offset:], offset)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def holds(path: Path, data: bytes) -> bool:
    """True when the file at `path` holds exactly `data`."""
    try:
        # Not blocking: a FIFO put there must not hang a writer that holds the ledger lock.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.read(fd, len(data) + 1) == data
    except OSError:
        return False
    finally:
        os.close(fd)
