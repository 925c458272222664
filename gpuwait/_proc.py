"""Facts about processes, read from /proc.

A pid alone does not name a process for long: pids are reused. Every record that must outlive a
moment keeps the pid together with its start time (field 22 of /proc/PID/stat, in clock ticks since
boot), and a process counts as "the same" only when both match.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def _stat_fields(pid: int) -> list[str] | None:
    # os.open/os.read, not open(): a buffered file object costs more than the read itself, and
    # the ledger does this for every entry in every transaction. The file is a few hundred bytes,
    # which procfs returns whole to one read of a buffer this size.
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    return _fields_of(raw)


def _fields_of(stat: bytes) -> list[str] | None:
    """The fields of a /proc/PID/stat line after the command name (fields[0] is field 3)."""
    raw = stat.decode("utf-8", "replace")
    # The command name (field 2) is in parentheses and may itself contain spaces and ')'.
    close = raw.rfind(")")
    if close < 0:
        return None
    return raw[close + 2 :].split()


def start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None if there is no such process."""
    return _start_of(_stat_fields(pid))


def _start_of(fields: list[str] | None) -> int | None:
    if fields is None or len(fields) < 20:
        return None
    try:
        # Field 22 overall; fields[0] here is field 3 (state).
        return int(fields[19])
    except ValueError:
        return None


def parent_pid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 2:
        return None
    try:
        return int(fields[1])
    except ValueError:
        return None


def is_alive(pid: int, expected_start: int | None) -> bool:
    """True when `pid` runs and, if `expected_start` is given, is the process that started then."""
    if pid <= 0:
        return False
    # One read of /proc/PID/stat for both the start time and the state: the ledger checks
    # every entry this way under its lock, in every transaction.
    fields = _stat_fields(pid)
    current = _start_of(fields)
    if current is None:
        # /proc mounted with hidepid hides other users' processes; kill(pid, 0) still tells
        # whether one exists (EPERM), though not when it started.
        try:
            os.kill(pid, 0)
        except PermissionError:
            return True
        except OSError:
            return False
        return False
    if expected_start is not None and current != expected_start:
        return False
    # State Z or X: exited (a zombie not yet reaped, or dead).
    return fields is not None and fields[0] not in ("Z", "X")


class LivenessReader:
    """`is_alive` for the same processes again and again (the ledger's entries, in every
    transaction), with their /proc/PID/stat kept open in between.

    A descriptor names the process it was opened on, not its pid: once that process is gone,
    reading it fails (ESRCH), even after a new process got the pid. So reading it again tells
    exactly what opening the path afresh would (running, the same start time, not a zombie),
    for half the cost; the state itself is read anew on every call. Descriptors not asked
    about since the last `forget_unused` are closed then, and at most `limit` are kept.
    """

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._open: dict[tuple[int, int], int] = {}
        self._used: set[tuple[int, int]] = set()

    def is_alive(self, pid: int, expected_start: int) -> bool:
        key = (pid, expected_start)
        fd = self._open.get(key)
        if fd is None:
            if len(self._open) >= self.limit or pid <= 0:
                return is_alive(pid, expected_start)
            try:
                fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                # Gone, or hidden by hidepid: the uncached check tells those apart.
                return is_alive(pid, expected_start)
            self._open[key] = fd
        self._used.add(key)
        try:
            fields = _fields_of(os.pread(fd, 4096, 0))
        except OSError:
            return False  # the process this descriptor was opened on has gone
        # Field 3, the state: Z or X, exited (a zombie not yet reaped, or dead).
        return (
            _start_of(fields) == expected_start
            and fields is not None
            and fields[0] not in ("Z", "X")
        )

    def forget_unused(self) -> None:
        for key in [k for k in self._open if k not in self._used]:
            os.close(self._open.pop(key))
        self._used = set()


def command_name(pid: int) -> str | None:
    """The process's command name (/proc/PID/comm: at most 15 characters), or None."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().decode("utf-8", "replace").rstrip("\n")
    except OSError:
        return None


def owner_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids, for every process visible in /proc."""
    tree: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return tree
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        ppid = parent_pid(pid)
        if ppid is not None:
            tree.setdefault(ppid, []).append(pid)
    return tree


def process_tree(roots: Iterable[int]) -> set[int]:
    """The given pids and all their living descendants."""
    tree = children_map()
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        stack.extend(tree.get(pid, ()))
    return seen
