"""Facts about processes, read from /proc.

A pid alone does not name a process for long: pids are reused. Every record that must outlive a
moment keeps the pid together with its start time (field 22 of /proc/PID/stat, in clock ticks since
boot), and a process counts as "the same" only when both match.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any


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
    """Start time of `pid` in clock ticks since the machine booted (in a time namespace too,
    whose offset /proc adds), or None if there is no such process."""
    return _start_of(_stat_fields(pid))


def start_field(pid: int) -> str | None:
    """The start time of `pid` as its /proc/PID/stat writes it here (field 22: clock ticks since
    boot, a time namespace's offset in them), or None where it cannot be read: what a shell
    reads there too, with nothing to take the offset off."""
    fields = _stat_fields(pid)
    return fields[19] if fields is not None and len(fields) >= 20 else None


def _start_of(fields: list[str] | None) -> int | None:
    if fields is None or len(fields) < 20:
        return None
    try:
        # Field 22 overall; fields[0] here is field 3 (state).
        return int(fields[19]) - _boot_offset()[1]
    except ValueError:
        return None


_OFFSET: list[tuple[float, int]] = []
_MONOTONIC_OFFSET: list[float] = []


def _boot_offset() -> tuple[float, int]:
    """How far this process's boot clock is ahead of the machine's, in seconds and in clock
    ticks: a time namespace's own (a container restored from a checkpoint, `unshare --time`),
    which /proc adds to every process's start time as this process reads it. (0, 0) in the
    machine's own namespace. Read once: a process never changes its time namespace."""
    if not _OFFSET:
        nanoseconds = _namespace_offsets().get(b"boottime", 0)
        ticks = nanoseconds * os.sysconf("SC_CLK_TCK") // 10**9
        _OFFSET.append((nanoseconds / 1e9, ticks))
    return _OFFSET[0]


def _namespace_offsets() -> dict[bytes, int]:
    """This process's time namespace's offsets of the machine's clocks, in nanoseconds, by
    clock name (`boottime`, `monotonic`); none in the machine's own namespace."""
    offsets: dict[bytes, int] = {}
    try:
        with open("/proc/self/timens_offsets", "rb") as f:
            for line in f.read(4096).splitlines():
                fields = line.split()
                if len(fields) == 3:
                    offsets[fields[0]] = int(fields[1]) * 10**9 + int(fields[2])
    except (OSError, ValueError):
        pass  # a kernel before time namespaces (5.6): the machine's clocks
    return offsets


def parent_pid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 2:
        return None
    try:
        return int(fields[1])
    except ValueError:
        return None


def ancestors(pid: int) -> list[int]:
    """`pid`'s parent, its parent's parent and so on, up to the first process."""
    found: list[int] = []
    parent = parent_pid(pid)
    while parent is not None and parent > 0 and parent not in found and len(found) < 1024:
        found.append(parent)
        parent = parent_pid(parent)
    return found


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` (field 5 of /proc/PID/stat)."""
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(int(name))
            if fields is not None and len(fields) > 2 and fields[2] == str(pgid):
                members.append(int(name))
    return members


def std_pipes(pid: int) -> tuple[int | None, int | None, int | None]:
    """The pipes (their inodes) on process `pid`'s stdin, stdout and stderr; None for one that
    is no pipe or cannot be read."""
    ends: list[int | None] = []
    for fd in (0, 1, 2):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            target = ""
        inode = None
        if target.startswith("pipe:[") and target.endswith("]"):
            with contextlib.suppress(ValueError):
                inode = int(target[6:-1])
        ends.append(inode)
    return ends[0], ends[1], ends[2]


def has_open(pid: int, file: os.stat_result, name: str | None = None) -> bool:
    """Whether process `pid` has `file` (as os.stat gave it) open; False where its open files
    cannot be read (another user's process, or gone). `name`, the file's name where the caller
    knows it: a descriptor whose target is named otherwise is passed over at once (a server's
    thousand open files cost a readlink each, not an fdinfo read too).

    Told from what /proc says of each descriptor (its target's name, then the inode and mount
    of /proc/PID/fdinfo), not by stat(2) of what it names: a file open on a mount whose server
    does not answer (a hung NFS mount, a FUSE daemon that never replies) would hold the caller
    as long, under the ledger's lock. Only a descriptor of `file`'s inode number whose device
    mountinfo does not tell as `file`'s, or any where fdinfo tells no inode (a kernel before
    5.14), has its target looked up."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    mounts: dict[int, int] | None = None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(_NO_FILE) or (name is not None and _base(target) != name):
            continue
        found = _fd_inode(pid, fd)
        if found is not None:
            mount, inode = found
            if inode != file.st_ino:
                continue
            if mounts is None:
                mounts = {**_mount_devices("self"), **_mount_devices(str(pid))}
            if mounts.get(mount) == file.st_dev:
                return True
            # The same inode number on another mount, one neither process can see, or one
            # whose files stat(2) tells another device (btrfs's subvolumes): looked up.
        try:
            opened = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (opened.st_dev, opened.st_ino) == (file.st_dev, file.st_ino):
            return True
    return False


#: How /proc names the target of a descriptor that is no file of a directory.
_NO_FILE = ("pipe:[", "socket:[", "anon_inode:")


def _base(target: str) -> str:
    """The last part of a descriptor's target as /proc names it (a path; with " (deleted)"
    after it where the file was removed, which is then no longer the file of that name)."""
    return target.rpartition("/")[2]


def _fd_inode(pid: int, fd: str) -> tuple[int, int] | None:
    """(mount id, inode number) of process `pid`'s descriptor `fd`, from its fdinfo; None where
    that cannot be read or tells no inode (a kernel before 5.14)."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as f:
            lines = f.read(4096).splitlines()
    except OSError:
        return None
    fields = dict(line.partition(b":")[::2] for line in lines if line[:1] in (b"m", b"i"))
    try:
        return int(fields[b"mnt_id"]), int(fields[b"ino"])
    except (KeyError, ValueError):
        return None


def _mount_devices(pid: str) -> dict[int, int]:
    """Mount id -> device of each mount that process `pid` (or "self") sees, from its
    mountinfo: the device the kernel keeps for the file system, the one stat(2) tells."""
    try:
        with open(f"/proc/{pid}/mountinfo", "rb") as f:
            return mount_devices(f.read())
    except OSError:
        return {}


def mount_devices(mountinfo: bytes) -> dict[int, int]:
    """Mount id -> device of each mount in `mountinfo` (a /proc/PID/mountinfo's text): its file
    system's, as its superblock has it, which is how /proc/locks names a locked file's."""
    devices: dict[int, int] = {}
    for line in mountinfo.splitlines():
        fields = line.split(maxsplit=3)
        if len(fields) < 4:
            continue
        major, _, minor = fields[2].partition(b":")
        with contextlib.suppress(ValueError, OverflowError):
            devices[int(fields[0])] = os.makedev(int(major), int(minor))
    return devices


def runs_handler(pid: int, signum: int) -> bool:
    """Whether `signum` sent to process `pid` would run a handler of the process's own: it is
    caught, and some thread of it does not block it (the kernel hands it to such a thread,
    to its main thread first where that one is open to it). False where it is not, or where
    that cannot be read. A thread asleep in sigtimedwait shows the signals it waits for
    unblocked meanwhile (gpuwait's wait for room, a reservation's among them): where it would
    be the one to take it, its wait takes it, not the handler."""
    bit = 1 << (signum - 1)
    try:
        if not _mask(f"/proc/{pid}/status", b"SigCgt") & bit:
            return False
        threads = os.listdir(f"/proc/{pid}/task")
    except (OSError, ValueError):
        return False
    open_to_it = []
    for tid in threads:
        with contextlib.suppress(OSError, ValueError):
            if not _mask(f"/proc/{pid}/task/{tid}/status", b"SigBlk") & bit:
                open_to_it.append(tid)
    if str(pid) in open_to_it:
        open_to_it = [str(pid)]
    return any(not _in_sigtimedwait(pid, tid) for tid in open_to_it)


def _in_sigtimedwait(pid: int, tid: str) -> bool:
    """Is thread `tid` of process `pid` asleep in sigtimedwait (told by the kernel function it
    sleeps in)? False where that cannot be read."""
    try:
        with open(f"/proc/{pid}/task/{tid}/wchan", "rb") as f:
            return b"sigtimedwait" in f.read(256)
    except OSError:
        return False


def _mask(path: str, field: bytes) -> int:
    """A signal mask of /proc's status file `path` (SigBlk, SigCgt); ValueError where there is
    none."""
    with open(path, "rb") as f:
        for line in f.read(1 << 16).splitlines():
            key, _, value = line.partition(b":")
            if key == field:
                return int(value.strip(), 16)
    raise ValueError(f"no {field!r} in {path}")


def pipe_full(fd: int) -> bool:
    """Whether the pipe on `fd` is full, or too full for a writer's next chunk (a page): its
    writer waits for a reader. False for anything but a pipe."""
    import fcntl
    import struct
    import termios

    try:
        capacity = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
        pending = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return False
    return bool(pending > capacity - 4096)


_BOOT_ID: list[str | None] = []


def boot_id() -> str | None:
    """This boot of the machine (the kernel's random boot id), None where /proc cannot tell.

    Pids and start times (ticks since boot) begin again at every boot, so a (pid, start time)
    written before the last one may name a process of today: the same service started again by
    the same boot, at the same tick. Read once: it never changes while a process runs."""
    if not _BOOT_ID:
        try:
            with open("/proc/sys/kernel/random/boot_id", "rb") as f:
                text = f.read(64).decode("ascii", "replace").strip()
        except OSError:
            text = ""
        _BOOT_ID.append(text or None)
    return _BOOT_ID[0]


def system_memory() -> tuple[int, int] | None:
    """(MemTotal, MemAvailable) of /proc/meminfo, in bytes; None where it cannot be read."""
    figures: dict[str, int] = {}
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f.read(1 << 16).decode("ascii", "replace").splitlines():
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable") and rest.split()[1:] == ["kB"]:
                    figures[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        return None
    if len(figures) < 2 or figures["MemTotal"] <= 0:
        return None
    return figures["MemTotal"], figures["MemAvailable"]


def boot_clock() -> float:
    """Seconds since the machine booted, suspended time included (CLOCK_BOOTTIME). Unlike the
    wall clock it is never stepped (NTP, `date -s`, a VM resumed), and every process of one boot
    reads the same clock, in a time namespace too (its offset taken off): a stamp one process
    took measures a duration in another, as long as the entry it is in was written in this boot
    (`boot_id`)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) - _boot_offset()[0]


def monotonic_clock() -> float:
    """Seconds since the machine booted, suspended time left out (CLOCK_MONOTONIC, which
    stops while the machine sleeps, as every process does), without this process's time
    namespace's offset: the boot clock less it is how long the machine has slept since it
    booted, the same for every process of one boot."""
    if not _MONOTONIC_OFFSET:
        _MONOTONIC_OFFSET.append(_namespace_offsets().get(b"monotonic", 0) / 1e9)
    return time.clock_gettime(time.CLOCK_MONOTONIC) - _MONOTONIC_OFFSET[0]


def slept(boot_now: float | None = None) -> float:
    """How long the machine has been suspended since it booted, as of `boot_now` (a reading
    of `boot_clock`, taken now if not given): the same for every process of one boot, so that
    what two readings differ by is how long it slept between them."""
    boot = boot_clock() if boot_now is None else boot_now
    return max(0.0, boot - monotonic_clock())


def is_alive(pid: int, expected_start: int | None) -> bool:
    """True when `pid` runs and, if `expected_start` is given, is the process that started then."""
    if pid <= 0:
        return False
    # One read of /proc/PID/stat for both the start time and the state: the ledger checks
    # every entry this way under its lock, in every transaction.
    fields = _stat_fields(pid)
    current = _start_of(fields)
    if current is None:
        return _exists_hidden(pid)
    if expected_start is not None and current != expected_start:
        return False
    # State Z or X: exited (a zombie not yet reaped, or dead).
    return fields is not None and fields[0] not in ("Z", "X")


def hidden(pid: int) -> bool:
    """True when `pid` runs as another user's process that /proc keeps from this one (mounted
    with hidepid): when it started, whose it is and what it runs cannot be read."""
    return pid > 0 and _stat_fields(pid) is None and _exists_hidden(pid)


def _exists_hidden(pid: int) -> bool:
    # /proc mounted with hidepid hides other users' processes; kill(pid, 0) still tells
    # whether one exists (EPERM), though not when it started.
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True
    except OSError:
        return False
    return False


def stopped(pid: int, expected_start: int | None) -> bool:
    """True when `pid` (the process that started at `expected_start`, if given) is stopped by a
    signal: Ctrl-Z, SIGSTOP, a background job's SIGTTOU or SIGTTIN (state T). A process stopped
    by a tracer at a system call (state t) is not."""
    fields = _stat_fields(pid)
    if fields is None or (expected_start is not None and _start_of(fields) != expected_start):
        return False
    return fields[0] == "T"


class LivenessReader:
    """`is_alive` for the same processes again and again: the ledger's entries, in every
    transaction.

    A pidfd (pidfd_open(2)) names one process, not its pid: it becomes readable once that
    process has exited (a zombie included), and a new process that gets the pid later does not
    make it so. Once a process was found to be the one an entry names (its start time, read
    from /proc after its pidfd was opened, matches), one poll(2) over all the pidfds tells which
    have exited since: every process's state is looked at anew in every call, for one system
    call instead of a read of /proc per process. Where no pidfd can be had (a kernel before
    5.3, more than `limit` processes, a process gone or hidden by /proc's hidepid), `is_alive`
    answers for it as before.
    """

    def __init__(self, limit: int | None = None) -> None:
        # Half the descriptors this process may open at most (commands inherit none of them).
        self.limit = min(4096, os.sysconf("SC_OPEN_MAX") // 2) if limit is None else limit
        self._pidfds: dict[tuple[int, int], int] = {}
        self._poll: Any = None
        self._calls = 0

    def alive(self, processes: Sequence[tuple[int, int]]) -> list[bool]:
        """For each (pid, start time): whether it still runs (see `is_alive`)."""
        self._calls += 1
        if self._calls == 1:
            # Opening the pidfds costs more than it saves until the second call, and many
            # processes (a `gpuwait cancel`, a submission that runs at once) make one only.
            return [is_alive(pid, start) for pid, start in processes]
        if self._poll is None:
            try:
                import select  # here, not at start-up: most launches never get this far
            except ImportError:  # an interpreter whose modules this user cannot read
                return [is_alive(pid, start) for pid, start in processes]
            self._poll = select.poll()
        wanted = set(processes)
        for key in [k for k in self._pidfds if k not in wanted]:
            self._drop(key)
        answers: dict[tuple[int, int], bool] = {}
        for key in wanted.difference(self._pidfds):
            pid, start = key
            fd = self._open(pid) if len(self._pidfds) < self.limit else None
            answers[key] = is_alive(pid, start)  # after the pidfd: it names this process
            if fd is None:
                continue
            if answers[key]:
                self._pidfds[key] = fd
                self._poll.register(fd, _POLLIN)
            else:
                os.close(fd)
        exited = {fd for fd, _ in self._poll.poll(0)}
        return [answers[k] if k in answers else self._pidfds[k] not in exited for k in processes]

    def close(self) -> None:
        """Close every pidfd; the next call is again a first one."""
        for key in list(self._pidfds):
            self._drop(key)
        self._calls = 0

    def _drop(self, key: tuple[int, int]) -> None:
        fd = self._pidfds.pop(key)
        self._poll.unregister(fd)
        os.close(fd)

    @staticmethod
    def _open(pid: int) -> int | None:
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is None or pid <= 0:
            return None
        try:
            fd: int = pidfd_open(pid)  # close-on-exec, always: no command inherits it
        except OSError:
            return None
        return fd


#: poll(2)'s "readable", which a pidfd becomes when its process exits.
_POLLIN = 0x001


def command_name(pid: int) -> str | None:
    """The process's command name (/proc/PID/comm: at most 15 characters), or None."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().decode("utf-8", "replace").rstrip("\n")
    except OSError:
        return None


#: How much read_at_most asks for at once: each read allocates that much first, a few MB
#: that a small address space (`ulimit -v`) may not have, for files of a few KB.
READ_CHUNK = 64 << 10


def read_at_most(fd: int, cap: int) -> bytes:
    """What `fd` has left to read, but never more than `cap` + 1 bytes: one byte past the cap
    tells the caller the file is too large, however large it is or grows."""
    chunks = []
    size = 0
    while size <= cap:
        chunk = os.read(fd, min(READ_CHUNK, cap + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


#: More than any command line exec takes (its arguments may fill a quarter of the stack's
#: limit, at most 6 MiB): a command line is read whole, its arguments all counted.
_COMMAND_LINE_CAP = 8 << 20


def command_line(pid: int, errors: str = "replace") -> list[str] | None:
    """The process's arguments (/proc/PID/cmdline), or None; a kernel thread has none ([]).
    `errors` = "surrogateescape" spells bytes that are no UTF-8 as Python's own `sys.argv`
    does (`sys.orig_argv` to compare with); "replace" shows them as U+FFFD."""
    read = command_line_read(pid, errors)
    return None if read is None else read[0]


def command_line_read(pid: int, errors: str = "replace") -> tuple[list[str], bool] | None:
    """The process's arguments, and whether that was all of them; None where unreadable.
    Read whole, past the first 64 KiB (xargs handing a program a thousand file names): cut,
    it would not be the command line the program's own entry keeps. Only past
    _COMMAND_LINE_CAP, more than exec takes, is a line read in part (its last argument that
    did not fit left out). `errors` as for `command_line`."""
    try:
        fd = os.open(f"/proc/{pid}/cmdline", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = read_at_most(fd, _COMMAND_LINE_CAP)
    except OSError:
        return None
    finally:
        os.close(fd)
    whole = len(raw) <= _COMMAND_LINE_CAP
    raw = raw[:_COMMAND_LINE_CAP]
    return [arg.decode("utf-8", errors) for arg in raw.split(b"\0")[:-1]], whole


def working_dir(pid: int) -> str | None:
    """The process's working directory, or None where it cannot be read."""
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def owner_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def user_name(uid: int) -> str:
    """The login name of `uid`, or the number where it has none."""
    import pwd  # only where a name is shown

    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


def environ_value(pid: int, name: bytes) -> str | None:
    """`name` in the environment process `pid` started with ("" when absent); None when it
    cannot be read (another user's process, or gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            # Whole: the kernel bounds it (with the arguments, a quarter of the stack limit,
            # 2 MiB by default), and gpuwait's own variables come last in its commands'.
            environ = f.read()
    except OSError:
        return None
    prefix = name + b"="
    for item in environ.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return ""


def started_with(name: bytes, value: str) -> int | None:
    """The first of this user's processes that started with `name` = `value` in their
    environment: one whose parent did not (the others are its descendants, which inherited
    it), the oldest where several are; None where none did. Reads every process of this user's."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    uid = os.getuid()
    found = [
        int(pid)
        for pid in names
        if pid.isdigit() and owner_uid(int(pid)) == uid and environ_value(int(pid), name) == value
    ]
    firsts = [(start_time(pid) or 0, pid) for pid in found if parent_pid(pid) not in found]
    return min(firsts)[1] if firsts else None


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


#: Whether this kernel lists each thread's children (/proc/PID/task/TID/children: Linux 3.5
#: on, built with CONFIG_PROC_CHILDREN as the common distributions are); None: not asked yet.
_children_lists: bool | None = None


def children_lists() -> bool:
    """Whether `process_tree` can walk down from its roots (see `_children`)."""
    global _children_lists
    if _children_lists is None:
        pid = os.getpid()
        _children_lists = os.path.exists(f"/proc/{pid}/task/{pid}/children")
    return _children_lists


def _children(pid: int) -> list[int]:
    """`pid`'s children: the union of its threads' children lists ([] once it is gone).

    Each thread lists the children it started, so all of them are read: a command's worker
    processes may be started by any of its threads.
    """
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for tid in threads:
        try:
            fd = os.open(f"/proc/{pid}/task/{tid}/children", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # the thread has ended meanwhile
        try:
            chunks = []
            while chunk := os.read(fd, 4096):
                chunks.append(chunk)
        except OSError:
            continue
        finally:
            os.close(fd)
        found.extend(int(child) for child in b"".join(chunks).split())
    return found


def process_tree(roots: Iterable[int], pruned: AbstractSet[int] = frozenset()) -> set[int]:
    """The given pids and all their living descendants, but for those of `pruned` and theirs.

    Walked down from the roots through the kernel's children lists where it keeps them: a few
    reads per process of the tree, where reading every process's parent costs a read of each
    process on the machine (thousands on a shared server), and a running job's tree is looked
    at every sample.
    """
    below = _children if children_lists() else children_map().get
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if pid in seen or pid in pruned:
            continue
        seen.add(pid)
        stack.extend(below(pid) or ())
    return seen


#: Where the kernel lists the locks taken, and the mounts this process sees.
PROC_LOCKS = "/proc/locks"
MOUNTINFO = "/proc/self/mountinfo"


def proc_locks() -> list[bytes]:
    """The lines of /proc/locks (at most its first 4 MiB); none where it cannot be read."""
    try:
        with open(PROC_LOCKS, "rb") as f:
            return f.read(1 << 22).splitlines()
    except OSError:
        return []


def lock_device(fd: int, known: dict[int, int] | None = None) -> int:
    """The device /proc/locks names the locks on `fd`'s file by: that of its mount, found
    through /proc/self/fdinfo's mnt_id in /proc/self/mountinfo. On a btrfs subvolume or an
    overlay file system stat(2)'s st_dev is another one; it is taken where those cannot be
    read. `known`: the devices found so far, by mount id, kept there, for several files to be
    looked at with one look at the mount table (16 MB on a node of 100,000 mounts) a mount."""
    with contextlib.suppress(OSError):
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            info = f.read(1 << 16)
        for line in info.splitlines():
            name, _, value = line.partition(b":")
            if name == b"mnt_id" and value.strip().isdigit():
                mount = int(value)
                if known is not None and mount in known:
                    return known[mount]
                with open(MOUNTINFO, "rb") as f:
                    device = _mount_device(f.read(), mount)
                if device is not None:
                    if known is not None:
                        known[mount] = device
                    return device
    return os.fstat(fd).st_dev


def _mount_device(mountinfo: bytes, mount_id: int) -> int | None:
    """The device of the mount `mount_id` in `mountinfo`, as `mount_devices` tells it, from its
    line alone: a node's mountinfo of 100,000 mounts (16 MB) is not parsed whole at each read
    of a ledger that asks."""
    key = b"%d " % mount_id
    start = 0 if mountinfo.startswith(key) else mountinfo.find(b"\n" + key) + 1
    if start == 0 and not mountinfo.startswith(key):
        return None  # not listed: st_dev is taken
    end = mountinfo.find(b"\n", start)
    return mount_devices(mountinfo[start : end if end >= 0 else len(mountinfo)]).get(mount_id)
