"""Exclusive locks between processes, on a sidecar lock file.

flock(2) is what a locking library would call on Linux (and gpuwait is Linux-only: it reads
/proc). Calling it directly keeps a launch fast: portalocker reads its package metadata when
imported, which alone costs tens of milliseconds, most of a launch's budget. The kernel releases
the lock when the holder dies, even by SIGKILL, so a crashed gpuwait never leaves it held.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def exclusive(path: Path, mode: int = 0o600) -> Iterator[int]:
    """Hold an exclusive lock on `path` (created with `mode`) for the block; yield its fd."""
    # os.open descriptors are not inherited by the commands gpuwait starts, so a child can never
    # end up holding the lock.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)
