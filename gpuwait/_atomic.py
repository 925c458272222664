"""Private state files: created with the right modes whatever the umask, replaced atomically."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

# Re-exported: callers create their state dirs through this module.
from gpuwait._security import ensure_private_dir as ensure_private_dir


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace `path` with `data`: temp file in the same dir, fsync, os.replace.

    A reader sees the old file or the new one, never a mix, even if this process is killed.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
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


def write_json_atomic(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(value, separators=(",", ":"), sort_keys=True).encode())


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
