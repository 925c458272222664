"""Wake a waiter the moment the ledger is rewritten: inotify on the state dir, as a signal.

The waiting loop has one place where it sleeps, `sigtimedwait`, so that Ctrl-C and TERM end the
wait at once. An inotify descriptor set to O_ASYNC makes the kernel send SIGIO to this process
when an event arrives, so that same sleep also ends when the ledger is replaced (gpuwait writes
it by renaming a temporary file over it: IN_MOVED_TO). No polling is left while nothing happens.

Linux only, through ctypes. Where inotify cannot be had (another OS, the per-user limit of
inotify instances reached, a file system without it), `LedgerWatch.active` is False and the loop
falls back to checking the ledger's change stamp every `poll_interval`.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import signal
import struct
from pathlib import Path

WAKE_SIGNAL = signal.SIGIO
_IN_MOVED_TO = 0x00000080
_IN_DELETE = 0x00000200
_IN_Q_OVERFLOW = 0x00004000


class LedgerWatch:
    """While open, the ledger's directory changing queues WAKE_SIGNAL for this process."""

    wake_signal = WAKE_SIGNAL

    def __init__(self, directory: Path | None) -> None:
        """Watch `directory`; None: do not (the caller polls instead)."""
        self.fd = -1
        if directory is None:
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            init = libc.inotify_init1
            add = libc.inotify_add_watch
        except (OSError, AttributeError):
            return
        # Blocked before it can be sent: its default action would end the process.
        signal.pthread_sigmask(signal.SIG_BLOCK, {WAKE_SIGNAL})
        fd = init(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return
        try:
            mask = _IN_MOVED_TO | _IN_DELETE
            if add(fd, os.fsencode(directory), mask) < 0:
                raise OSError(ctypes.get_errno(), "inotify_add_watch")
            fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
        except OSError:
            os.close(fd)
            return
        self.fd = fd

    @property
    def active(self) -> bool:
        return self.fd >= 0

    def drain(self, wanted: tuple[bytes, re.Pattern[bytes]] | None = None) -> set[str] | None:
        """Read the queued events, so that the next one signals again; the names of the files
        they were about (None: some were lost, the kernel's queue having overflowed).

        `wanted`: only the names that its pattern's first group finds in the events as read
        (bytes that every one of them holds, looked for first), without going through the
        events one by one: in a directory anyone of a group can write to, a loop renaming
        files makes thousands of them a second, each to be read by every watcher."""
        names: set[str] | None = set()
        if self.fd < 0:
            return names
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while chunk := os.read(self.fd, 65536):
                found = _event_names(chunk) if wanted is None else _wanted_names(chunk, wanted)
                names = None if found is None or names is None else names.union(found)
        return names

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        # A signal still queued would wait forever: take it now, it means nothing any more.
        with contextlib.suppress(OSError):
            signal.sigtimedwait({WAKE_SIGNAL}, 0)


#: struct inotify_event: wd, mask, cookie, len, then `len` bytes of name padded with NULs.
_EVENT = struct.Struct("iIII")


def _event_names(chunk: bytes) -> list[str] | None:
    """The names in a buffer of inotify events read at once (the kernel never splits one);
    None where the kernel's queue overflowed, and events were lost."""
    names = []
    at = 0
    while at + _EVENT.size <= len(chunk):
        _, mask, _, length = _EVENT.unpack_from(chunk, at)
        if mask & _IN_Q_OVERFLOW:
            return None
        raw = chunk[at + _EVENT.size : at + _EVENT.size + length].split(b"\0", 1)[0]
        if raw:
            names.append(os.fsdecode(raw))
        at += _EVENT.size + length
    return names


#: The event the kernel queues where its queue overflowed: no watch (-1), no cookie, no name.
_OVERFLOW_EVENT = _EVENT.pack(-1, _IN_Q_OVERFLOW, 0, 0)


def _wanted_names(chunk: bytes, wanted: tuple[bytes, re.Pattern[bytes]]) -> list[str] | None:
    """`_event_names` as far as `wanted` (see `LedgerWatch.drain`) finds them; None where the
    kernel's queue overflowed (or where a name holds the bytes of that event: then too any
    file may have been written)."""
    if _OVERFLOW_EVENT in chunk:
        return None
    part, pattern = wanted
    if part not in chunk:
        return []
    return [os.fsdecode(name) for name in set(pattern.findall(chunk))]
