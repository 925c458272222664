"""Facts about processes, read from /proc.

A pid alone does not name a process for long: pids are reused. Every record that must outlive a
moment keeps the pid together with its start time (field 22 of /proc/PID/stat, in clock ticks since
boot), and a process counts as "the same" only when both match.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return None
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
