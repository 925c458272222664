"""State files: created with the right modes whatever the umask, replaced atomically."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import time
from collections.abc import Iterable
from pathlib import Path

from gpuwait.linux.security import UnsafePath, mine, open_readable

# Re-exported: callers create their state dirs through this module.
from gpuwait.linux.security import ensure_private_dir as ensure_private_dir


def write_atomic(
    path: Path,
    data: bytes,
    mode: int = 0o600,
    group: int | None = None,
    owner: int = -1,
    sync: bool = True,
) -> None:
    """Replace `path` with `data`: temp file in the same dir, fsync, os.replace.

    A reader sees the old file or the new one, never a mix, even if this process is killed.
    `group`: the file's group, in a directory other users write into (a shared ledger
    directory): there the temporary file's name cannot be guessed, so nobody can put a file or
    a link of theirs in its place beforehand. `owner`: whose file it is (root writing a user's).
    `sync=False`: no fsync, for a file derived from others that a crash may lose.
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
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_left_temp_files(
    directory: Path,
    names: re.Pattern[str],
    owner: int = -1,
    listed: Iterable[str] | None = None,
    older_than: float = 0.0,
) -> None:
    """Remove the temporary files in `directory` whose names match `names` (`owner`: only that
    uid's). Called with the lock held under which every such file is written, so each one
    found was left by a writer killed halfway, even where a live process has its pid since
    (pids are reused: one checked for life would keep its file as long as that process lives).
    For files written with no lock, `older_than` (seconds): only those last changed longer ago
    than any write takes, which no live writer can still be writing. `listed`: the names in
    `directory`, where the caller listed it already.
    """
    if listed is None:
        try:
            listed = os.listdir(directory)
        except OSError:
            return
    for name in listed:
        if names.match(name):
            with contextlib.suppress(OSError):
                st = os.lstat(directory / name)
                if (owner == -1 or st.st_uid == owner) and (
                    older_than <= 0 or time.time() - st.st_mtime > older_than
                ):
                    os.unlink(directory / name)


def damaged_name(path: Path) -> Path:
    """Where a damaged file is kept as evidence: beside it, named for the time and the process,
    and a few random letters: in a shared directory another member could otherwise make a file
    under the name first (the sticky bit then refuses the rename, and the repair with it)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    return path.with_name(f"{path.name}.damaged-{stamp}-{os.getpid()}-{os.urandom(3).hex()}")


#: Damaged copies kept of one file: the first, which shows what went wrong first, and the
#: newest. A cause that repeats (a writer gone wrong) would otherwise fill the disk, with a copy
#: of up to a read's limit each time, and the copies between say nothing the others do not.
DAMAGED_KEPT = 8


def keep_damaged(path: Path) -> Path:
    """Move a damaged file aside (same dir) so the evidence is kept; return the new name."""
    target = damaged_name(path)
    os.replace(path, target)
    prune_damaged(path, target)
    return target


def prune_damaged(path: Path, kept: Path) -> None:
    """Remove this user's damaged copies of `path` (`damaged_name`) past DAMAGED_KEPT: all but
    `kept` (the one just set aside, which the warning names), the first set aside, and the
    newest. Ordered by when each was set aside (the inode's change time, which a rename sets):
    names made in one second do not tell."""
    prefix = f"{path.name}.damaged-"
    found = []
    with contextlib.suppress(OSError):
        for name in os.listdir(path.parent):
            if name.startswith(prefix) and name != kept.name:
                with contextlib.suppress(OSError):
                    st = os.lstat(path.parent / name)
                    if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                        found.append((st.st_ctime_ns, name))
    found.sort()
    for _, name in found[1 : max(1, len(found) - (DAMAGED_KEPT - 2))]:
        with contextlib.suppress(OSError):
            os.unlink(path.parent / name)


def open_private_append(path: Path) -> int:
    """An O_APPEND descriptor on the plain file `path`, created 0600 if missing. A symlink
    there, or anything but a plain file of this user's, is refused (UnsafePath) without being
    waited on: a FIFO fails at once."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    refused = UnsafePath(path, f"{path} is not a plain file of yours; gpuwait refuses it")
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink; a FIFO nobody reads
            raise refused from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise refused
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def end_of_cut_line(path: Path, size: int) -> bytes:
    """b"\\n" where the file at `path`, `size` bytes long, ends mid-line (its writer died, or the
    disk filled up, halfway through a line), else b"": put before the next line appended, it
    ends that line, so the next one is not glued to it and lost with it."""
    if not size:
        return b""
    try:
        fd = open_readable(path, mine())
    except OSError:
        return b""
    if fd is None:
        return b""
    try:
        return b"" if os.pread(fd, 1, size - 1) == b"\n" else b"\n"
    except OSError:
        return b""
    finally:
        os.close(fd)


def append_whole(fd: int, data: bytes) -> None:
    """Append `data` with one write; if only part of it got in (disk full), cut that part off
    again, so the file never ends in half a record."""
    written = os.write(fd, data)
    if written != len(data):
        end = os.lseek(fd, 0, os.SEEK_CUR)
        os.ftruncate(fd, end - written)
        raise OSError(28, "No space left on device (the record was not written)")


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


def read_tail(fd: int, lines: int, limit: int) -> tuple[bytes, int]:
    """The end of the file open at `fd` holding more than `lines` newlines (or all of it, or
    its last `limit` bytes), read backwards in growing blocks, and where it starts in the
    file. Its first line is cut short where it does not start the file."""
    end = os.fstat(fd).st_size
    floor = max(0, end - limit)
    start = end
    block = 1 << 16
    data = b""
    while start > floor:
        start = max(floor, start - block)
        data = os.pread(fd, end - start, start)
        if data.count(b"\n") > lines:
            break
        block *= 2
    return data, start
